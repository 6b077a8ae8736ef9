"""Where a training step's GPU time goes: a few steps under torch.profiler, grouped by kind of kernel.

Used by hf_llama.py --profile N (each row profiles its own steps after the timed ones), so two
rows of one run can be compared kernel group by kernel group: which GEMMs ran (bf16 or FP8),
attention, the optimizer, inductor's fused kernels (casts, norms, amax), everything else.
"""

from __future__ import annotations

import re
from typing import Callable

# kernel-name fragments -> group; the first group whose fragment occurs in the name wins.
# Attention comes first: cuDNN's fused attention kernels carry "sm90_" and "wgmma" like GEMMs.
# Inductor's kernels stay "triton" whatever they fuse; hand-written FP8 casts (TransformerEngine's,
# fp8plug's fused_cast) are "cast", before the FP8 type names would call them GEMMs.
GROUPS = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("triton", ("triton",)),
    ("cast", ("cast_transpose", "cast_both_layouts", "amax_unless_scaled", "amax_kernel")),
    ("gemm-fp8", ("e4m3", "e5m2", "f8f8", "fp8")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "matmul", "sm90_")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy", ("copy", "cat", "fill", "memset", "memcpy")),
)
# cuBLAS's nvjet kernels name their operand types after "nvjet_sm90_": q is e4m3, r e5m2 (t bf16,
# s float32), so "qqtst" and "qrsss" are FP8 GEMMs and "tst" a bf16 one.
_NVJET_TYPES = re.compile(r"nvjet_sm\d+_([a-z]+)_")


def group_of(name: str) -> str:
    low = name.lower()
    types = _NVJET_TYPES.search(low)
    if types:
        return "gemm-fp8" if types.group(1)[:1] in ("q", "r") else "gemm"
    for group, parts in GROUPS:
        if any(part in low for part in parts):
            return group
    return "other"


def profile_steps(step: Callable[[], None], steps: int, top: int = 20) -> dict:
    """Run `step` `steps` times under the profiler; per-step GPU milliseconds by group (summed over
    streams, so overlapped communication counts in full), the communication no compute hid, the
    time no kernel ran at all (the host was behind, or the rank waited), the `top` kernels by time,
    the kernel count per step, and where the GPU was idle (`idle_gaps`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    groups: dict = {}
    for e in kernels:
        key = group_of(e.key)
        groups[key] = groups.get(key, 0.0) + e.self_device_time_total / steps / 1e3
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    intervals = kernel_intervals(prof)
    return dict(
        exposed_communication_ms=exposed_communication_ms(intervals, steps),
        gpu_idle_ms=gpu_idle_ms(intervals, steps),
        idle_gaps=idle_gaps(intervals, steps),
        gpu_ms_per_step=round(sum(groups.values()), 3),
        groups_ms={k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        kernels_per_step=round(sum(e.count for e in kernels) / steps, 1),
        top=[dict(name=e.key[:110], group=group_of(e.key), ms=round(e.self_device_time_total / steps / 1e3, 3),
                  calls=round(e.count / steps, 1)) for e in kernels[:top]],
    )


def _merged(intervals: list) -> list:
    """Sorted, non-overlapping (start, end) intervals covering the same time as `intervals`."""
    merged: list = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def exposed_communication_ms(kernels: list, steps: int) -> float:
    """GPU milliseconds per step in which a communication kernel runs and no other kernel does:
    the collectives FSDP2 failed to hide behind compute. `kernels`: (name, start_us, end_us)."""
    comm = _merged([(s, e) for name, s, e in kernels if group_of(name) == "communication"])
    busy = _merged([(s, e) for name, s, e in kernels if group_of(name) != "communication"])
    exposed, j = 0.0, 0
    for start, end in comm:
        covered = 0.0
        while j < len(busy) and busy[j][1] <= start:
            j += 1
        k = j
        while k < len(busy) and busy[k][0] < end:
            covered += min(end, busy[k][1]) - max(start, busy[k][0])
            k += 1
        exposed += (end - start) - covered
    return round(exposed / steps / 1e3, 3)


def _gaps(kernels: list):
    """(the kernel that ended last before it, the kernel that starts it, idle us) for each gap between
    the first kernel and the last in which no kernel of any stream runs; `kernels`: (name, start_us,
    end_us)."""
    last_name, last_end = None, None
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        if last_end is not None and start > last_end:
            yield last_name, name, start - last_end
        if last_end is None or end >= last_end:
            last_name, last_end = name, end


def gpu_idle_ms(kernels: list, steps: int) -> float:
    """GPU milliseconds per step, between the first kernel and the last, in which no kernel of any
    stream runs: time lost to the host (launches, Python) or to waiting on another rank's host."""
    return round(sum(idle for _, _, idle in _gaps(kernels)) / steps / 1e3, 3)


def idle_gaps(kernels: list, steps: int, top: int = 8, name_chars: int = 60) -> list:
    """Where the idle time of `gpu_idle_ms` falls: its gaps keyed by the kernel that ran last before
    each and the one that ran first after it (the host caught up there), summed over the profile,
    the `top` by time: per step {after: the kernel the gap follows, before: the kernel it precedes,
    ms, count}. A gap before the same kernel every step points at one place in the code (a host
    read, a slow launch)."""
    gaps: dict = {}
    for after, before, idle in _gaps(kernels):
        key = (after[:name_chars], before[:name_chars])
        total, count = gaps.get(key, (0.0, 0))
        gaps[key] = (total + idle, count + 1)
    ranked = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]
    return [dict(after=after, before=before, ms=round(total / steps / 1e3, 3), count=round(count / steps, 1))
            for (after, before), (total, count) in ranked]


def kernel_intervals(prof) -> list:
    """(name, start_us, end_us) of every GPU kernel a finished torch.profiler run recorded."""
    import torch

    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def memory_at_peak() -> dict:
    """torch's allocator figures (GB) for the process so far: peak allocated, peak reserved, and
    the current allocation (the model, its gradients-to-be and the optimizer state after a step)."""
    import torch

    stats = torch.cuda.memory_stats()
    gb = 1e9
    return dict(peak_allocated_gb=round(stats["allocated_bytes.all.peak"] / gb, 3),
                peak_reserved_gb=round(stats["reserved_bytes.all.peak"] / gb, 3),
                allocated_after_step_gb=round(stats["allocated_bytes.all.current"] / gb, 3))
