"""Profile a few training steps of one train_step.py path: GPU time by kernel and wall time per
step, to find where fp8plug's path and the raw engine's differ.

    python3 benchmarks/training/profile_train_step.py --path fp8plug --engine native --layers 2
"""

from __future__ import annotations

import argparse
import time

import torch
import train_step
from torch.profiler import ProfilerActivity, profile


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", default="fp8plug")
    parser.add_argument("--engine", default="native")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=12)
    args = parser.parse_args()
    spec = dict(train_step.MODELS["probe"], n_layers=args.layers)
    device = torch.device("cuda")
    run = train_step.setup(args.path, args.engine, None, spec, device, torch.bfloat16, "blocks")
    b = torch.backends.cuda
    print(f"sdp enabled: cudnn={b.cudnn_sdp_enabled()} flash={b.flash_sdp_enabled()} "
          f"mem_efficient={b.mem_efficient_sdp_enabled()} math={b.math_sdp_enabled()}; "
          f"deterministic={torch.are_deterministic_algorithms_enabled()}; "
          f"cudnn.deterministic={torch.backends.cudnn.deterministic} benchmark={torch.backends.cudnn.benchmark}; "
          f"tf32={torch.backends.cuda.matmul.allow_tf32}")
    tokens = torch.randint(0, spec["vocab_size"], (spec["batch"], spec["seq"]), device=device)
    for _ in range(4):
        run.step(tokens)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        run.step(tokens)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 5 * 1e3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            run.step(tokens)
        torch.cuda.synchronize()
    events = prof.key_averages()
    cuda_total = sum(e.self_device_time_total for e in events) / 3 / 1e3
    print(f"== {args.path} {args.engine}: wall {wall:.2f} ms/step, GPU busy {cuda_total:.2f} ms/step, "
          f"kernels/step {sum(e.count for e in events if e.self_device_time_total > 0) / 3:.0f}")
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
