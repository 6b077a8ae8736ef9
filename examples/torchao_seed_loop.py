"""The torchao float8 README's two training loops, run on fp8plug through `fp8plug.integrations.float8`.

Code written for torchao's `torchao.float8` entry points runs with one import changed:

    from torchao.float8 import convert_to_float8_training          # before
    from fp8plug.integrations.float8 import convert_to_float8_training          # after

The config classes are fp8plug's own, named so as not to pass for torchao's: `Float8TrainingConfig`,
`Float8CastConfig`, `Float8ScalingType` (the README's `Float8LinearConfig`, `CastConfig`,
`ScalingType` still import from fp8plug.integrations.float8, with a DeprecationWarning).

Dynamic scaling (every tensor scaled from its own amax) runs on torchao's Float8Linear (the `ao`
engine). Delayed scaling (scales from a history of past amaxes), which torchao removed in 0.10,
runs on fp8plug's `native` engine; `sync_float8_amax_and_scale_history` is kept so the loop
runs unchanged (the native layers update their histories inside forward and backward).

    python3 examples/torchao_seed_loop.py                    # both loops, CPU or GPU
    python3 examples/torchao_seed_loop.py --scaling delayed --compile --device cuda
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from fp8plug.integrations.float8 import (
    Float8CastConfig,
    Float8ScalingType,
    Float8TrainingConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
    sync_float8_amax_and_scale_history,
)


class Model(nn.Module):
    """A small MLP with an `output` layer (which the filter keeps in high precision) and one layer
    whose widths are not divisible by 16 (which the filter skips too)."""

    def __init__(self, dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)
        self.odd = nn.Linear(dim, 24)
        self.output = nn.Linear(24, dim)

    def forward(self, x):
        return self.output(torch.relu(self.odd(x + self.w2(torch.relu(self.w1(x))))))


def make_target(dim: int, device):
    """A fixed random rank-8 linear map for the model to learn."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(dim, 8, generator=g) / dim**0.5
    b = torch.randn(8, dim, generator=g) / 8**0.5
    w = (a @ b).to(device)
    return lambda x: x @ w


def module_filter_fn(mod: nn.Module, fqn: str) -> bool:
    """The seed's filter: don't convert the output module, nor Linears not divisible by 16."""
    if fqn == "output":
        return False
    if isinstance(mod, nn.Linear):
        if mod.in_features % 16 != 0 or mod.out_features % 16 != 0:
            return False
    return True


def dynamic_loop(args, device) -> dict:
    """The seed's first example: tensorwise dynamic scaling (torchao)."""
    m = Model(args.dim).to(device)
    target = make_target(args.dim, device)
    convert_to_float8_training(m, module_filter_fn=module_filter_fn)
    model = m  # optional: FSDP2 (fully_shard) would wrap it here, after conversion
    if args.compile:
        m = torch.compile(m)
    optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(args.iters):
        x = torch.randn(args.batch, args.dim, device=device)
        optimizer.zero_grad()
        y = m(x)
        loss = (y - target(x)).pow(2).mean()  # the seed has y.sum(); a loss that can fall tells more
        loss.backward()
        optimizer.step()
        # FSDP2 with float8 all-gather: one all-reduce computes every weight's next scale.
        # Without FSDP (as here) it does nothing, so the loop is the same either way.
        precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    return summary(model, losses)


def delayed_loop(args, device) -> dict:
    """The seed's second example: delayed scaling for input, weight and grad_output (native)."""
    m = Model(args.dim).to(device)
    target = make_target(args.dim, device)
    config = Float8TrainingConfig(
        enable_amax_init=False,  # torchao workarounds for autocast + compile + FSDP; accepted, not needed
        enable_pre_and_post_forward=False,
        cast_config_input=Float8CastConfig(scaling_type=Float8ScalingType.DELAYED),
        cast_config_weight=Float8CastConfig(scaling_type=Float8ScalingType.DELAYED),
        cast_config_grad_output=Float8CastConfig(scaling_type=Float8ScalingType.DELAYED),
    )
    convert_to_float8_training(m, config=config, module_filter_fn=module_filter_fn)
    model = m
    if args.compile:
        m = torch.compile(m)
    optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(args.iters):
        x = torch.randn(args.batch, args.dim, device=device)
        optimizer.zero_grad()
        y = m(x)
        loss = (y - target(x)).pow(2).mean()
        loss.backward()
        sync_float8_amax_and_scale_history(model)  # a no-op kept for the seed's loop
        optimizer.step()
        losses.append(loss.item())
    return summary(model, losses)


def summary(model: nn.Module, losses) -> dict:
    kinds = {name: type(module).__name__ for name, module in model.named_children()}
    return {"layers": kinds, "first_loss": losses[0], "last_loss": losses[-1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scaling", default="both", choices=["dynamic", "delayed", "both"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=32, help="rows per step (a multiple of 16)")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slow to start on a CPU)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    torch.manual_seed(0)
    result = {"device": device.type}
    for name, loop in (("dynamic", dynamic_loop), ("delayed", delayed_loop)):
        if args.scaling in (name, "both"):
            result[name] = loop(args, device)
            out = result[name]
            print(f"{name}: layers {out['layers']}")
            print(f"{name}: loss first {out['first_loss']:.4f}, last {out['last_loss']:.4f}")
    print("result: " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
