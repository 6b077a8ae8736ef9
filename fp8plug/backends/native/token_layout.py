"""The grouped GEMM's padded token layout: where each token row lands once every expert's group
starts at a multiple of GROUP_ALIGNMENT rows, made on the device from the experts' offsets, and
made once per offsets tensor (`layout_of`).

Why once: a layer's two expert projections read the same offsets, forward and backward, and with
few experts the GEMMs run dense per expert (backends/native/dense_experts.py), which needs the
groups' bounds on the host: each read waits for the GPU to reach the offsets. Made per call, a
step made the layout and read the bounds four times a layer; made per offsets tensor, once, in
the layer's forward. (On a Mixtral step, one H200, the GPU stayed idle about 3 ms a step either
way: what waits there is not this read.)
"""

from __future__ import annotations

import weakref
from typing import Dict, NamedTuple, Tuple

import torch

from fp8plug.backends.native.dense_experts import DenseBounds
from fp8plug.backends.native.grouped_cast import GROUP_ALIGNMENT


class GroupLayout(NamedTuple):
    """Where each token row of a grouped operand lands once every group starts at a multiple of
    GROUP_ALIGNMENT, computed on the device from the offsets (no host sync; `group_layout`).

    `rows`: the destination of each of the S input rows in the padded buffer of `padded_rows`
    rows; `source`: the other way round, the input row of each padded row (int32, -1 for a zero
    row); `offs`: the padded groups' ends (int32); `group`: the group of each padded row (rows
    past the last group count as the last one: they are zero). Rows past `offs[-1]` in the input
    (expert-parallel sentinels) land past the padded last group, where no GEMM reads."""

    rows: torch.Tensor
    source: torch.Tensor
    offs: torch.Tensor
    group: torch.Tensor
    padded_rows: int
    experts: int


def group_layout(offs: torch.Tensor, num_rows: int) -> GroupLayout:
    experts = offs.shape[0]
    ends = offs.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    # an empty group gets 16 zero rows too: the weight gradient of an expert no token reached is
    # then computed (zeros) like any other, never left as whatever memory the kernel skipped held
    padded_sizes = torch.clamp((sizes + GROUP_ALIGNMENT - 1) // GROUP_ALIGNMENT, min=1) * GROUP_ALIGNMENT
    padded_ends = torch.cumsum(padded_sizes, 0)
    zero = ends.new_zeros(1)
    starts = torch.cat([zero, ends])  # group e starts at starts[e]; "group" E is the tail
    padded_starts = torch.cat([zero, padded_ends])
    index = torch.arange(num_rows, device=offs.device)
    group_of_row = torch.searchsorted(ends, index, right=True)
    rows = index - starts[group_of_row] + padded_starts[group_of_row]
    padded_rows = -(-num_rows // GROUP_ALIGNMENT) * GROUP_ALIGNMENT + GROUP_ALIGNMENT * experts
    padded_index = torch.arange(padded_rows, device=offs.device)
    group = torch.searchsorted(padded_ends, padded_index, right=True).clamp_(max=experts - 1)
    source = torch.full((padded_rows,), -1, dtype=torch.int32, device=offs.device)
    source.index_copy_(0, rows, index.to(torch.int32))
    return GroupLayout(rows, source, padded_ends.to(torch.int32), group, padded_rows, experts)


def pad_groups(t: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """`t`'s rows in the padded layout, zeros between the groups."""
    return t.new_zeros(layout.padded_rows, t.shape[-1]).index_copy(0, layout.rows, t)


def unpad_groups(t: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    return t.index_select(0, layout.rows)


class _Made(NamedTuple):
    offs: weakref.ref
    version: int
    num_rows: int
    layout: GroupLayout
    bounds: DenseBounds


_MADE: Dict[int, _Made] = {}


def layout_of(offs: torch.Tensor, num_rows: int) -> Tuple[GroupLayout, DenseBounds]:
    """`offs`'s padded layout for `num_rows` token rows and its groups' bounds (DenseBounds), made
    at the first call for this offsets tensor and returned again while it lives unchanged (the same
    object, the same version counter: an in-place write makes them anew). Not kept for an inference
    tensor (it has no version counter) or while a CUDA graph is captured."""
    made = _MADE.get(id(offs))
    if (made is not None and made.offs() is offs and made.version == offs._version
            and made.num_rows == num_rows):
        return made.layout, made.bounds
    layout = group_layout(offs, num_rows)
    bounds = DenseBounds(layout.offs, offs)
    if not torch.is_inference(offs) and not (offs.is_cuda and torch.cuda.is_current_stream_capturing()):
        _MADE[id(offs)] = _Made(weakref.ref(offs, _forget), offs._version, num_rows, layout, bounds)
    return layout, bounds


def _forget(dead: weakref.ref) -> None:
    """An offsets tensor died: its layout goes with it (found by its reference, not its id, which
    a later tensor may take)."""
    for key, made in list(_MADE.items()):
        if made.offs is dead:
            del _MADE[key]


__all__ = ["GroupLayout", "group_layout", "layout_of", "pad_groups", "unpad_groups"]
