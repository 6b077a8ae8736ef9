"""The experts' FP8 GEMMs as one dense GEMM per expert, for models with few experts.

Why: torch._scaled_grouped_mm (CUTLASS) runs all experts in one launch, which is what many small
experts need; but where each expert gets thousands of token rows (Mixtral: 8 experts, about 2048
rows each at 8192 tokens), cuBLAS's dense FP8 GEMM on each expert's rows or columns is faster,
the weight gradient most (the grouped kernel reaches a third of the FP8 peak there). The dense
GEMMs take the grouped kernel's own operands and scales (backends/native/grouped.py: rows padded
to 16 per group, rowwise scales), so both give the same values up to the order of the float32
accumulation.

What it costs: the host needs each group's bounds, which live on the GPU; `DenseBounds` copies
them as soon as they exist and waits only at the first GEMM. What it saves besides: the forward's
and the input gradient's results are written straight at their tokens' rows, so the gather from
the padded layout back to the tokens' order (1.8 ms a Mixtral step) is not needed.
"""

from __future__ import annotations

from typing import Optional

import torch

from fp8plug.backends.gemm import emulates, scaled_mm

# Experts up to this many run each of the three GEMMs as one dense FP8 GEMM per expert
# (`dense_grouped_mm`: torch._scaled_mm on the expert's rows or columns) rather than as one
# torch._scaled_grouped_mm; 0: never. cuBLAS's dense FP8 GEMMs beat the grouped CUTLASS kernel
# where each expert gets thousands of rows. Measured at Mixtral's shapes (8 experts, about 2048
# tokens each; one H200): alone, forward / input gradient / weight gradient 3.36 / 3.75 / 4.31
# against 3.53 / 3.93 / 5.24 ms for gate_up (grouped_gemm.py); the compiled training step 94.2k
# against 91.0k tok/s with both results gathered back from the padded layout (moe_llm.py's `-grouped`
# row), 97.1k written at the tokens' rows. Many small experts (Qwen3-MoE's 128) stay grouped: a
# launch per expert and GEMM, each too small to fill the GPU.
DENSE_GEMMS_MAX_EXPERTS = 8


class DenseBounds:
    """The groups' (start, end) rows on the host where the GEMMs run dense (DENSE_GEMMS_MAX_EXPERTS),
    else None.

    Made as soon as the layout exists, it starts copying the bounds to pinned host memory, and the
    first GEMM that needs them waits for that copy only: the casts launched in between keep the GPU
    busy meanwhile. Reading them with a plain sync at the GEMM left the GPU idle (Mixtral shape,
    one H200: 13.3 against 3.2 ms a step idle, which cost more than the dense GEMMs saved). Never
    while a CUDA graph is captured (no host read can happen there): the GEMMs then run grouped."""

    def __init__(self, padded_ends: torch.Tensor, token_ends: torch.Tensor):
        """`padded_ends`: the padded layout's group ends (grouped.GroupLayout.offs); `token_ends`:
        the tokens' own (the experts forward's offsets), both [E] on the device."""
        self.bounds, self.starts, self.host, self.copied = None, None, None, None
        self.dense = padded_ends.shape[0] <= DENSE_GEMMS_MAX_EXPERTS and not _capturing(padded_ends)
        if self.dense:
            self.ends = torch.stack([padded_ends, token_ends.to(padded_ends.dtype)])
        if self.dense and padded_ends.is_cuda:
            self.host = torch.empty(self.ends.shape, dtype=self.ends.dtype, pin_memory=True)
            self.host.copy_(self.ends, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def __call__(self) -> Optional[list]:
        """The padded groups' (start, end) rows, or None where the GEMMs run grouped."""
        if self.dense and self.bounds is None:
            if self.copied is not None:
                self.copied.synchronize()
            padded, tokens = (self.host if self.host is not None else self.ends).tolist()
            self.bounds, self.starts = _pairs(padded), [0] + tokens[:-1]
        return self.bounds

    def token_starts(self) -> list:
        """Each group's first row in the tokens' own order (unpadded); after a call."""
        return self.starts


def _capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on `t`'s device (mode="reduce-overhead")."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def group_bounds(padded_ends: torch.Tensor) -> list:
    """Each padded group's (start, end) row on the host, from the layout's ends on the device (a
    sync where that is a GPU)."""
    return _pairs(padded_ends.tolist())


def _pairs(ends: list) -> list:
    return list(zip([0] + ends[:-1], ends))


def dense_grouped_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor, bounds: list,
                     out_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = False,
                     starts: Optional[list] = None, rows: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`scaled_grouped_mm` as one dense FP8 GEMM per expert, each written into its slice of the
    result. 2-D x 3-D (forward, input gradient): the group's rows of a [P, K] times b[e] [K, N]
    (column-major), scales the group's [rows] and [N] -> [P, N] (rows past the last group left
    unwritten: no GEMM reads them). 2-D x 2-D (weight gradient): a[:, group] [N, rows] times
    b[group] [rows, K], the group's [N] and [K] scales -> [E, N, K]. Slices are passed as they
    are: groups are padded to 16 rows, so each starts aligned.

    With `starts` (2-D x 3-D), group e's rows land at row starts[e] of a [rows, N] result, the
    tokens' own order: the zero rows that pad a group's end are written over by the next group's
    GEMM (they run in order on one stream), and the last group's fall past `rows` (16 more are
    allocated). Every row of the result is then one token's, with no gather back.

    `out` (2-D x 2-D): an [E, N, K] view to write into (each out[e] contiguous, of out_dtype), such
    as a piece of a larger gradient; returned."""
    emulated = emulates(a.device)
    out_dtype = out_dtype if emulated else torch.bfloat16  # the kernel writes bf16 (rowwise)
    if b.dim() == 2:
        experts, n, k = len(bounds), a.shape[0], b.shape[1]
        if out is None:
            out = torch.empty(experts, n, k, device=a.device, dtype=out_dtype)
        scale_a, scale_b = inv_a.view(experts, n, 1), inv_b.view(experts, 1, k)
        for e, (s, t) in enumerate(bounds):
            _dense_mm(a[:, s:t], b[s:t], scale_a[e], scale_b[e], out[e], fast_accum)
        return out
    in_place = starts is None
    out = torch.empty(a.shape[0] if in_place else rows + 16, b.shape[2], device=a.device, dtype=out_dtype)
    for e, (s, t) in enumerate(bounds):
        place = s if in_place else starts[e]
        _dense_mm(a[s:t], b[e], inv_a[s:t, None], inv_b[e, None, :], out[place:place + t - s], fast_accum)
    return out if in_place else out[:rows]


def _dense_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor, out: torch.Tensor,
              fast_accum: bool) -> None:
    """out = (a * inv_a) @ (b * inv_b), rowwise scales, written into `out` (a slice of a larger
    result): torch._scaled_mm on a GPU, the emulation on a CPU."""
    if emulates(a.device):
        out.copy_(scaled_mm(a.contiguous(), b, inv_a, inv_b, out.dtype))
    else:
        torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out.dtype, use_fast_accum=fast_accum, out=out)


__all__ = ["DENSE_GEMMS_MAX_EXPERTS", "DenseBounds", "dense_grouped_mm", "group_bounds"]
