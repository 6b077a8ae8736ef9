"""Processes launched on a machine without GPUs join one another, as they do on GPUs.

accelerate (1.15) gives launched processes a process group only where it finds an accelerator
device or `cpu=True` says to run on the CPU; otherwise each trains alone and the launch still
succeeds, and `cpu=True` under DeepSpeed makes accelerate drop DeepSpeed. `join_cpu_processes`
fixes the Accelerator's arguments before accelerate.Accelerator.__init__ (docs/distributed.md).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from fp8plug.integrations.launch_env import deepspeed_requested, env_flag


def join_cpu_processes(arguments: dict, handlers: list) -> None:
    """Adjust accelerate.Accelerator's `arguments` and `handlers` (in place): refuse `cpu=True` /
    `use_cpu: true` beside a DeepSpeed config (it would be ignored); under DeepSpeed, ask for the
    gloo process group DeepSpeed then runs on; otherwise set `cpu=True`, accelerate's own way to
    join CPU processes over gloo (MULTI_CPU). Nothing changes where torch sees an accelerator
    device, where the script runs as one process, or where it chose a process-group backend."""
    cpu = bool(arguments.get("cpu")) or env_flag("ACCELERATE_USE_CPU")
    deepspeed = deepspeed_requested(arguments)
    if deepspeed and cpu:
        where = ("cpu=True" if arguments.get("cpu")
                 else "ACCELERATE_USE_CPU=true (accelerate launch's --cpu / use_cpu: true)")
        raise ValueError(
            f"fp8plug.Accelerator: {where} with a DeepSpeed config would make accelerate ignore DeepSpeed "
            "and train without it; drop it (on a machine without GPUs fp8plug joins the DeepSpeed "
            "processes over gloo), or drop the DeepSpeed config to train with DDP."
        )
    if cpu or not _launched() or _has_accelerator():
        return
    from accelerate.utils import InitProcessGroupKwargs

    chosen = [i for i, h in enumerate(handlers) if isinstance(h, InitProcessGroupKwargs)]
    if chosen and handlers[chosen[0]].backend not in (None, "nccl"):  # nccl: accelerate's default
        return
    if not deepspeed:
        arguments["cpu"] = True
    elif chosen:
        handlers[chosen[0]] = dataclasses.replace(handlers[chosen[0]], backend="gloo")
    else:
        handlers.append(InitProcessGroupKwargs(backend="gloo"))


def _launched() -> bool:
    """Whether this is one of several processes a launcher started."""
    return int(os.environ.get("LOCAL_RANK", "-1")) != -1 and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _has_accelerator() -> bool:
    """Whether torch sees an accelerator device (CUDA or another), where accelerate picks its own
    process-group backend."""
    current = getattr(getattr(torch, "accelerator", None), "current_accelerator", None)
    if current is None:  # pragma: no cover - torch before 2.6
        return torch.cuda.is_available()
    return current() is not None


__all__ = ["join_cpu_processes"]
