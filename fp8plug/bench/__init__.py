"""`fp8plug bench`: how fast one Linear's forward+backward runs in FP8, engine by engine, against
bf16 on the same machine.

FP8 only pays where the GEMMs outweigh the casts, and each engine pays its own price for them;
this measures it at the shapes you choose (default: the LLaMa-2-70B shapes, M=16384 tokens), eager
and compiled, to pick an engine and to calibrate fp8plug.tuning.roofline. Each number is a median
after warm-up (CUDA events on a GPU, the wall clock on the CPU); an engine that fails at a shape
gets a row with the reason. `fp8plug bench --help` lists the options; docs/performance.md the runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from fp8plug.backends.gemm import emulates
from fp8plug.bench.cases import (
    BF16,
    CPU_SHAPES,
    GEMM_BOUND,
    LLAMA70B_SHAPES,
    MODES,
    SHAPE_PRESETS,
    SWEEP_SHAPES,
    BenchSkip,
    EngineSpec,
    Shape,
    resolve_engines,
)
from fp8plug.bench.options import add_arguments, parse_modes, parse_shapes, settings
from fp8plug.bench.report import CSV_COLUMNS, Progress, environment, format_table, write_csv, write_json
from fp8plug.bench.timing import TIMINGS, Timer, add_speedups, flops_fwd_bwd, measure, merge_rounds

__all__ = [
    "BF16", "CPU_SHAPES", "CSV_COLUMNS", "GEMM_BOUND", "LLAMA70B_SHAPES", "MODES", "SHAPE_PRESETS", "SWEEP_SHAPES",
    "TIMINGS", "BenchSkip", "EngineSpec", "Progress", "Shape", "Timer", "add_arguments", "add_speedups",
    "environment", "flops_fwd_bwd", "format_table", "main", "measure", "merge_rounds", "parse_modes", "parse_shapes",
    "resolve_engines", "run", "settings", "write_csv", "write_json",
]


def run(args: argparse.Namespace) -> int:
    """Run the benchmark `args` describe, print the table, write --json / --csv.

    Returns 0 if at least one case was measured, 1 if none was, 2 for bad options."""
    from fp8plug.tuning.hardware import device_info

    try:
        device, shapes, modes, warmup, repeats = settings(args)
        info = device_info(device)
        specs, unavailable = resolve_engines(args.engines, info)
    except ValueError as exc:
        print(f"fp8plug bench: {exc}", file=sys.stderr)
        return 2
    explicit = args.engines is not None and args.engines.strip().lower() not in ("auto", "all")
    cases = [EngineSpec(BF16)] + [s for s in specs if explicit or s.backend not in unavailable]
    timing = getattr(args, "timing", "queued")
    timer = Timer(device, warmup, repeats, timing)
    emulated = emulates(device)
    print(f"fp8plug bench on {info.describe()}: Linear forward+backward, bf16 weights and inputs, "
          f"median of {repeats} after {warmup} warm-up" + ("; FP8 GEMMs emulated" if emulated else ""))
    for name, why in unavailable.items():
        print(f"  {name}: not measured: {why}")
    rounds = getattr(args, "rounds", 1)
    progress = Progress(rounds * len(shapes) * len(modes) * len(cases),
                        enabled=not getattr(args, "no_progress", False))
    rows = []
    try:
        for _ in range(rounds):
            for shape in shapes:
                for mode in modes:
                    for spec in cases:
                        progress.start(f"{shape[0]}x{shape[1]}x{shape[2]} {mode} {spec.label}")
                        rows.append(measure(spec, shape, mode, device, timer, unavailable.get(spec.backend)))
                        progress.advance()
    finally:
        progress.close()
    rows = merge_rounds(rows)
    add_speedups(rows)
    print(format_table(rows, emulated))
    meta = environment(device, info.describe())
    meta.update(warmup=warmup, repeats=repeats, rounds=rounds, modes=modes, shapes=[list(s) for s in shapes],
                unavailable=unavailable, fp8_gemms="emulated" if emulated else "FP8 hardware",
                timing=f"cuda events, {timing}" if device.type == "cuda" else "wall clock")
    if args.json_path:
        write_json(args.json_path, meta, rows)
        print(f"wrote {args.json_path}")
    if args.csv_path:
        write_csv(args.csv_path, rows)
        print(f"wrote {args.csv_path}")
    return 0 if any(r["ms"] is not None for r in rows) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m fp8plug.bench [options]`: the same as `fp8plug bench`."""
    parser = argparse.ArgumentParser(prog="fp8plug bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
