"""One FP8 copy of an input that several layers read, eagerly, as torch.compile already makes it.

A decoder layer's q, k and v projections read one tensor, gate and up another; eagerly each layer
would cast it again. The last dynamic cast of a layer's input is kept here, with a weak reference
to that tensor and its version counter, and the next layer handed the same, unchanged tensor takes
it: the same bytes. A fused norm's output amax is kept the same way. One entry at a time, dropped
when another input is cast and by the first backward GEMM; never used under torch.compile.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass
class _Kept:
    source: "weakref.ref[torch.Tensor]"
    version: int
    amax: Optional[torch.Tensor] = None  # max |source| as float32, inf where it holds a NaN
    dtype: Optional[torch.dtype] = None  # the FP8 dtype of `cast`
    cast: Optional[Tuple] = None  # (FP8, transposed FP8 or None, inverse scale, amax)


# One entry: layers sharing an input run one after another. Dropped by the first backward GEMM,
# which never reads it, so its row-major copy does not outlive the forward. Not used under
# torch.compile: the compiler makes the one copy itself, and a Python-side cache would be traced
# into the graph. A one-element list rather than a global rebound: the slot is read once into a
# local, so a replacement by another thread (nn.DataParallel's replicas) never mixes two entries.
_SLOT = [None]


def _kept_for(t: torch.Tensor) -> Optional[_Kept]:
    """The kept entry, if it was made from `t`: that very tensor, or a view of the same memory
    laid out alike (`hidden[:, 0:]`, as transformers hands the last norm's output to lm_head).
    The source is alive, so its memory is not another tensor's, and views share its version
    counter, so an in-place change in between shows."""
    kept = _SLOT[0]
    source = None if kept is None else kept.source()
    if source is None or kept.version != t._version:
        return None
    if source is not t and (source.data_ptr() != t.data_ptr() or source.shape != t.shape
                            or source.stride() != t.stride() or source.dtype != t.dtype
                            or source.device != t.device):
        return None
    return kept


def cast_of(t: torch.Tensor, dtype: torch.dtype, transposed: bool) -> Optional[Tuple]:
    """The kept dynamic cast of `t` into `dtype`, with its transposed copy if `transposed`, or
    None if there is none."""
    kept = _kept_for(t)
    if kept is None or kept.cast is None or kept.dtype != dtype:
        return None
    t_fp8, t_t, inv, amax = kept.cast
    if transposed and t_t is None:
        return None
    return t_fp8, t_t if transposed else None, inv, amax


def known_amax(t: torch.Tensor) -> Optional[torch.Tensor]:
    """max |t|, if the kernel that wrote `t` left it here."""
    kept = _kept_for(t)
    return None if kept is None else kept.amax


def remember_amax(t: torch.Tensor, amax: torch.Tensor) -> None:
    _SLOT[0] = _Kept(weakref.ref(t), t._version, amax=amax)


def remember_cast(t: torch.Tensor, dtype: torch.dtype, cast: Tuple) -> None:
    _SLOT[0] = _Kept(weakref.ref(t), t._version, amax=cast[3], dtype=dtype, cast=cast)


def forget() -> None:
    _SLOT[0] = None
