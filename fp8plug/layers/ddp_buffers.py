"""Buffers DistributedDataParallel must not broadcast: per-rank state kept on converted modules.

DDP copies rank 0's buffers to every rank before each forward. Some buffers fp8plug adds are each
rank's own (the amaxes a rank recorded, its GEMM counts), and a broadcast would overwrite them, so
they are listed where DDP looks. Kept apart so that conversion, the engines and the GEMM counters
can all use it without importing one another.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn


def ignore_in_ddp(root: nn.Module, names: Iterable[str]) -> None:
    """Add buffer names (relative to `root`) to those DistributedDataParallel leaves alone when it
    broadcasts rank 0's buffers before each forward: per-rank state (recorded amaxes, GEMM counts)
    must not be overwritten. DDP reads `_ddp_params_and_buffers_to_ignore` on the module it wraps
    (a torch-private attribute, read by torch's DistributedDataParallel since torch 1.x)."""
    known = list(getattr(root, "_ddp_params_and_buffers_to_ignore", ()))
    root._ddp_params_and_buffers_to_ignore = known + [n for n in names if n not in known]


__all__ = ["ignore_in_ddp"]
