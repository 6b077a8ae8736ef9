"""The grouped FP8 GEMM of fp8plug's experts against torch's bf16 grouped GEMM, at MoE models' shapes.

For each projection of the Mixtral-shaped and the Qwen3-MoE-shaped model of moe_llm.py (gate_up
and down), with routing-imbalanced token groups (each token's top-k experts drawn from a skewed
distribution: the expert logits are normal with standard deviation `--skew`, so a few experts
get several times the mean load, as trained routers do), times:

  bf16      torch.nn.functional.grouped_mm (torch._grouped_mm where torch lacks it) in bfloat16,
            forward alone and forward + backward (autograd)
  fp8       fp8plug.backends.native.grouped.grouped_fp8_linear: the casts, the group padding to
            16 rows (counted: it is part of the call) and the three FP8 grouped GEMMs
  fp8-gemm  the FP8 forward GEMM alone on operands cast beforehand (what the kernel costs)
  fp8 unfused  forward + backward with the casts as separate torch ops (what eager training ran
            before grouped_cast.py fused them; the same bytes)
  fp8 dense  each of the three GEMMs as one dense FP8 GEMM per expert instead of the grouped
            kernel (dense_experts.dense_grouped_mm: torch._scaled_mm on the expert's rows or columns of
            the same operands, written into its slice of the result), with the groups' bounds
            known on the host, and again reading them from the GPU every call (the sync a training
            step pays); each one's largest difference from the grouped kernel's result is reported

and reports milliseconds, TFLOP/s of the useful work (2 * rows * K * N a GEMM, three GEMMs for
forward + backward; padding rows not counted as work) and that as a share of the GPU's dense peak
(the roofline: `--bf16-peak` and `--fp8-peak`, H100/H200 SXM by default), plus the padding rows
the layout adds. CUDA only, sm_90 for FP8; `--device cpu` runs one tiny shape through the
emulation so the script is known to work.

    python3 benchmarks/moe/grouped_gemm.py --json out/grouped_gemm.json
    python3 benchmarks/moe/grouped_gemm.py --weight-dtype float32 --json out/grouped_gemm_fp32.json
    python3 benchmarks/moe/grouped_gemm.py --device cpu
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fp8plug.backends.native import dense_experts, grouped  # noqa: E402

# model -> (tokens, experts, top_k, hidden, expert ffn): B4 x T2048 of moe_llm.py's models
SHAPES = {
    "mixtral": (8192, 8, 2, 4096, 14336),
    "qwen3moe": (8192, 128, 8, 2048, 768),
    "toy": (256, 4, 2, 64, 32),
}


def group_sizes(tokens: int, experts: int, top_k: int, skew: float, seed: int = 0) -> torch.Tensor:
    """Rows per expert when each token picks top_k distinct experts from skewed probabilities."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(experts, generator=gen) * skew, 0)
    choice = torch.multinomial(probs.expand(tokens, experts), top_k, replacement=False, generator=gen)
    return torch.bincount(choice.reshape(-1), minlength=experts)


def grouped_bf16(x, w, offs):
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return fn(x, w.transpose(-2, -1), offs=offs)


def timed(fn, device, repeats: int) -> float:
    """Median milliseconds of `fn` (after two warm-up calls)."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        import time

        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def unfused(fn):
    """`fn` with the grouped GEMM's casts as plain torch ops (grouped_cast.py's fusion off)."""
    def run():
        fused, grouped._fused = grouped._fused, lambda t: False
        try:
            return fn()
        finally:
            grouped._fused = fused
    return run


def measure(model: str, projection: str, device, skew: float, repeats: int, peaks,
            weight_dtype: torch.dtype = torch.bfloat16) -> dict:
    tokens, experts, top_k, hidden, ffn = SHAPES[model]
    n, k = (2 * ffn, hidden) if projection == "gate_up" else (hidden, ffn)
    sizes = group_sizes(tokens, experts, top_k, skew)
    rows = int(sizes.sum())
    offs = sizes.cumsum(0).to(torch.int32).to(device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(rows, k, generator=gen) * 0.5).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(experts, n, k, generator=gen) * 0.02).to(device, weight_dtype).requires_grad_()
    g = torch.randn(rows, n, generator=gen).to(device, torch.bfloat16)
    layout = grouped.group_layout(offs, rows)
    padded = int(layout.offs[-1])
    flops = 2 * rows * k * n
    out = dict(model=model, projection=projection, rows=rows, experts=experts, k=k, n=n, weight_dtype=str(weight_dtype),
               max_over_mean_group=float(sizes.max() / sizes.float().mean()),
               padding_rows=padded - rows, padding_share=(padded - rows) / rows)

    def fwd_bwd(fn):
        def run():
            y = fn(x, w, offs)
            torch.autograd.grad(y, (x, w), g)
        return run

    fp8 = grouped.grouped_fp8_linear
    cases = {"bf16_fwd": lambda: grouped_bf16(x, w, offs), "bf16_fwd_bwd": fwd_bwd(grouped_bf16),
             "fp8_fwd": lambda: fp8(x, w, offs), "fp8_fwd_bwd": fwd_bwd(fp8),
             "fp8_unfused_fwd_bwd": unfused(fwd_bwd(fp8))}
    if weight_dtype != torch.bfloat16:  # bf16 grouped_mm takes one dtype: bf16 runs on a bf16 copy
        w16 = w.detach().to(torch.bfloat16).requires_grad_()
        cases["bf16_fwd"] = lambda: grouped_bf16(x, w16, offs)
        cases["bf16_fwd_bwd"] = lambda: torch.autograd.grad(grouped_bf16(x, w16, offs), (x, w16), g)
    x8, x_inv = grouped.rowwise(grouped.pad_groups(x.detach(), layout))
    w8, w_inv = grouped.rowwise(w.detach())
    cases["fp8_gemm_fwd"] = lambda: grouped.scaled_grouped_mm(x8, w8.transpose(-2, -1), x_inv, w_inv, layout.offs,
                                                              torch.bfloat16, True)
    # each backward GEMM alone, bf16 (autograd asked for one gradient) and FP8 (operands cast beforehand)
    gemm_cases, dense_facts = per_gemm_cases(x, w, g, offs, layout,
                                             fwd_bwd_one=lambda fn, wrt: _one_grad(fn, x, w, offs, g, wrt))
    cases.update(gemm_cases)
    out.update(dense_facts)
    for name, fn in cases.items():
        try:
            ms = timed(fn, device, repeats)
        except Exception as exc:  # noqa: BLE001 - a case that cannot run here says why
            out[name] = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        work = flops * (3 if name.endswith("bwd") else 1)
        tflops = work / ms / 1e9
        peak = peaks[1] if name.startswith("fp8") else peaks[0]
        out[name] = dict(ms=ms, tflops=tflops, of_peak=tflops / peak)
    out["per_gemm_ms"] = per_gemm(out)
    for mode in ("fwd", "fwd_bwd"):
        a, b = out.get(f"bf16_{mode}", {}), out.get(f"fp8_{mode}", {})
        if "ms" in a and "ms" in b:
            out[f"speedup_{mode}"] = a["ms"] / b["ms"]
    return out


def _one_grad(fn, x, w, offs, g, wrt: str):
    """forward + the backward of one gradient (`wrt` "x": the input gradient's GEMM; "w": the weight's).
    Only that input requires a gradient: an autograd.Function (the FP8 path) reads which of its
    inputs require one, not which gradient autograd.grad asks for, and would make both."""
    xs = x.detach().requires_grad_(wrt == "x")
    ws = w.detach().requires_grad_(wrt == "w")

    def run():
        y = fn(xs, ws, offs)
        torch.autograd.grad(y, xs if wrt == "x" else ws, g)
    return run


def per_gemm_cases(x, w, g, offs, layout, fwd_bwd_one) -> tuple:
    """The input-gradient (dgrad) and weight-gradient (wgrad) GEMMs on their own: bf16 and FP8 as
    forward + that one gradient (minus forward, in `measure`), and each FP8 GEMM on operands cast
    beforehand (what the kernel alone costs; each also as dense GEMMs per expert), plus the casts
    each needs, timed alone; and the dense GEMMs' facts (`dense_cases`)."""
    gp = grouped.pad_groups(g, layout)
    xp = grouped.pad_groups(x.detach(), layout)
    g8, g_inv = grouped.rowwise(gp)
    w8, w_inv = grouped.rowwise(w.detach())
    expert_inv = grouped.expert_inverse_scales(w_inv)  # what the forward hands the input gradient's weight cast
    w_kn8, w_kn_inv = grouped.cast_weight_input_grad(w.detach(), expert_inv)
    g_t8, g_t_inv = grouped.groupwise_columns(gp, layout)
    x_t8, x_t_inv = grouped.groupwise_columns(xp, layout)
    mm = grouped.scaled_grouped_mm
    fp8 = grouped.grouped_fp8_linear
    x8, x_inv = grouped.rowwise(xp)
    timed_dense, dense_facts = dense_cases({"fwd": (x8, w8.transpose(-2, -1), x_inv, w_inv),
                                            "dgrad": (g8, w_kn8.transpose(-2, -1), g_inv, w_kn_inv),
                                            "wgrad": (g_t8, x_t8.t(), g_t_inv, x_t_inv)}, layout)
    return {
        "bf16_fwd_dgrad": fwd_bwd_one(grouped_bf16, "x"), "bf16_fwd_wgrad": fwd_bwd_one(grouped_bf16, "w"),
        "fp8_fwd_dgrad": fwd_bwd_one(fp8, "x"), "fp8_fwd_wgrad": fwd_bwd_one(fp8, "w"),
        "fp8_gemm_dgrad": lambda: mm(g8, w_kn8.transpose(-2, -1), g_inv, w_kn_inv, layout.offs, torch.bfloat16, False),
        "fp8_gemm_wgrad": lambda: mm(g_t8, x_t8.t(), g_t_inv, x_t_inv, layout.offs, torch.bfloat16, False),
        "cast_weight_fwd": lambda: grouped.cast_weight_forward(w.detach()),
        "cast_weight_dgrad": lambda: grouped.cast_weight_input_grad(w.detach(), expert_inv),
        "cast_tokens_grad": lambda: grouped.cast_tokens(g, layout),
        "cast_wgrad_grad": lambda: grouped.cast_weight_grad_operand(g, layout),
        "pad_grad": lambda: grouped.pad_groups(g, layout),
        **timed_dense,
    }, dense_facts


def dense_cases(operands: dict, layout):
    """The three GEMMs as dense GEMMs per expert (dense_experts.dense_grouped_mm) on the grouped kernel's
    operands, `operands` {gemm: (a, b, inv_a, inv_b)}: timed with the groups' bounds known and
    read from the GPU each call (`_dense_sync`), and each one's largest difference from the
    grouped kernel's result relative to that result's largest magnitude (both accumulate in
    float32), or why it could not run."""
    bounds = dense_experts.group_bounds(layout.offs)
    cases, facts = {}, {}
    for gemm, (a, b, inv_a, inv_b) in operands.items():
        def dense(bounds, a=a, b=b, inv_a=inv_a, inv_b=inv_b):
            return dense_experts.dense_grouped_mm(a, b, inv_a, inv_b, bounds)

        try:
            ref = grouped.scaled_grouped_mm(a, b, inv_a, inv_b, layout.offs, torch.bfloat16, False).float()
            got = dense(bounds).float()
            if b.dim() == 3:  # rows past the last group are left unwritten
                ref, got = ref[:bounds[-1][1]], got[:bounds[-1][1]]
            facts[f"{gemm}_dense_max_rel_diff"] = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
        except RuntimeError as exc:  # this torch's _scaled_mm refused the slices: the cases say so too
            facts[f"{gemm}_dense_error"] = str(exc).splitlines()[0][:200]
        cases[f"fp8_gemm_{gemm}_dense"] = lambda dense=dense: dense(bounds)
        cases[f"fp8_gemm_{gemm}_dense_sync"] = lambda dense=dense: dense(dense_experts.group_bounds(layout.offs))
    return cases, facts


def per_gemm(r: dict) -> dict:
    """ms of each GEMM alone from the timed cases: forward, dgrad and wgrad for bf16 (dgrad and wgrad
    as forward + that gradient, minus forward) and for FP8 with and without its casts."""
    def ms(name):
        return r.get(name, {}).get("ms")

    out = {}
    for kind in ("bf16", "fp8"):
        fwd = ms(f"{kind}_fwd")
        out[f"{kind}_fwd"] = fwd
        for gemm in ("dgrad", "wgrad"):
            both = ms(f"{kind}_fwd_{gemm}")
            out[f"{kind}_{gemm}"] = None if both is None or fwd is None else both - fwd
    for gemm in ("fwd", "dgrad", "wgrad"):
        out[f"fp8_gemm_{gemm}"] = ms(f"fp8_gemm_{gemm}")
    return out


def table(results: list, peaks) -> str:
    lines = [f"roofline: dense peaks bf16 {peaks[0]:.0f}, FP8 {peaks[1]:.0f} TFLOP/s", "",
             "| model | projection | rows (pad) | K x N | bf16 fwd ms | FP8 fwd ms | FP8 GEMM fwd ms | fwd x | "
             "bf16 fwd+bwd ms | FP8 fwd+bwd ms (unfused casts) | fwd+bwd x | FP8 fwd+bwd TFLOP/s (% peak) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ms(case):
        return f"{case['ms']:.3f}" if "ms" in case else case.get("error", "-")

    for r in results:
        fb = r.get("fp8_fwd_bwd", {})
        roof = f"{fb['tflops']:.0f} ({fb['of_peak'] * 100:.0f}%)" if "tflops" in fb else "-"
        lines.append(
            f"| {r['model']} | {r['projection']} | {r['rows']} ({r['padding_share'] * 100:.1f}%) | "
            f"{r['k']} x {r['n']} | "
            f"{ms(r['bf16_fwd'])} | {ms(r['fp8_fwd'])} | {ms(r['fp8_gemm_fwd'])} | {r.get('speedup_fwd', 0):.2f} | "
            f"{ms(r['bf16_fwd_bwd'])} | {ms(r['fp8_fwd_bwd'])} ({ms(r['fp8_unfused_fwd_bwd'])}) | "
            f"{r.get('speedup_fwd_bwd', 0):.2f} | {roof} |")
    lines += ["", "Each GEMM alone, ms (bf16: forward + that gradient minus forward; FP8 with its casts, and the "
              "kernel alone on operands cast beforehand), and the backward's casts alone:", "",
              "| model | projection | bf16 fwd / dgrad / wgrad | FP8 fwd / dgrad / wgrad (with casts) | "
              "FP8 kernel fwd / dgrad / wgrad | FP8 dense GEMMs per expert fwd / dgrad / wgrad, bounds read "
              "(max rel. diff) | casts: weight fwd, weight dgrad, grad rows, grad wgrad, pad grad |",
              "|---|---|---|---|---|---|---|"]

    def trio(values):
        return " / ".join("-" if v is None else f"{v:.3f}" for v in values)

    for r in results:
        p = r.get("per_gemm_ms", {})
        casts = [r.get(c, {}).get("ms") for c in ("cast_weight_fwd", "cast_weight_dgrad", "cast_tokens_grad",
                                                  "cast_wgrad_grad", "pad_grad")]
        gemms = ("fwd", "dgrad", "wgrad")
        dense = trio([r.get(f"fp8_gemm_{g}_dense_sync", {}).get("ms") for g in gemms])
        diffs = [r.get(f"{g}_dense_max_rel_diff") for g in gemms]
        diff = "-" if None in diffs else f"{max(diffs):.1e}"
        lines.append(f"| {r['model']} | {r['projection']} | {trio([p.get(f'bf16_{g}') for g in gemms])} | "
                     f"{trio([p.get(f'fp8_{g}') for g in gemms])} | "
                     f"{trio([p.get(f'fp8_gemm_{g}') for g in gemms])} | "
                     f"{dense} ({diff}) | {trio(casts)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default=None, help="comma list of mixtral, qwen3moe (default both; toy on a CPU)")
    p.add_argument("--skew", type=float, default=0.6, help="standard deviation of the expert logits (imbalance)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--bf16-peak", type=float, default=989.0, help="dense bf16 TFLOP/s (H100/H200 SXM)")
    p.add_argument("--fp8-peak", type=float, default=1979.0, help="dense FP8 TFLOP/s (H100/H200 SXM)")
    p.add_argument("--weight-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the experts' weights: bf16, or float32 master weights as Accelerate users train")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    models = (args.models or ("toy" if device.type == "cpu" else "mixtral,qwen3moe")).split(",")
    peaks = (args.bf16_peak, args.fp8_peak)
    results = [measure(m, proj, device, args.skew, args.repeats if device.type == "cuda" else 2, peaks,
                       getattr(torch, args.weight_dtype))
               for m in models for proj in ("gate_up", "down")]
    meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                torch=torch.__version__, skew=args.skew, peaks_tflops=dict(bf16=peaks[0], fp8=peaks[1]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(meta=meta, results=results), indent=2) + "\n")
    print(meta)
    print(table(results, peaks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
