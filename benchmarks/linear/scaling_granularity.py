"""Linear forward+backward by scaling granularity: bf16, native per-tensor (dynamic, delayed),
rowwise, rowwise_with_gw_hp and blockwise, at LLaMa-2-70B shapes (benchmarks/linear/native_70b_shapes.py),
each compiled (torch.compile of the converted module) and, with --eager, eagerly; plus torchao's
rowwise through fp8plug's `ao` engine and TransformerEngine's Float8BlockScaling (`te`, blockwise)
where installed. Each row runs in its own process (fresh inductor and Triton caches; every shape in it), so one
row's compile or failure never touches another; a row past --timeout is reported as such, and
nothing starts after --deadline seconds. Prints a markdown table, writes JSON.

    python3 benchmarks/linear/scaling_granularity.py --json out.json
    python3 benchmarks/linear/scaling_granularity.py --rows bf16,native-blockwise --shapes 16384x8192x8192
    python3 benchmarks/linear/scaling_granularity.py --device cpu --rows all  # a smoke test of the script (eager)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SHAPES = [(16384, 8192, 10240), (16384, 8192, 8192), (16384, 8192, 57344), (16384, 28672, 8192)]
CPU_SHAPES = [(256, 256, 384)]
# row name -> (engine, scaling); None engine: plain bf16 nn.Linear
ROWS = {
    "bf16": (None, None),
    "native-dynamic": ("native", "dynamic"),
    "native-delayed": ("native", "delayed"),
    "native-rowwise": ("native", "rowwise"),
    "native-rowwise_with_gw_hp": ("native", "rowwise_with_gw_hp"),
    "native-blockwise": ("native", "blockwise"),
    "ao-rowwise": ("ao", "rowwise"),
    "ao-rowwise_with_gw_hp": ("ao", "rowwise_with_gw_hp"),
    "te-blockwise": ("te", "blockwise"),
}
DEFAULT = ["bf16", "native-dynamic", "native-rowwise", "native-rowwise_with_gw_hp", "native-blockwise"]


def run_one(row: str, shape, device: str, compiled: bool, iters: int, warmup: int) -> dict:
    """One row at one shape, in this process: ms per forward+backward, or the error."""
    import torch
    from native_70b_shapes import time_fwd_bwd  # beside this script
    from torch import nn

    import fp8plug

    m, k, n = shape
    torch.manual_seed(0)
    dtype = torch.bfloat16
    module = nn.Sequential(nn.Linear(k, n, bias=False)).to(device=device, dtype=dtype)
    engine, scaling = ROWS[row]
    if engine is not None:
        report = fp8plug.convert_model(module, recipe=fp8plug.FP8RecipeKwargs(backend=engine, scaling=scaling))
        if not report.fp8_linears:
            return dict(error=f"not converted: {report.summary()}")
    if compiled:
        module = torch.compile(module)
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=dtype)
    ms = time_fwd_bwd(module, x, grad, iters, warmup)
    return dict(ms=ms, tflops=6 * m * k * n / ms / 1e9)


def child(args) -> None:
    """One row at every shape of --one-shape (comma list), in this process: one start-up per row."""
    for text in args.one_shape.split(","):
        shape = tuple(int(v) for v in text.split("x"))
        try:
            out = run_one(args.one_row, shape, args.device, not args.one_eager, args.iters, args.warmup)
        except Exception as exc:  # noqa: BLE001 - reported as the row's result
            out = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        print("RESULT " + json.dumps(dict(out, shape=text)), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(DEFAULT), help="comma list or 'all'; rows: " + ", ".join(ROWS))
    p.add_argument("--shapes", default=None, help="MxKxN,... (default: the 70B shapes; --device cpu: a small one)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--eager", action="store_true", help="also time each row eagerly")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--timeout", type=float, default=240, help="seconds one row (every shape) may take")
    p.add_argument("--deadline", type=float, default=540, help="no row starts after this many seconds")
    p.add_argument("--one-row", help=argparse.SUPPRESS)
    p.add_argument("--one-shape", help=argparse.SUPPRESS)
    p.add_argument("--one-eager", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_row:
        return child(args)
    rows = list(ROWS) if args.rows == "all" else args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"--rows: unknown {unknown}; rows: {', '.join(ROWS)}")
    if args.device == "cpu":
        args.iters, args.warmup = min(args.iters, 2), min(args.warmup, 1)
    shapes = (CPU_SHAPES if args.device == "cpu" else SHAPES) if not args.shapes else [
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    modes = [True] if args.device == "cpu" else [False, True] if args.eager else [False]  # CPU: eager only
    start, results = time.time(), []
    names = ["x".join(map(str, shape)) for shape in shapes]
    by_row = {}
    for eager in modes:
        for row in rows:
            if time.time() - start > args.deadline:
                by_row[row, eager] = {name: dict(error="skipped: past --deadline") for name in names}
            else:
                by_row[row, eager] = _in_child(args, row, names, eager)
    print("| shape | row | mode | ms | TFLOP/s | vs bf16 |\n|---|---|---|---|---|---|", flush=True)
    for name in names:
        for eager in modes:
            base = by_row.get(("bf16", eager), {}).get(name, {})
            for row in rows:
                out = by_row[row, eager][name]
                speedup = base["ms"] / out["ms"] if "ms" in base and "ms" in out else None
                mode = "eager" if eager else "compiled"
                results.append(dict(out, shape=name, row=row, mode=mode, speedup=speedup))
                text = (f"{out['ms']:.3f} | {out['tflops']:.0f} | " + (f"{speedup:.2f}x" if speedup else "-")
                        if "ms" in out else f"- | - | {out['error']}")
                print(f"| {name} | {row} | {mode} | {text} |", flush=True)
    if args.json:
        meta = dict(device=args.device, results=results)
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)


def _in_child(args, row, shapes, eager) -> dict:
    """Run one row at every shape in a fresh process with its own compile caches: shape -> result."""
    with tempfile.TemporaryDirectory() as cache:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fp8plug from here
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"), PYTHONPATH=path)
        command = [sys.executable, __file__, "--one-row", row, "--one-shape", ",".join(shapes),
                   "--device", args.device, "--iters", str(args.iters), "--warmup", str(args.warmup)]
        if eager:
            command.append("--one-eager")
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
            stdout, error = done.stdout, None
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            error = f"timed out after {args.timeout:.0f} s"
    found = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT "):])
            found[out.pop("shape")] = out
    if error is None and len(found) < len(shapes):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        error = f"exit {done.returncode}: {tail[0][:300]}"
    return {name: found.get(name, dict(error=error)) for name in shapes}


if __name__ == "__main__":
    main()
