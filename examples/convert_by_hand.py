"""Convert a plain PyTorch model to FP8 by hand: convert_model, apply_fp8_autowrap, a training loop.

No Accelerate here: you own the loop. The steps are
  1. build the model as usual (plain nn.Linear layers);
  2. `fp8plug.convert_model(model, recipe=...)` swaps the eligible Linears in place and returns a
     ConversionReport saying what was converted and why anything was skipped;
  3. `fp8plug.apply_fp8_autowrap(model, recipe)` makes the forward context-aware: FP8 in
     training mode, high precision in eval mode;
  4. build the optimizer (or keep yours: converted layers keep the very same Parameters), then
     train; keep converting before torch.compile and before any DDP/FSDP wrapping.

    python3 examples/convert_by_hand.py                  # native engine, CPU or GPU
    python3 examples/convert_by_hand.py --backend auto   # automatic choice (te, ao or native)
    python3 examples/convert_by_hand.py --device cuda --backend te --width 4096
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs


class MLP(nn.Module):
    """A plain model: two aligned hidden layers, one layer whose width (10) FP8 GEMMs cannot take,
    and an output head we choose to keep in high precision."""

    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.odd = nn.Linear(width, 10)
        self.head = nn.Linear(10, 1)

    def forward(self, x):
        h = x + self.down(torch.relu(self.up(x)))
        return self.head(torch.relu(self.odd(h)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="native", help="native, ao, te, msamp, or auto (default: native)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=64, help="rows per step (a multiple of 16)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)

    torch.manual_seed(0)
    model = MLP(args.width).to(device)
    plain_keys = set(model.state_dict())

    # 1-2: convert in place. "auto" (or None) picks the engine: msamp, te, ao, native, first that runs.
    # convert_model converts every eligible layer but an lm_head (fp8_output_head); auto_filter=False says so
    # even where FP8PLUG_AUTO_FILTER=true asks for the speed filter (which keeps small layers in bf16)
    recipe = FP8RecipeKwargs(backend=args.backend, modules_to_ignore=["head"], auto_filter=False)
    report = fp8plug.convert_model(model, recipe=recipe)
    print(report)  # converted up/down; odd skipped (not divisible by 16); head skipped (ignored)

    # 3: FP8 in train mode, high precision in eval mode (use_autocast_during_eval=False).
    fp8plug.apply_fp8_autowrap(model, recipe)

    # 4: an ordinary loop. bf16 autocast covers what stays in high precision.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = torch.nn.Linear(args.width, 1).to(device)  # a random linear target to fit
    losses = []
    model.train()
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.width, device=device)
        with torch.no_grad():
            y = target(x)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f} after {args.steps} steps")

    # The engine's plain_state_dict drops its own entries (TransformerEngine's `_extra_state`;
    # native and ao add none), so the checkpoint loads strictly into an unconverted MLP.
    engine = fp8plug.get_backend(report.backend)
    state_dict = engine.plain_state_dict(model.state_dict())
    plain = MLP(args.width).to(device)
    plain.load_state_dict(state_dict, strict=True)
    model.eval()
    with torch.no_grad():
        x = torch.randn(16, args.width, device=device)
        # eval runs in high precision: the plain model's numbers, up to GEMM kernel rounding
        # (exactly the same with native and ao; TransformerEngine's kernels may round differently)
        y_fp8_model, y_plain = model(x), plain(x)
        eval_diff = ((y_fp8_model - y_plain).norm() / y_plain.norm()).item()
    print(f"plain keys: {set(state_dict) == plain_keys}; eval vs the plain model: relative difference {eval_diff:.2e}")

    # And back: unconvert_model swaps the FP8 layers for nn.Linear holding the same Parameters.
    fp8plug.remove_fp8_autowrap(model)
    fp8plug.unconvert_model(model)
    print(f"after unconvert_model, FP8 layers left: {fp8plug.has_fp8_layers(model)}")

    print("result: " + json.dumps({"engine": report.backend, "converted": report.converted,
                                   "skipped": report.skipped, "first_loss": losses[0], "last_loss": losses[-1],
                                   "plain_keys": set(state_dict) == plain_keys, "eval_diff": eval_diff,
                                   "device": device.type}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
