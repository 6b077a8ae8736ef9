"""Attention alone: torch's bf16 SDPA against TransformerEngine's FP8 dot-product attention.

Does FP8 attention pay on Hopper? This times forward + backward of one
causal attention call at the Llama benchmark's shape (B x T tokens, 32 query heads, 8 KV heads,
head dim 128, inputs [B, H, T, D]: `--inputs bthd` lays them out as a transformers Llama hands
them, transposed views of [B, T, H, D] (RoPE keeps its projection's layout: checked on
transformers 5.23); the default `bhtd`, contiguous, is the layout of the earlier measurements),
and measures each variant's error against a float32 reference (SQNR of the output and of the
three input gradients). Variants:

  sdpa-bf16      torch.nn.functional.scaled_dot_product_attention (what transformers' "sdpa" runs)
  sdpa-bf16-compiled  the same under torch.compile (inductor)
  te-bf16        TE's DotProductAttention without FP8 (its own choice of fused kernel)
  te-fp8-delayed TE's FP8 DPA under DelayedScaling(fp8_dpa=True) (cuDNN's FP8 fused attention)
  te-fp8-current TE's FP8 DPA under Float8CurrentScaling(fp8_dpa=True)
  fp8plug-dpa    what a model with FP8RecipeKwargs(fp8_dpa=True) runs: fp8plug.hf.fp8_attention's
                 attention function in training mode (TE's FP8 DPA, delayed scaling, plus the
                 update of the backward scales after each backward)

    python3 benchmarks/attention/attention_speed.py --batch 4 --seq 2048 --json out.json
    python3 benchmarks/attention/attention_speed.py --seq 2048,4096,8192 --inputs bthd --variants sdpa-bf16,fp8plug-dpa

The float32 reference runs one batch row and one key/value head (with its query heads) at a
time, so that its full T x T scores fit in memory at 8192 tokens.

GPU only (TE's FP8 attention is cuDNN's, sm_90+).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    reference, test = reference.double(), test.double()
    noise = (reference - test).pow(2).mean()
    return float(10 * torch.log10(reference.pow(2).mean() / noise.clamp_min(1e-30)))


def inputs(batch, seq, heads, kv_heads, dim, seed=0, layout="bhtd"):
    """q, k, v of shape [B, H, T, D]: contiguous ("bhtd"), or transposed views of contiguous
    [B, T, H, D] tensors ("bthd"), which is what a transformers Llama's attention function gets."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def one(h):
        if layout == "bthd":
            return torch.randn(batch, seq, h, dim, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
        return torch.randn(batch, h, seq, dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    return one(heads), one(kv_heads), one(kv_heads)


def sdpa(q, k, v):
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1).transpose(1, 2)


def make_te(recipe_name, heads, kv_heads, dim, layout):
    from fp8plug.backends.te.imports import TEApi, import_te

    te = import_te()
    from transformer_engine.common import recipe as te_recipe

    dpa = te.DotProductAttention(heads, dim, num_gqa_groups=kv_heads, attn_mask_type="causal", qkv_format="bshd")
    recipe = {"delayed": lambda: te_recipe.DelayedScaling(fp8_dpa=True),
              "current": lambda: te_recipe.Float8CurrentScaling(fp8_dpa=True),
              "bf16": lambda: None}[recipe_name]()
    api = TEApi(te)

    def run(q, k, v):
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        if layout == "contiguous":
            qs, ks, vs = (t.contiguous() for t in (qs, ks, vs))
        with api.autocast(enabled=recipe is not None, recipe=recipe):
            out = dpa(qs, ks, vs)
        return out.view(q.shape[0], q.shape[2], q.shape[1], q.shape[3])

    return run


def fp8plug_dpa():
    """fp8plug.hf.fp8_attention's attention function, as a converted Llama's attention module calls it."""
    from torch import nn

    from fp8plug.hf.fp8_attention import fp8_attention_forward

    module = nn.Module().train()
    module.is_causal = True

    def run(q, k, v):
        module.num_key_value_groups = q.shape[1] // k.shape[1]
        return fp8_attention_forward(module, q, k, v, None, scaling=q.shape[-1] ** -0.5)[0]

    return run


def reference(q, k, v, grad):
    """Float32 output and input gradients, math kernel, one (batch row, key/value head) at a time."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], device=q.device)
    dq, dk, dv = (torch.empty(t.shape, device=t.device) for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        for b in range(q.shape[0]):
            for h in range(k.shape[1]):
                heads = slice(h * groups, (h + 1) * groups)
                got = fwd_bwd(lambda a, c, d: sdpa(a.float(), c.float(), d.float()), q[b:b + 1, heads],
                              k[b:b + 1, h:h + 1], v[b:b + 1, h:h + 1], grad[b:b + 1, :, heads].float())
                out[b:b + 1, :, heads], dq[b:b + 1, heads], dk[b:b + 1, h:h + 1], dv[b:b + 1, h:h + 1] = got
    return out, dq, dk, dv


def fwd_bwd(fn, q, k, v, grad):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad)
    return out, q.grad, k.grad, v.grad


def run_seq(args, seq, compiled_sdpa):
    """Every variant at `seq` tokens: its time and its error against the float32 reference."""
    q, k, v = inputs(args.batch, seq, args.heads, args.kv_heads, args.dim, layout=args.inputs)
    grad = torch.randn(args.batch, seq, args.heads, args.dim, device="cuda", dtype=torch.bfloat16,
                       generator=torch.Generator(device="cuda").manual_seed(1))
    ref = reference(q, k, v, grad)
    flops = 4 * args.batch * args.heads * seq * seq * args.dim / 2 * 3.5  # causal fwd + bwd (2.5x fwd)
    rows = []
    for name in args.variants.split(","):
        try:
            fn = (sdpa if name == "sdpa-bf16" else compiled_sdpa if name == "sdpa-bf16-compiled"
                  else fp8plug_dpa() if name == "fp8plug-dpa"
                  else make_te(name.rsplit("-", 1)[-1], args.heads, args.kv_heads, args.dim, args.layout))
            for _ in range(3):
                got = fwd_bwd(fn, q, k, v, grad)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.iters):
                fwd_bwd(fn, q, k, v, grad)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / args.iters * 1e3
            row = {"variant": name, "seq": seq, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1),
                   **{f"sqnr_{what}": round(sqnr(r, g), 1) for what, r, g in zip(("out", "dq", "dk", "dv"), ref, got)}}
        except Exception as error:  # noqa: BLE001 - a variant this stack cannot run is reported
            row = {"variant": name, "seq": seq, "error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", default="2048", help="tokens per sequence; a comma list runs each")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--variants", default="sdpa-bf16,te-bf16,te-fp8-delayed,te-fp8-current,fp8plug-dpa")
    parser.add_argument("--layout", default="view", choices=("view", "contiguous"),
                        help="te-* variants: hand TE the [B, T, H, D] view as it is, or a contiguous copy")
    parser.add_argument("--inputs", default="bhtd", choices=("bhtd", "bthd"),
                        help="memory layout of the [B, H, T, D] inputs (bthd: as a transformers Llama's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    rows = []
    compiled_sdpa = torch.compile(sdpa)
    for seq in [int(text) for text in str(args.seq).split(",")]:
        rows += run_seq(args, seq, compiled_sdpa)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
