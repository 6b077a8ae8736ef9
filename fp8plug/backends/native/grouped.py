"""The native engine's grouped FP8 GEMM: a mixture-of-experts projection, all experts in one call.

What: out[rows of group e] = x[rows of group e] @ W_e^T, for token rows sorted by expert and group
ends `offs` (int32, cumulative, one per expert: what transformers' grouped_mm experts forward
builds), with all three GEMMs in FP8: forward and input gradient as one 2-D x 3-D grouped GEMM
each, the weight gradient as one 2-D x 2-D GEMM grouped over the token dimension. Models with few
experts run each of them as one dense FP8 GEMM per expert instead, faster there
(backends/native/dense_experts.py). The CPU emulation loops over groups (the reference, not the
fast path).

Why these choices (the kernel's constraints, read from torch's `_scaled_grouped_mm` checks and
tests, torch 2.11-2.13, sm_90):
- operands are float8_e4m3fn only (no e5m2), so gradients are e4m3 too; scales are float32 and
  rowwise: the 2-D operand one per row ([M]), the 3-D operand one per expert and output column
  ([E, N]); in the grouped-over-K weight gradient one per group and row of each operand
  ([E * N] and [E * K], group-major). Output is bfloat16 only; offsets int32.
- the first operand is row-major, the second column-major (a contiguous [E, N, K] weight seen as
  [E, K, N] through a transpose is exactly that).
- token groups start at multiples of 16 rows (an empty group gets 16 zero rows): the weight
  gradient's grouped dimension is the token dimension, read by TMA in 16-byte steps. So each
  group is padded with zero rows to a multiple of 16 (`GroupLayout`), in a buffer of a size
  known without reading the offsets (ceil16(S) + 16 * E rows), so torch.compile sees static
  shapes and the grouped kernel never syncs with the host (the dense GEMMs read the groups'
  bounds: `DenseBounds`).
  Zero rows add nothing to any product; what they cost is counted by the benchmark.
- dynamic rowwise scaling: each row's (or per-group column's) own amax, every call; the input
  gradient's weight one scale per expert, the largest of its forward row scales (that column
  amax pass would read every weight once more: `cast_weight_input_grad`). A per-tensor
  delayed scale shared by all experts would waste range on the experts with small activations,
  and the kernel takes rowwise scales anyway; dynamic scales need no state, so a checkpoint holds
  nothing for experts and resume is exact by construction (docs/moe.md).
A non-finite value stays visible: a NaN or inf amax gives a NaN row (see `rowwise`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from fp8plug.backends.gemm import emulates, float32_gemm, fp8_to_float
from fp8plug.backends.native import compiled_ops, grouped_cast, transposed_cast
from fp8plug.backends.native.dense_experts import DenseBounds, dense_grouped_mm
from fp8plug.backends.native.grouped_cast import (  # the casts' constants, written once there
    AMAX_FLOOR,  # an all-zero row (padding) gets a finite scale
    E4M3,
    E4M3_MAX,
    GROUP_ALIGNMENT,  # rows per token group, and the stride alignment of the FP8 operands
)
from fp8plug.backends.native.token_layout import GroupLayout, group_layout, layout_of, pad_groups, unpad_groups


def grouped_gemm_problem(device: Optional[torch.device] = None) -> Optional[str]:
    """Why the grouped FP8 GEMM cannot run on `device` (None: it can): emulated on a CPU; on CUDA
    torch's rowwise `_scaled_grouped_mm` needs sm_90 (Hopper)."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"no grouped FP8 GEMM on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (f"torch._scaled_grouped_mm with rowwise FP8 scales runs on sm_90 (Hopper) only; this GPU is "
                f"sm_{major}{minor}")
    return None


# --- casts ----------------------------------------------------------------------------------------


def rowwise(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """`t` in e4m3 with one scale per row (its last dimension), contiguous, and the inverse scales
    (what the GEMM multiplies back), shaped as `t` without its last dimension. A row with a NaN
    or inf amax gets a NaN or zero scale, so its products are NaN: a bad batch stays visible."""
    amax = torch.linalg.vector_norm(t, ord=float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = E4M3_MAX / amax.clamp(min=AMAX_FLOOR)
    # |t * scale| <= 448 by construction (the last float32 ulp rounds back to 448 in e4m3): no clamp pass
    data = (t * scale).to(E4M3).contiguous()
    return data, scale.reciprocal().squeeze(-1).contiguous()


def groupwise_columns(t: torch.Tensor, layout: GroupLayout) -> Tuple[torch.Tensor, torch.Tensor]:
    """The padded [P, C] operand of the weight gradient, transposed to row-major [C, P] in e4m3,
    scaled per group and column (the rows of the transposed operand within each group), and the
    inverse scales as [E * C], group-major, as the grouped-over-K GEMM takes them. A NaN counts as
    an inf amax (the fused kernel's atomic maximum cannot carry a NaN): its group's column gets
    scale 0, so the NaN and any inf stay NaN, the rest 0, and the inverse scale is inf; the
    weight gradient's column is NaN either way."""
    rows, columns = t.shape
    # each group is whole 16-row blocks: the amax of every block first (no atomics), then the
    # blocks' maximum per group (16 times fewer contended updates than row by row)
    blocks = torch.linalg.vector_norm(t.view(rows // GROUP_ALIGNMENT, GROUP_ALIGNMENT, columns), ord=float("inf"),
                                      dim=1, dtype=torch.float32)
    blocks = blocks.masked_fill(blocks.isnan(), float("inf"))
    index = layout.group[::GROUP_ALIGNMENT, None].expand(-1, columns)
    amax = blocks.new_zeros(layout.experts, columns).scatter_reduce_(0, index, blocks, "amax")
    scale = E4M3_MAX / amax.clamp(min=AMAX_FLOOR)
    data = (t * scale.index_select(0, layout.group)).to(E4M3)
    return data.t().contiguous(), scale.reciprocal().reshape(-1).contiguous()


def _fused(t: torch.Tensor) -> bool:
    """Whether `t`'s cast runs fused (grouped_cast and transposed_cast: outside a trace, on CUDA),
    the same bytes as the torch ops above."""
    return grouped_cast.usable(t)


def cast_weight_forward(w_nk: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The forward's weight [E, N, K] cast rowwise along K. Fused: stored [E, N, K], by
    transposed_cast's row kernel, which reads each row once at about 4.4 TB/s on an H200 (the
    compiled cast took 1.5x as long at Mixtral's gate_up, and the GPU waited about 0.18 ms for the
    host's call of it each time); stored [E, K, N] (GPT-OSS), by grouped_cast's compiled reduction
    along the strided K."""
    if not _fused(w_nk):
        return rowwise(w_nk)
    if not w_nk.is_contiguous():
        return grouped_cast.weight_forward(w_nk)
    data, inv = transposed_cast.rows_cast(w_nk.view(-1, w_nk.shape[-1]), AMAX_FLOOR)
    return data.view(w_nk.shape), inv.view(w_nk.shape[:-1])


def cast_weight_input_grad(w_nk: torch.Tensor, expert_inv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The input gradient's weight: [E, N, K] written [E, K, N] contiguous in e4m3 with one scale
    per expert, from `expert_inv` [E], the largest of the forward's row inverse scales (so the
    expert's amax over 448), and the kernel's per-(expert, k) inverse scales [E, K], each the
    expert's.

    Why one scale an expert, where the kernel takes one per column: a column's scale needs the
    columns' amaxes, a second read of every expert weight each step (1.6 ms of a compiled Mixtral
    step on an H200) where the forward's row amaxes already give the expert's. e4m3 keeps its three
    mantissa bits over 2^14 below its largest value, so columns whose amaxes differ by less than
    that lose no precision to a shared scale: with columns spread over 10^4 the input gradient is
    within 0.2 dB of per-column scaling against float64 (tests/cpu/test_moe_casts.py).
    TransformerEngine's grouped Linear scales each expert weight per tensor too. Fused:
    transposed_cast's transposed write with that scale; else `per_expert_transposed`."""
    if not _fused(w_nk):
        return per_expert_transposed(w_nk, expert_inv)
    scale = grouped_cast.reciprocal(expert_inv)
    if w_nk.stride(-1) == 1:
        columns = scale.view(-1, 1, 1).expand(-1, 1, w_nk.shape[-1])
        data = transposed_cast.cast_transposed(w_nk, columns, transposed_cast.ALL_ROWS)
    else:  # stored [E, K, N] (GPT-OSS): contiguous already
        data = grouped_cast.weight_input_grad(w_nk.transpose(-2, -1), scale)
    return data, _per_column(expert_inv, w_nk.shape[-1])


def expert_inverse_scales(w_inv: torch.Tensor) -> torch.Tensor:
    """The input gradient's weight inverse scale, one an expert [E]: the largest of the forward's
    row inverse scales w_inv [E, N] (the expert's amax over 448)."""
    return w_inv.amax(dim=-1)


def per_expert_transposed(w_nk: torch.Tensor, expert_inv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """`cast_weight_input_grad` by torch ops (the CPU emulation, and the fused casts' reference)."""
    data = grouped_cast.expert_scaled(w_nk.transpose(-2, -1), grouped_cast.reciprocal(expert_inv))
    return data, _per_column(expert_inv, w_nk.shape[-1])


def _per_column(expert_inv: torch.Tensor, columns: int) -> torch.Tensor:
    """Each expert's inverse scale for each of its `columns` [E, columns]: the kernel's layout."""
    return expert_inv[:, None].expand(-1, columns).contiguous()


def cast_tokens(t: torch.Tensor, layout: GroupLayout) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token rows [S, C] in the padded layout, cast per row: one kernel that gathers, casts and
    writes the zero rows where fused; padded by a copy, then cast, otherwise."""
    if _fused(t):
        return transposed_cast.rows_cast(t, AMAX_FLOOR, layout.source, layout.padded_rows)
    return rowwise(pad_groups(t, layout))


def cast_weight_grad_operand(t: torch.Tensor, layout: GroupLayout) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token rows [S, C] (columns contiguous) as the weight gradient's operand: padded, scaled per
    group and column, transposed to [C, P]. Fused: transposed_cast's two passes read `t` through
    the layout's row map, so the padded copy is never made."""
    if _fused(t):
        data, scale = transposed_cast.cast_columns(t, grouped_cast.scale_of, transposed_cast.GROUPS, layout.experts,
                                                   layout.source, layout.group, layout.padded_rows)
        return data, grouped_cast.reciprocal(scale).reshape(-1)
    return groupwise_columns(pad_groups(t, layout), layout)


# --- the GEMM, real or emulated ---------------------------------------------------------------------


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
                      offs: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """torch._scaled_grouped_mm on a GPU; on the CPU its emulation (same operands, same result in
    float32 arithmetic, then `out_dtype`). 2-D x 3-D: a [M, K], b [E, K, N] -> [M, N]; 2-D x 2-D:
    a [N, P], b [P, K] grouped over P -> [E, N, K]."""
    out_dtype = out_dtype if emulates(a.device) else torch.bfloat16  # the kernel writes bf16 only
    return _grouped_mm(a, b, inv_a, inv_b, offs, out_dtype, fast_accum)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """`t` with its last two dimensions column-major (the kernel's second operand), copied only if not."""
    flipped = t.transpose(-2, -1)
    return t if flipped.is_contiguous() else flipped.contiguous().transpose(-2, -1)


@torch.library.custom_op("fp8plug::scaled_grouped_mm", mutates_args=())
def _grouped_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor, offs: torch.Tensor,
                out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """The grouped GEMM as one operator that torch.compile calls as it is: inductor otherwise
    lowers torch._scaled_grouped_mm to its own template and picks the operands' strides itself.
    Inside, the operands are put in the layouts the kernel documents (first row-major, second
    column-major), a no-op for what the casts above produce. Made while chasing compiled expert
    weight gradients unrelated to eager ones on an H100 (0 dB); that bug lay in how torch 2.11
    traced the autograd.Function around it (backends/native/compiled_ops.py)."""
    if not emulates(a.device):
        return torch._scaled_grouped_mm(a.contiguous(), _column_major(b), inv_a.contiguous(), inv_b.contiguous(),
                                        offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    return _emulated_grouped_mm(a, b, inv_a, inv_b, offs, out_dtype)


def _emulated_grouped_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
                         offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """What the kernel computes, group by group: FP8 read exactly, scales applied, float32 GEMMs."""
    with float32_gemm():
        return _emulated_grouped_mm_float32(a, b, inv_a, inv_b, offs, out_dtype)


def _emulated_grouped_mm_float32(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
                                 offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    ends = offs.tolist()
    if b.dim() == 3:  # a [M, K] rows grouped; b [E, K, N] with scales [M] and [E, N]
        a32 = fp8_to_float(a) * inv_a[:, None]
        out = a32.new_zeros(a.shape[0], b.shape[2])
        start = 0
        for e, end in enumerate(ends):
            if end > start:
                out[start:end] = a32[start:end] @ (fp8_to_float(b[e]) * inv_b[e][None, :])
            start = end
        return out.to(out_dtype)
    # a [N, P], b [P, K], grouped over P, scales [E * N] and [E * K]
    n, k, experts = a.shape[0], b.shape[1], len(ends)
    a32, b32 = fp8_to_float(a), fp8_to_float(b)
    out = a32.new_zeros(experts, n, k)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            left = a32[:, start:end] * inv_a[e * n:(e + 1) * n, None]
            out[e] = left @ (b32[start:end] * inv_b[None, e * k:(e + 1) * k])
        start = end
    return out.to(out_dtype)


@_grouped_mm.register_fake
def _(a, b, inv_a, inv_b, offs, out_dtype, fast_accum):
    if b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype)
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]), dtype=out_dtype)


# --- the autograd function ------------------------------------------------------------------------------


def _forward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, transposed: bool,
             result_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the output, each expert's largest forward row inverse scale [E], which the input gradient's
    weight cast takes: `cast_weight_input_grad`)."""
    layout, dense = layout_of(offs, x.shape[0])
    w_nk = weight.transpose(-2, -1) if transposed else weight  # [E, N, K]
    x_fp8, x_inv = cast_tokens(x, layout)
    w_fp8, w_inv = cast_weight_forward(w_nk)
    out_dtype = x.dtype if emulates(x.device) else torch.bfloat16
    out = _tokens_gemm(x_fp8, w_fp8.transpose(-2, -1), x_inv, w_inv, layout, dense, out_dtype, True)
    return out.to(result_dtype), expert_inverse_scales(w_inv)


def _backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
              expert_inv: torch.Tensor, transposed: bool, need_x: bool,
              need_w: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(grad_x or None, grad_w or None): each GEMM only where its result is needed.

    Ordered for the peak: an MoE model's memory peaks in the backward of its first layer's expert
    projections, where nearly every parameter gradient already exists. So each FP8 operand is
    freed as soon as its GEMM has run, and the weight gradient is made last, in pieces
    (`_weight_gradient`)."""
    layout, dense = layout_of(offs, x.shape[0])
    grad_out = grad_out.contiguous()
    out_dtype = x.dtype if emulates(x.device) else torch.bfloat16
    grad_x = grad_w = None
    if need_x:
        g_fp8, g_inv = cast_tokens(grad_out, layout)
        w_nk = weight.transpose(-2, -1) if transposed else weight
        w_kn_fp8, w_kn_inv = cast_weight_input_grad(w_nk, expert_inv)  # [E, K, N], a scale an expert
        grad_x = _tokens_gemm(g_fp8, w_kn_fp8.transpose(-2, -1), g_inv, w_kn_inv, layout, dense, out_dtype, False)
        del g_fp8, w_kn_fp8  # 0.5 and 0.9 GB a Mixtral gate_up
        grad_x = grad_x.to(x.dtype)
    if need_w:
        x_t, x_t_inv = cast_weight_grad_operand(x, layout)  # [K, P]
        grad_w = _weight_gradient(grad_out, x_t, x_t_inv, layout, dense(), weight, transposed,
                                  out_dtype)
    return grad_x, grad_w


# The most bytes of the kernel's bf16 output made at once while the weight gradient is converted to
# the weight's dtype (float32 master weights): a Mixtral gate_up gradient is 1.9 GB in bf16 beside
# its 3.8 GB float32 copy, at the moment of the step's peak memory. On an H200 three pieces' outputs
# were live at that moment, so the pieces are small: a Mixtral gate_up's weight gradient is 28
# GEMMs of 1024 output rows, each still 140 GFLOP. Measured there (Mixtral shape, 2 layers, compiled;
# docs/moe.md): the step peaked at 53.0 GB against Accelerate bf16's 53.4 (57.9 in one piece), and
# the pieces' own casts cost about a tenth of the step.
WEIGHT_GRADIENT_PIECE_BYTES = 64 * 2**20
# The most bytes of the output gradient's FP8 operand made at once, whatever the weight's dtype. With
# bf16 weights the step's memory peaks in the first layer's gate_up weight gradient too, where that
# operand is the one buffer bf16's grouped GEMM does not have: 0.47 GB whole for a Mixtral gate_up
# (one H200, compiled: the step peaked 0.33 GB above bf16's, 28.36 against 28.04 GB), four pieces of
# 118 MB at this limit, each 8 dense GEMMs of 7168 output rows (the step then peaked at 28.03 GB;
# benchmarks/moe/peak_allocations.py names what is live at a row's peak).
WEIGHT_GRADIENT_OPERAND_PIECE_BYTES = 128 * 2**20


def _weight_gradient(grad_out: torch.Tensor, x_t: torch.Tensor, x_t_inv: torch.Tensor, layout: GroupLayout,
                     bounds: Optional[list], weight: torch.Tensor, transposed: bool,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """The weight gradient [E, N, K] (or [E, K, N] with `transposed`) in the weight's dtype, from the
    output gradient [S, N] and the input's FP8 operand x_t [K, P], made in pieces of output rows
    (columns of grad_out), each piece's FP8 operand cast from its own columns and its product
    written into the gradient as it comes (converted where the weight is float32): the whole FP8
    operand never exists, nor, where converted, the whole bf16 gradient beside the float32 one. The
    same values as in one piece: a column's scale is its own group's amax, and every output element
    is one piece's sum over P."""
    n, k = grad_out.shape[1], x_t.shape[0]
    converted = out_dtype != weight.dtype
    limits = [WEIGHT_GRADIENT_OPERAND_PIECE_BYTES // layout.padded_rows]
    if converted:
        limits.append(WEIGHT_GRADIENT_PIECE_BYTES // (layout.experts * k * torch.finfo(out_dtype).bits // 8))
    rows = max(GROUP_ALIGNMENT, min(limits) // GROUP_ALIGNMENT * GROUP_ALIGNMENT)

    def product(columns: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:  # [E, n, K]
        g_t, g_t_inv = cast_weight_grad_operand(columns, layout)
        if bounds is not None:
            return dense_grouped_mm(g_t, x_t.t(), g_t_inv, x_t_inv, bounds, out_dtype, out=out)
        return scaled_grouped_mm(g_t, x_t.t(), g_t_inv, x_t_inv, layout.offs, out_dtype, False)

    if rows >= n and not converted:
        grad = product(grad_out)
        return grad.transpose(-2, -1) if transposed else grad
    grad = torch.empty_like(weight, memory_format=torch.contiguous_format)
    grad_nk = grad.transpose(-2, -1) if transposed else grad
    for start in range(0, n, rows):
        piece = grad_nk[:, start:start + rows]
        # written in place where the dense GEMMs can (each expert's rows of the piece are contiguous)
        direct = bounds is not None and not converted and piece[0].is_contiguous()
        made = product(grad_out[:, start:start + rows], piece if direct else None)
        if made is not piece:
            piece.copy_(made)
    return grad


def _tokens_gemm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor, layout: GroupLayout,
                 dense: DenseBounds, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """The forward's or the input gradient's GEMM, padded token rows a [P, K] times the experts'
    b [E, K, N], back in the tokens' order [S, N]: dense per expert, written straight at the
    tokens' rows, where `dense` says so; else grouped, then gathered from the padded layout."""
    bounds = dense()
    if bounds is not None:
        return dense_grouped_mm(a, b, inv_a, inv_b, bounds, out_dtype, fast_accum, dense.token_starts(),
                                layout.rows.shape[0])
    return unpad_groups(scaled_grouped_mm(a, b, inv_a, inv_b, layout.offs, out_dtype, fast_accum), layout)


class _GroupedFP8Linear(torch.autograd.Function):
    """out = grouped x @ W_e^T with every GEMM in FP8 (module doc), run eagerly. Saves the
    high-precision input and weight (as the bf16 grouped GEMM does) and re-pads in backward; the
    three GEMMs each run only where their result is needed (a frozen expert weight gets no
    weight-gradient GEMM)."""

    @staticmethod
    def forward(ctx, x, weight, offs, transposed: bool, result_dtype: torch.dtype):
        out, expert_inv = _forward(x, weight, offs, transposed, result_dtype)
        ctx.save_for_backward(x, weight, offs, expert_inv)
        ctx.transposed = transposed
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offs, expert_inv = ctx.saved_tensors
        grad_x, grad_w = _backward(grad_out, x, weight, offs, expert_inv, ctx.transposed, *ctx.needs_input_grad[:2])
        return grad_x, grad_w, None, None, None


# Compiled: two operators (backends.native.compiled_ops says why), the same functions inside.
@torch.library.custom_op("fp8plug::grouped_fp8_linear", mutates_args=())
def _grouped_op(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, transposed: bool,
                result_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    out, expert_inv = _forward(x, weight, offs, transposed, result_dtype)
    return out.contiguous(), expert_inv


@_grouped_op.register_fake
def _(x, weight, offs, transposed, result_dtype):
    return (x.new_empty((x.shape[0], weight.shape[-1] if transposed else weight.shape[-2]), dtype=result_dtype),
            x.new_empty((weight.shape[0],), dtype=torch.float32))


@torch.library.custom_op("fp8plug::grouped_fp8_linear_backward", mutates_args=())
def _grouped_op_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                         expert_inv: torch.Tensor, transposed: bool, need_x: bool,
                         need_w: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_w = _backward(grad_out, x, weight, offs, expert_inv, transposed, need_x, need_w)
    return compiled_ops.or_absent(grad_x, x), compiled_ops.or_absent(grad_w, weight)


@_grouped_op_backward.register_fake
def _(grad_out, x, weight, offs, expert_inv, transposed, need_x, need_w):
    return (torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else compiled_ops.absent(x),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if need_w else compiled_ops.absent(weight))


def _grouped_op_setup(ctx, inputs, output):
    x, weight, offs, transposed, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, offs, output[1])
    ctx.transposed = transposed


def _grouped_op_autograd(ctx, grad_out, _):
    x, weight, offs, expert_inv = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x, grad_w = _grouped_op_backward(grad_out.contiguous(), x, weight, offs, expert_inv, ctx.transposed, need_x,
                                          need_w)
    return compiled_ops.or_none(grad_x, need_x), compiled_ops.or_none(grad_w, need_w), None, None, None


_grouped_op.register_autograd(_grouped_op_autograd, setup_context=_grouped_op_setup)


def grouped_fp8_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                       transposed: bool = False) -> torch.Tensor:
    """The grouped FP8 projection: x [S, K] sorted by expert, `offs` the groups' ends ([E] int32),
    weight [E, N, K] (or [E, K, N] with `transposed`, GPT-OSS's layout) -> [S, N] in the autocast
    dtype where autocast is on (as a Linear's input and output under autocast), else in x's dtype."""
    autocast = torch.is_autocast_enabled(x.device.type)
    result_dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    if autocast and x.dtype == torch.float32:
        # read as a Linear under autocast reads it: x is quantized to FP8 either way (bf16's rounding
        # is 2^-9, e4m3's 2^-4), and the x kept for the weight gradient is then half the bytes (a
        # float32 residual stream hands transformers' experts float32 tokens)
        x = x.to(result_dtype)
    if compiled_ops.compiling():
        return _grouped_op(x, weight, offs.to(torch.int32), transposed, result_dtype)[0]
    return _GroupedFP8Linear.apply(x, weight, offs.to(torch.int32), transposed, result_dtype)


# what the conversion report says of the experts (the recipe's `scaling` is for Linears; this kernel
# takes one float32 scale per row and per expert column, from the current amax)
grouped_fp8_linear.scaling = "dynamic rowwise"


__all__ = ["GROUP_ALIGNMENT", "GroupLayout", "group_layout", "grouped_fp8_linear", "grouped_gemm_problem",
           "pad_groups", "rowwise", "scaled_grouped_mm", "unpad_groups"]
