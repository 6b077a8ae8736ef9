"""What is alive at a process's CUDA memory peak: the tensors, grouped by where they were allocated.

Why: a peak-memory target (LoRA on an FP8 base against bf16 LoRA, say) is missed by some gigabytes
and `max_memory_allocated` alone cannot say by what. `record()` turns on torch's allocator history
(`torch.cuda.memory._record_memory_history`, stacks of Python frames); `summary(snapshot)` replays
its alloc/free events, finds the moment the allocated total peaked and lists the allocations alive
then, largest groups first, each group named by its innermost frame outside torch's own files
(inductor's generated code shows as its cache file and line: compiled graphs still group).

    python3 benchmarks/training/memory_at_peak.py snapshot.pickle    # prints the summary
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict

TORCH_PARTS = ("/torch/", "<frozen", "/contextlib.py", "/functools.py")


def record(max_entries: int = 400_000) -> None:
    """Start the allocator's history (call before the model is built)."""
    import torch

    torch.cuda.memory._record_memory_history(stacks="python", max_entries=max_entries)


def dump(path: str) -> dict:
    """Write the snapshot to `path` and return it."""
    import torch

    snapshot = torch.cuda.memory._snapshot()
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return snapshot


def where(frames: list) -> str:
    """The innermost frame that is not torch's own (the code that asked for the memory)."""
    for frame in frames:
        name = frame.get("filename", "")
        if not any(part in name for part in TORCH_PARTS):
            return f"{'/'.join(name.rsplit('/', 2)[-2:])}:{frame.get('line')} {frame.get('name')}"
    return "torch internals" if frames else "(before the history started)"


def summary(snapshot: dict, top: int = 25) -> str:
    """The peak, and the allocations alive at it grouped by `where`, as text."""
    lines = []
    for device, trace in enumerate(snapshot.get("device_traces", [])):
        live, total, peak, peak_at = {}, 0, 0, -1
        for i, event in enumerate(trace):
            action = event["action"]
            if action == "alloc":
                live[event["addr"]] = event
                total += event["size"]
                if total > peak:
                    peak, peak_at = total, i
            elif action == "free_completed" and event["addr"] in live:
                total -= live.pop(event["addr"])["size"]
        if peak_at < 0:
            continue
        alive = {}
        for event in trace[:peak_at + 1]:
            if event["action"] == "alloc":
                alive[event["addr"]] = event
            elif event["action"] == "free_completed":
                alive.pop(event["addr"], None)
        groups = defaultdict(lambda: [0, 0, set()])
        for event in alive.values():
            group = groups[where(event.get("frames", []))]
            group[0] += event["size"]
            group[1] += 1
            group[2].add(event["size"])
        lines.append(f"device {device}: peak {peak / 2**30:.2f} GiB of traced allocations at event {peak_at} "
                     f"of {len(trace)}; alive: {len(alive)} blocks")
        for name, (size, count, sizes) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
            common = ", ".join(f"{s / 2**20:.0f}" for s in sorted(sizes, reverse=True)[:4])
            lines.append(f"  {size / 2**30:7.3f} GiB  {count:5d} blocks (MiB: {common})  {name}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("snapshot")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    with open(args.snapshot, "rb") as f:
        print(summary(pickle.load(f), args.top))


if __name__ == "__main__":
    main()
