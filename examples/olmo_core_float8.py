"""Float8 training configured the OLMo-core way: `fp8plug.integrations.float8.Float8Config`.

OLMo-core describes float8 with a `Float8Config` (torchao Float8Linear settings `ao`, or a
torchao recipe name `ao_recipe`, or MX formats `ao_mx`; at most one) and applies it with
`Float8Config.apply_float8_linear(model, modules_to_ignore=...)`, in place, before compiling,
activation checkpointing or FSDP wrapping. fp8plug.integrations.float8 offers the same names, served by the
torchao engine under fp8plug's conversion rules (and eval in high precision).

    python3 examples/olmo_core_float8.py                     # ao=AOFloat8LinearConfig(...), CPU or GPU
    python3 examples/olmo_core_float8.py --recipe rowwise    # ao_recipe="rowwise"
    python3 examples/olmo_core_float8.py --recipe mxfp8      # ao_mx (Blackwell, or emulated on a CPU)
"""

from __future__ import annotations

import argparse
import json

import torch

from fp8plug.bench.toy_model import DecoderConfig, TinyDecoder, lm_loss, synthetic_batches
from fp8plug.integrations.float8 import (
    AOFloat8LinearConfig,
    AOMXLinearConfig,
    Float8Config,
    precompute_float8_dynamic_scale_for_fsdp,
)


def float8_config(recipe: str) -> Float8Config:
    """The Float8Config for a --recipe choice. The output head stays in high precision."""
    if recipe == "config":
        # torchao Float8LinearConfig fields, as OLMo-core's AOFloat8LinearConfig spells them
        return Float8Config(ao=AOFloat8LinearConfig(round_scales_to_power_of_2=True), modules_to_ignore=["lm_head"])
    if recipe == "mxfp8":
        return Float8Config(ao_mx=AOMXLinearConfig(), modules_to_ignore=["lm_head"])
    return Float8Config(ao_recipe=recipe, modules_to_ignore=["lm_head"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="config",
                   choices=["config", "tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile after conversion (slow to start on a CPU)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)

    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=128, dim=args.dim, n_layers=args.layers, n_heads=4, ffn_dim=2 * args.dim,
                        max_seq_len=32)
    model = TinyDecoder(cfg).to(device)

    config = float8_config(args.recipe)
    report = config.apply_float8_linear(model)  # in place; names in modules_to_ignore must match exactly
    print(report)
    if args.compile:
        model = torch.compile(model)  # after conversion, as OLMo-core requires

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    # bf16 autocast on a GPU. torchao's Float8Linear follows CUDA autocast only, so the CPU run
    # stays in float32 (the FP8 GEMMs are FP8 either way).
    use_autocast = device.type == "cuda"
    # With FSDP2 float8 all-gather, each optimizer step is followed by one all-reduce of scales.
    precompute = config.should_precompute_float8_dynamic_scale_for_fsdp
    losses = []
    model.train()
    for tokens in synthetic_batches(args.steps, batch=4, seq=32, vocab=cfg.vocab_size, device=device):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            loss = lm_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f} after {args.steps} steps")
    print("result: " + json.dumps({"recipe": args.recipe, "converted": len(report.fp8_linears),
                                   "skipped": sorted(report.skipped), "first_loss": losses[0],
                                   "last_loss": losses[-1], "device": device.type}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
