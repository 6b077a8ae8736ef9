"""What is allocated at a moe_llm.py row's peak: two steps, then a third under torch's memory history,
replayed to the moment of the most bytes allocated, whose live blocks are summed by where they were
allocated (the innermost frames in fp8plug, transformers, accelerate, the optimizer or compiled code).

Why: a row's peak_gb says how much, not what; an FP8 path that peaks above bf16 needs the buffer
that does it named. One CUDA GPU; a row as moe_llm.py names it:

    python3 benchmarks/moe/peak_allocations.py fp8plug-bf16weights-usercompiled peak.txt
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_llm  # noqa: E402  (puts the repository and benchmarks/training on sys.path)

KEEP = ("fp8plug", "transformers", "accelerate", "optim", "torchinductor", "/tmp/")


def where(frames: list) -> str:
    kept = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in frames
            if any(part in f["filename"] for part in KEEP)]
    if kept:
        return " < ".join(kept[:4])
    return f"{frames[0]['filename'].split('/')[-1]}:{frames[0]['name']}" if frames else "?"


def peak_blocks(snapshot: dict) -> tuple:
    """(bytes, {address: (size, frames, when)}, event) at the trace's most allocated moment. Blocks
    alive at the end that no traced event allocated were there before the step ("before")."""
    live = {b["address"]: (b["size"], b.get("frames", []), "before") for seg in snapshot["segments"]
            for b in seg["blocks"] if b["state"] == "active_allocated"}
    trace = snapshot["device_traces"][0]
    for event in trace:
        if event["action"] == "alloc":
            live.pop(event["addr"], None)
    current = sum(size for size, _, _ in live.values())
    best = (current, dict(live), -1)
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []), "step")
            current += event["size"]
        elif event["action"] == "free_requested" and event["addr"] in live:
            current -= live.pop(event["addr"])[0]
        if current > best[0]:
            best = (current, dict(live), i)
    return best


def main(row: str, out: str) -> None:
    import torch

    spec, device = dict(moe_llm.MODELS["mixtral"]), torch.device("cuda")
    accelerator, model, optimizer, scheduler = moe_llm.setup(row, spec, device, 4, 3e-4)
    step = moe_llm.training_step(accelerator, model, optimizer, scheduler, moe_llm.make_batches(spec, 4).to(device))
    for i in range(2):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=400000)
    step(2)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    total, blocks, event = peak_blocks(snapshot)
    groups = collections.Counter()
    for size, frames, when in blocks.values():
        groups[(where(frames), when)] += size
    lines = [f"row {row} max_allocated {torch.cuda.max_memory_allocated() / 1e9:.3f} GB replay peak "
             f"{total / 1e9:.3f} GB at event {event} of {len(snapshot['device_traces'][0])}"]
    lines += [f"{size / 1e9:8.3f} GB {when:6s} {place}" for (place, when), size in groups.most_common(40)]
    Path(out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:25]))


if __name__ == "__main__":
    main(*sys.argv[1:3])
