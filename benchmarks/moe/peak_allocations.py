"""What is allocated at a moe_llm.py row's peak: two steps, then a third under torch's allocator
history, summed by where each live block was allocated (benchmarks/training/memory_at_peak.py).

Why: a row's peak_gb says how much, not what; an FP8 path that peaks above bf16 needs the buffer
that does it named. The history starts after two steps, when only the parameters and the
optimizer's states are left from before (gradients are set to None), so the moment the step's own
allocations peak is the step's peak. One CUDA GPU; a row as moe_llm.py names it:

    python3 benchmarks/moe/peak_allocations.py fp8plug-bf16weights-usercompiled peak.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_llm  # noqa: E402  (puts the repository and benchmarks/training on sys.path)


def main(row: str, out: str) -> None:
    import memory_at_peak
    import torch

    spec, device = dict(moe_llm.MODELS["mixtral"]), torch.device("cuda")
    accelerator, model, optimizer, scheduler = moe_llm.setup(row, spec, device, 4, 3e-4)
    step = moe_llm.training_step(accelerator, model, optimizer, scheduler, moe_llm.make_batches(spec, 4).to(device))
    for i in range(2):
        step(i)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    memory_at_peak.record()
    step(2)
    torch.cuda.synchronize()
    text = (f"row {row}: max_memory_allocated {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB, of which "
            f"{before / 2**30:.3f} GiB allocated before the traced step\n"
            + memory_at_peak.summary(torch.cuda.memory._snapshot()) + "\n")
    torch.cuda.memory._record_memory_history(enabled=None)
    Path(out).write_text(text)
    print(text)


if __name__ == "__main__":
    main(*sys.argv[1:3])
