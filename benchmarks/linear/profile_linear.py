"""Where one Linear's forward+backward spends its GPU time, engine by engine: the GEMMs (by kernel,
with the tile cuBLAS chose) against everything else (casts, amaxes, transposes), per iteration.

It runs the very cases `fp8plug bench` times (fp8plug.bench.cases: bf16, every engine with a
scaling, the bare FP8 GEMMs), so a gap in the bench's table can be split into "slower GEMMs" and
"more cast work" here.

    python3 benchmarks/linear/profile_linear.py --shapes 16384x8192x8192 --engines native:delayed,te:delayed,fp8-gemm
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fp8plug.bench import BF16, parse_shapes, resolve_engines
from fp8plug.bench.cases import EngineSpec, build_case
from fp8plug.tuning.hardware import device_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))  # the profiler grouping lives there
from gpu_time_by_kind import profile_steps  # noqa: E402


def profile_case(spec: EngineSpec, shape, mode: str, device, iterations: int) -> dict:
    """GPU ms per iteration by kernel group, and the GEMM kernels and the other top kernels."""
    torch._dynamo.reset()
    step, reset = build_case(spec, shape, mode, device)

    def iteration():
        reset()
        step()

    for _ in range(5):
        iteration()
    result = profile_steps(iteration, iterations, top=12)
    groups = result["groups_ms"]
    result["gemm_ms"] = round(groups.get("gemm", 0.0) + groups.get("gemm-fp8", 0.0), 3)
    result["other_ms"] = round(result["gpu_ms_per_step"] - result["gemm_ms"], 3)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="llama70b", help="a preset (llama70b) or MxKxN,...")
    parser.add_argument("--engines", default="native:dynamic,native:delayed,te:delayed,fp8-gemm")
    parser.add_argument("--mode", default="compiled", choices=("eager", "compiled"))
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    specs, unavailable = resolve_engines(args.engines, device_info(device))
    if unavailable:
        raise SystemExit(f"--engines: cannot run here: {unavailable}")
    rows = []
    for shape in parse_shapes(args.shapes):
        label = "x".join(map(str, shape))
        for spec in [EngineSpec(BF16)] + specs:
            result = profile_case(spec, shape, args.mode, device, args.iterations)
            rows.append(dict(shape=label, engine=spec.label, mode=args.mode, **result))
            print(f"== {label} {spec.label}: {result['gpu_ms_per_step']:.3f} ms GPU per iteration, "
                  f"GEMMs {result['gemm_ms']:.3f}, other {result['other_ms']:.3f}", flush=True)
            for kernel in result["top"]:
                print(f"   {kernel['ms']:7.3f} ms x{kernel['calls']:<4} {kernel['group']:9} {kernel['name'][:100]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
