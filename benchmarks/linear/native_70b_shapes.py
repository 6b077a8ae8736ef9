"""Linear forward+backward at LLaMa-2-70B shapes: native (compiled) against bf16 compiled and
torchao tensorwise (compiled), on one CUDA GPU. Prints a markdown table and writes JSON.

    python3 benchmarks/linear/native_70b_shapes.py --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from torch import nn

import fp8plug

SHAPES = [(16384, 8192, 10240), (16384, 8192, 8192), (16384, 8192, 57344), (16384, 28672, 8192)]


def time_fwd_bwd(module, x, grad, iters=20, warmup=5):
    """Median milliseconds of one forward+backward after `warmup` untimed ones: by CUDA events on
    a GPU, by the wall clock on the CPU (benchmarks/linear/scaling_granularity.py times with it too)."""
    for _ in range(warmup):
        module(x).backward(grad)
    if x.device.type == "cpu":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            module(x).backward(grad)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        module(x).backward(grad)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def variants(base, names):
    if "bf16" in names:
        yield "bf16", torch.compile(copy.deepcopy(base))
    for scaling in ("dynamic", "delayed"):
        if f"native-{scaling}" in names:
            model = copy.deepcopy(base)
            fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native", scaling=scaling))
            yield f"native-{scaling}", torch.compile(model)
    if "torchao-tensorwise" in names:
        try:
            from torchao.float8 import convert_to_float8_training

            model = copy.deepcopy(base)
            convert_to_float8_training(model)
            yield "torchao-tensorwise", torch.compile(model)
        except ImportError as exc:
            print("torchao unavailable:", exc)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--shapes", default=None, help="MxKxN,...")
    parser.add_argument("--variants", default="bf16,native-dynamic,native-delayed,torchao-tensorwise")
    args = parser.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    names = args.variants.split(",")
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for m, k, n in shapes:
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(k, n, bias=False)).cuda().bfloat16()
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        baseline = None
        for name, module in variants(base, names):
            module.train()
            torch._dynamo.reset()  # else dynamo's recompile limit silently leaves later variants eager
            ms = time_fwd_bwd(module, x, grad)
            baseline = baseline or ms
            tflops = 6 * m * k * n / ms / 1e9
            rows.append(dict(shape=f"{m}x{k}x{n}", variant=name, ms=ms, tflops=tflops, speedup=baseline / ms))
            print(f"| {m}x{k}x{n} | {name} | {ms:.3f} ms | {tflops:.0f} TFLOP/s | {baseline / ms:.2f}x |", flush=True)
            del module
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
