"""FP8 on a CPU against bf16: one GEMM and the README demo's training step, per way of running the
FP8 GEMM (fp8plug's emulation, and torch's own CPU `torch._scaled_mm` as it was used before).

Why: torch's CPU `_scaled_mm` takes oneDNN's reference kernel on some CPUs (AMX Xeons), hundreds of
times slower than bf16; fp8plug emulates FP8 GEMMs in bf16 on every CPU (fp8plug.backends.gemm). This
measures both on the machine it runs on, so the choice is checked where it matters.

    python3 benchmarks/linear/cpu_fp8.py                   # all ways, the threads torch picks
    taskset -c 0,1 python3 benchmarks/linear/cpu_fp8.py --threads 2 --json out/cpu_fp8.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import fp8plug  # noqa: E402
from fp8plug.backends import gemm as fp8_gemm  # noqa: E402
from fp8plug.backends.native import fp8_matmul  # noqa: E402
from fp8plug.bench.toy_model import DecoderConfig, TinyDecoder, lm_loss, synthetic_batches  # noqa: E402


def torch_scaled_mm(a, b, inv_scale_a, inv_scale_b, out_dtype, use_fast_accum=False, bias=None):
    """What fp8plug ran on the CPU before the emulation: torch's own CPU kernel."""
    return torch._scaled_mm(a, b, scale_a=inv_scale_a, scale_b=inv_scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


WAYS = {"emulated": fp8_gemm.scaled_mm, "torch._scaled_mm": torch_scaled_mm}
SLOW = "torch._scaled_mm"  # hundreds of times slower than bf16 on some CPUs: timed once, after one warm-up


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def gemm_rows(repeats: int):
    m, k, n = fp8_gemm.PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    x8, w8, one = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), torch.ones(())
    xb, wb = x.bfloat16(), w.bfloat16()
    rows = {"bf16": best_ms(lambda: torch.mm(xb, wb.t()), repeats)}
    for way, fn in WAYS.items():
        rows[way] = best_ms(lambda fn=fn: fn(x8, w8.t(), one, one, torch.bfloat16), 2 if way == SLOW else repeats)
    return rows


def step_ms(model, batches, steps: int, warmup: int = 2) -> float:
    """Median time of a training step (bf16 autocast, AdamW) over `steps` steps after `warmup`."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    times = []
    for step in range(steps + warmup):
        tokens = batches[step % len(batches)]
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    times = sorted(times[warmup:])
    return times[len(times) // 2] * 1e3


def step_rows(steps: int):
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, ffn_dim=512, max_seq_len=64)
    base = TinyDecoder(cfg)
    batches = synthetic_batches(4, batch=8, seq=64, vocab=cfg.vocab_size, seed=0)
    rows = {"bf16": step_ms(copy.deepcopy(base), batches, steps)}
    recipe = fp8plug.FP8RecipeKwargs(backend="native", modules_to_ignore=["lm_head"], auto_filter=False)
    for way, fn in WAYS.items():
        model = copy.deepcopy(base)
        fp8plug.convert_model(model, recipe=recipe, backend="native")
        fp8plug.apply_fp8_autowrap(model, recipe)
        fp8_matmul.scaled_mm = fn  # the layer's GEMMs, swapped for this row only
        try:
            rows[way] = step_ms(model, batches, 1, 1) if way == SLOW else step_ms(model, batches, steps)
        finally:
            fp8_matmul.scaled_mm = fp8_gemm.scaled_mm
    return rows


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return ""
    return " ".join(sorted(f for f in flags if f.startswith(("amx", "avx512_fp16", "avx512_bf16"))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the numbers here")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of: {', '.join(WAYS)}")
    args = parser.parse_args(argv)
    unknown = set(args.ways.split(",")) - set(WAYS)
    if unknown:
        parser.error(f"--ways: unknown {', '.join(sorted(unknown))}; choose from {', '.join(WAYS)}")
    for way in set(WAYS) - set(args.ways.split(",")):
        del WAYS[way]
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    meta = {"cpu": cpu, "flags": cpu_flags(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    print(f"# {meta['cpu']} [{meta['flags']}], {meta['threads']} threads, torch {meta['torch']}", flush=True)
    gemm = gemm_rows(args.repeats)
    print("GEMM " + "x".join(map(str, fp8_gemm.PROBE_SHAPE)) + " ms: "
          + ", ".join(f"{k} {v:.3f} ({v / gemm['bf16']:.1f}x)" for k, v in gemm.items()), flush=True)
    steps = step_rows(args.steps)
    print("demo step ms: " + ", ".join(f"{k} {v:.1f} ({v / steps['bf16']:.2f}x)" for k, v in steps.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "gemm_ms": gemm, "step_ms": steps}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
