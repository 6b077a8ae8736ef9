"""Where a compiled FP8 Linear's forward+backward spends its GPU time: the top kernels by CUDA
time for one shape and variant (native-dynamic, native-delayed, torchao-tensorwise, bf16).

    python3 benchmarks/profile_linear.py --shape 16384x8192x8192 --variant native-dynamic
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from native_linear import variants


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="16384x8192x8192")
    parser.add_argument("--variant", default="native-dynamic")
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args()
    m, k, n = (int(v) for v in args.shape.split("x"))
    base = nn.Sequential(nn.Linear(k, n, bias=False)).cuda().bfloat16()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for variant in args.variant.split(","):
        torch._dynamo.reset()
        (name, module), = list(variants(base, [variant]))
        for _ in range(5):
            module(x).backward(grad)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                module(x).backward(grad)
            torch.cuda.synchronize()
        print(f"== {name} {args.shape} (5 iterations)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
