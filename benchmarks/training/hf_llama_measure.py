"""How every row of benchmarks/training/hf_llama.py is measured, whichever loop trains it: step times,
the moments from process start to the first step's and the warm-up's end, what runs in FP8, peak
memory, and the reported loss.

A module of its own because two training loops use it, hf_llama.py's own (the Accelerator rows)
and hf_llama_trainer.py's (`transformers.Trainer`, the `trainer` rows, which marks steps from a
TrainerCallback); their rows are compared column by column, so each column must be computed one
way. torch is imported only inside the functions (hf_llama.py's parent process stays light).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Optional

from gpu_time_by_kind import memory_at_peak
from train_step import count_fp8_modules

LOSS_WINDOW = 10  # the reported loss is the mean over this many last steps


class StepClock:
    """Marks on the timeline the steps run on: CUDA events on a GPU (recorded, not waited for, so
    marking costs the step nothing), perf_counter on the CPU. Read them with `ms` after
    torch.cuda.synchronize()."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def model_facts(model, optimizer, accelerator, engine: str | None) -> dict:
    """The engine (the Accelerator's, else `engine`, the row's), how many modules run in FP8, the
    trainable parameters no optimizer holds (a path that leaves weights untrained is not faster
    for a good reason) and, for fp8plug, which Linears stayed in high precision and why. An FP8
    row that converted nothing is an error, not a bf16 number under an FP8 name, unless fp8plug says
    why of every Linear (its speed filter predicting each slower in FP8: `all_high_precision`)."""
    fp8_engine = getattr(accelerator, "fp8_engine", None)
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    not_stepped = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in stepped)
    out = dict(engine=fp8_engine.name if fp8_engine is not None else engine,
               fp8_modules=count_fp8_modules(model), params_not_stepped=not_stepped)
    for report in getattr(accelerator, "fp8_reports", ()):  # fp8plug rows: what stayed in high precision, why
        out.setdefault("high_precision_linears", {}).update(report.high_precision_linears)
    if accelerator.mixed_precision == "fp8" and out["fp8_modules"] == 0:
        import torch

        linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        if not linears or len(out.get("high_precision_linears", {})) < linears:
            raise RuntimeError("no module was converted to FP8")
        out["all_high_precision"] = True
    return out


def fp8_attention_calls(model, accelerator) -> dict:
    """{"fp8_attention_calls": the attention calls that ran in FP8} where the row asked for FP8
    attention (fp8_dpa), else {}. Read after training: before it, no call has run."""
    if not getattr(getattr(accelerator, "fp8_plan", None), "fp8_dpa", False):
        return {}
    runners = sys.modules["fp8plug.hf.fp8_attention"].fp8_attention_modules(model)
    return {"fp8_attention_calls": sum(runner.calls for runner in runners.values())}


def note_early_step(out: dict, i: int, warmup: int, t0: float, cuda: bool) -> None:
    """After step `i` (from 0): at the first step and the last warm-up step, the seconds since
    process start `t0` (`first_step_s`, `warm_s`; the GPU waited for, so compilation and the
    step's own work are in) and where compilation went so far."""
    if i not in (0, warmup - 1):
        return
    if cuda:
        import torch

        torch.cuda.synchronize()
    out.setdefault("first_step_s", time.time() - t0)
    out.setdefault("compile", compile_breakdown())
    if i == warmup - 1:
        out["warm_s"] = time.time() - t0


def gpu_memory(device, prepared_gb: float | None) -> dict:
    """Peak CUDA memory over the process, torch's allocator figures, and the allocation once the
    model and optimizer were prepared."""
    import torch

    return dict(peak_gb=torch.cuda.max_memory_allocated(device) / 1e9,
                memory=dict(memory_at_peak(), after_prepare_gb=None if prepared_gb is None else round(prepared_gb, 3)))


def step_numbers(spec: dict, steps: int, warmup: int, ms: list, losses: list) -> dict:
    """From each step's milliseconds and loss (a tensor per step): the median step time after the
    warm-up, tokens/s, the loss (mean over the last LOSS_WINDOW steps) and about 20 points of the
    loss curve. A loss that is not finite is an error."""
    import torch

    out = dict(step_ms=statistics.median(ms[warmup:]))
    out["tokens_per_s"] = spec["batch"] * spec["seq"] / (out["step_ms"] / 1e3)
    curve = torch.stack(losses).float().cpu().tolist()
    out["loss"] = sum(curve[-LOSS_WINDOW:]) / len(curve[-LOSS_WINDOW:])
    shown = sorted(set(range(0, steps, max(1, steps // 20))) | {steps - 1})
    out["loss_curve"] = {str(i + 1): round(curve[i], 4) for i in shown}
    if not math.isfinite(out["loss"]):
        raise FloatingPointError(f"loss is {out['loss']} after {steps} steps")
    return out


def dynamo_graphs() -> int:
    """How many graphs dynamo compiled in this process (more than one: a recompilation or a break)."""
    from torch._dynamo.utils import counters

    return counters["stats"].get("unique_graphs", 0)


def compile_breakdown(top: Optional[int] = 20) -> dict:
    """Where the compilation so far went, in seconds: torch.compile's phases (tracing, AOT
    autograd, inductor, waiting for kernel compiles) and its `top` largest timed functions (None:
    all of them), so a slow first step can be attributed."""
    from torch._dynamo import utils

    names, values = utils.compile_times(repr="csv", aggregate=True)
    largest = sorted(zip(names, map(float, values)), key=lambda item: -item[1])[:top]
    return dict(phases={k: round(v, 2) for k, v in utils.calculate_time_spent().items()},
                largest={k: round(v, 2) for k, v in largest})
