"""Finer FP8 scaling for the native engine: one scale per row (`rowwise`, `rowwise_with_gw_hp`) or
per tile and block (`blockwise`, DeepSeek-V3's recipe), instead of one per tensor.

Why: one scale per tensor is set by the tensor's largest value, so a few outlier rows or channels
(which LLM activations grow as training goes on) push every other value towards FP8's
subnormals. A scale per row, or per 1x128 tile, confines an outlier's damage to its own row or
tile.

Every operand of every GEMM is scaled along that GEMM's reduction dimension K (a scale that
varied along K could not be taken out of the dot product), always from the current tensor
(dynamic: there is no history to delay from), and cast to E4M3 (torchao's rowwise recipes and
DeepSeek-V3 both use E4M3 for gradients too). Written as `out[M, N] = A[M, K] @ B[N, K].T`:

  word                 fprop x / w               dgrad grad / w            wgrad grad.T / x.T
  rowwise              row / row                 row / row of w.T          row / row
  rowwise_with_gw_hp   row / row                 row / whole tensor        high precision (bf16)
  blockwise            1x128 / 128x128           1x128 / 128x128           1x128 / 1x128

(torchao 0.18's Float8LinearRecipeName ROWWISE and ROWWISE_WITH_GW_HP, both with scales rounded
down to powers of two; DeepSeek-V3's blockwise with float32 scales.) The backward operands are
cast from high precision along their own reduction axis in forward and kept in FP8, not
re-scaled from forward's FP8 copy; a 128x128 block is the same block of w.T, so the weight is
cast once.

The GEMMs: `torch._scaled_mm` with [M, 1] x [1, N] float32 scales (rowwise, bf16 output) and
`torch.nn.functional.scaled_mm` with ScalingType.BlockWise1x128 / BlockWise128x128 (sm_90, CUDA
12.9+) on a GPU; on the CPU their exact emulation: each operand dequantised with its scales
(every tile and block, partial ones at the edges included) and one float32 GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from fp8plug.backends.gemm import emulates, float32_gemm, fp8_to_float
from fp8plug.backends.native import compiled_ops, tile_cast, transposed_cast
from fp8plug.backends.native.scaling import E4M3, FP8_MAX, quantize, scale_from_amax

GRANULAR = ("rowwise", "rowwise_with_gw_hp", "blockwise")
BLOCK = 128
ROW, TENSOR, TILE, SQUARE = "row", "tensor", "1x128", "128x128"  # how an operand [rows, K] is scaled
POWER_OF_TWO = {"rowwise": True, "rowwise_with_gw_hp": True, "blockwise": False}
# how (fprop, dgrad, wgrad) scale (A, B); None: that GEMM in high precision
GEMMS = {
    "rowwise": ((ROW, ROW), (ROW, ROW), (ROW, ROW)),
    "rowwise_with_gw_hp": ((ROW, ROW), (ROW, TENSOR), None),
    "blockwise": ((TILE, SQUARE), (TILE, SQUARE), (TILE, TILE)),
}


# Compiled, a transposed operand of fewer elements stays traced torch ops rather than the
# `_cast_columns` operator: the operator's host time (a Python operator and its Triton launches)
# is hidden behind a large layer's GPU work but not a small one's. With the operator on every
# transposed operand the 162M model of benchmarks/training/real_text.py (hidden 768, 4096 tokens)
# trained rowwise at 25k tok/s on an H200.
COLUMNS_OPERATOR_MIN_ELEMENTS = 1 << 24


def token_multiple(scaling: str) -> int:
    """The token count a granular layer pads to: 128 for blockwise (the tokens are wgrad's
    reduction dimension, scaled in 1x128 tiles), else the GEMM's 16."""
    return BLOCK if scaling == "blockwise" else 16


def feature_problem(scaling: str, in_features: int, out_features: int) -> Optional[str]:
    """Why a Linear cannot run with `scaling` (None if it can): blockwise's 128x128 weight blocks
    and 1x128 tiles need in and out features divisible by 128."""
    if scaling == "blockwise" and (in_features % BLOCK or out_features % BLOCK):
        return (f"in_features={in_features}, out_features={out_features} not both divisible by {BLOCK} "
                "(blockwise scaling's 128x128 weight blocks)")
    return None


def blockwise_gemm_problem(capability, cuda_version) -> Optional[str]:
    """Why torch cannot run blockwise-scaled GEMMs on this CUDA device (None if it can)."""
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType") or not hasattr(F.ScalingType, "BlockWise1x128"):
        return (f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with ScalingType.BlockWise1x128 "
                "(torch 2.10 or newer)")
    if capability != (9, 0):
        return f"torch's blockwise-scaled FP8 GEMM runs on sm_90 (Hopper) only, not sm_{capability[0]}{capability[1]}"
    try:
        major, minor = (int(p) for p in str(cuda_version).split(".")[:2])
    except ValueError:
        return None
    if (major, minor) < (12, 9):
        return f"torch is built for CUDA {cuda_version}; blockwise-scaled GEMMs need cuBLAS from CUDA 12.9 or newer"
    return None


def device_problem(word: str, device) -> Optional[str]:
    """Why scaling `word` cannot run on `device` (a DeviceInfo), or None: the finer scalings need
    torch's rowwise (sm_90 or newer) or blockwise (sm_90, CUDA 12.9+) FP8 GEMMs on a GPU; the CPU
    emulates them."""
    if device.type != "cuda" or word not in GRANULAR or device.capability is None:
        return None
    if word == "blockwise":
        return blockwise_gemm_problem(device.capability, device.cuda_version)
    if device.capability < (9, 0):
        major, minor = device.capability
        return f"torch's rowwise-scaled FP8 GEMM needs sm_90 or newer, not sm_{major}{minor}"
    return None


# --- one operand ---------------------------------------------------------------------------------------


def _tile(kind: str, rows: int, cols: int) -> Tuple[int, int]:
    return {ROW: (1, cols), TENSOR: (rows, cols), TILE: (1, BLOCK), SQUARE: (BLOCK, BLOCK)}[kind]


def expand_scales(s: torch.Tensor, kind: str, rows: int, cols: int) -> torch.Tensor:
    """Per-tile values `s` ([ceil(rows/r), ceil(cols/c)] for tiles r x c) repeated over each
    tile's elements, cut to [rows, cols]."""
    r, c = _tile(kind, rows, cols)
    return s.repeat_interleave(r, 0)[:rows].repeat_interleave(c, 1)[:, :cols]


def cast_tiles(t: torch.Tensor, kind: str, power_of_two: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(t [rows, K] in E4M3, the inverse scales: one float32 per tile of `kind`, shaped
    [ceil(rows/r), ceil(K/c)]). Each tile's scale is E4M3's max over the tile's amax (floored to a
    power of two where `power_of_two`, as torchao's rowwise recipes do); an all-zero or
    non-finite tile keeps scale 1, and a non-finite value becomes NaN (scaling.quantize). Eagerly
    on CUDA two Triton passes (backends.native.tile_cast; transposed operands: transposed_cast),
    which give the torch ops' bytes. On the CPU one operator torch.compile calls as it is: torch
    2.13's CPU inductor failed to generate code for the tile reduction traced into it (its loop
    split); GPU compilers fuse it."""
    if torch.compiler.is_compiling():
        return _traced_cast(t, kind, power_of_two)
    if _columns_of(t, kind):
        return _cast_columns(t.detach().t(), kind, power_of_two)
    if tile_cast.usable(t):
        return tile_cast.cast(t.detach(), _tile(kind, *t.shape), power_of_two, columns_major=kind == TILE)
    return _cast_tiles(t, kind, power_of_two)


def _traced_cast(t: torch.Tensor, kind: str, power_of_two: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """cast_tiles as a compiled graph holds it: on a GPU the torch ops (`fp8plug::tile_cast`, fused
    by the compiler into the kernel that makes the tensor), but a large transposed operand's
    `_cast_columns`; `_cpu_cast_tiles` on the CPU. Called where a trace is certain (a compiled
    granular layer, forward and its autograd formula)."""
    if t.device.type == "cpu":
        return _cpu_cast_tiles(t.detach(), kind, power_of_two)
    if _columns_of(t, kind) and t.numel() >= COLUMNS_OPERATOR_MIN_ELEMENTS:
        return _cast_columns(t.detach().t(), kind, power_of_two)
    return torch.ops.fp8plug.tile_cast(t.detach(), kind, power_of_two)


def _columns_of(t: torch.Tensor, kind: str) -> bool:
    """Whether `t` is the transposed view of a row-major tensor, cast per row (rowwise) or 1x128
    tile: a column-scaled transposed cast of that tensor, which backends.native.transposed_cast
    makes in two passes on CUDA (traced torch ops made it about six times slower than that)."""
    return (kind in (ROW, TILE) and t.dim() == 2 and t.stride(0) == 1 and t.stride(1) == t.shape[0]
            and transposed_cast.usable(t))


@torch.library.custom_op("fp8plug::cast_columns", mutates_args=())
def _cast_columns(source: torch.Tensor, kind: str, power_of_two: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """cast_tiles(source.t(), kind, power_of_two) for a row-major `source` [R, C] on CUDA: the
    column amaxes (one Triton pass), then the cast written transposed with tile_scale's scales
    worked out in its kernel (a second pass; the same values). One operator, so that the layers
    sharing an input (q, k and v) share its cast in a compiled graph."""
    segments = transposed_cast.ALL_ROWS if kind == ROW else transposed_cast.TILES_128
    data, inv = transposed_cast.tile_scaled_columns(source, power_of_two, segments)
    # [C, count] outer-dimension-major: the layout the blockwise GEMM takes its 1x128 scales in
    return data, inv[0].t()


@_cast_columns.register_fake
def _(source, kind, power_of_two):
    rows, cols = source.shape
    count = 1 if kind == ROW else -(-rows // BLOCK)
    return source.new_empty((cols, rows), dtype=E4M3), source.new_empty((count, cols), dtype=torch.float32).t()


@torch.library.custom_op("fp8plug::cpu_cast_tiles", mutates_args=())
def _cpu_cast_tiles(t: torch.Tensor, kind: str, power_of_two: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """_cast_tiles with both results row-major: the emulation reads any layout, and an operator's
    output layout is a contract with the graphs inductor caches, which it keys on the operator's
    name, not on its fake (a cached graph asserts the strides it was compiled with); changing it
    needs a new name."""
    data, inv = _cast_tiles(t, kind, power_of_two)
    return data, inv.contiguous()


@_cpu_cast_tiles.register_fake
def _(t, kind, power_of_two):
    rows, cols = t.shape
    r, c = _tile(kind, rows, cols)
    return t.new_empty((rows, cols), dtype=E4M3), t.new_empty((-(-rows // r), -(-cols // c)), dtype=torch.float32)


def _gemm_layout(inv: torch.Tensor, kind: str) -> torch.Tensor:
    """Inverse scales [tile rows, tile columns] stored as the GEMM reads them, so that it copies
    nothing: 1x128 tiles' column-major (torch's blockwise GEMM takes them outer-dimension-major;
    made in the cast, a traced layout is part of the kernel that computes them, where a copy at
    the GEMM was a launch of its own), every other kind's row-major."""
    return inv.t().contiguous().t() if kind == TILE else inv.contiguous()


def tile_scale(amax: torch.Tensor, power_of_two: bool) -> torch.Tensor:
    """Each tile's scale from its amax: E4M3's max over it (scaling.scale_from_amax), floored to a
    power of two where `power_of_two`. The CUDA casts work the same rule out inside their kernels
    (transposed_cast's `tile_scale`, in these float32 steps); tests/gpu/test_transposed_cast.py
    holds them to these bytes, next to powers of two too."""
    scale = scale_from_amax(amax, FP8_MAX[E4M3])
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_two else scale


def _cast_tiles(t: torch.Tensor, kind: str, power_of_two: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    t = t.detach()
    rows, cols = t.shape
    r, c = _tile(kind, rows, cols)
    pad_r, pad_c = -rows % r, -cols % c
    padded = F.pad(t, (0, pad_c, 0, pad_r)) if pad_r or pad_c else t
    tiles = padded.reshape((rows + pad_r) // r, r, (cols + pad_c) // c, c)
    scale = tile_scale(tiles.abs().amax(dim=(1, 3)).float(), power_of_two)
    t_fp8 = quantize(tiles, scale[:, None, :, None], E4M3).reshape(rows + pad_r, cols + pad_c)
    if pad_r or pad_c:
        t_fp8 = t_fp8[:rows, :cols]
    # row-major whatever t's layout (a transposed input's view keeps its strides through the
    # element-wise ops): the GEMM reads each operand K-contiguous
    return t_fp8.contiguous(), _gemm_layout(scale.reciprocal(), kind)


# _cast_tiles as one operator whose kernel is its torch ops (backends.native.cast's per_tensor_cast says why)
torch.library.define("fp8plug::tile_cast", "(Tensor t, str kind, bool power_of_two) -> (Tensor, Tensor)")
torch.library.impl("fp8plug::tile_cast", "CompositeImplicitAutograd")(_cast_tiles)


def dequantize(t_fp8: torch.Tensor, inv: torch.Tensor, kind: str) -> torch.Tensor:
    """The real values an FP8 operand and its per-tile inverse scales stand for, in float32."""
    rows, cols = t_fp8.shape
    return fp8_to_float(t_fp8) * expand_scales(inv, kind, rows, cols)


# --- one GEMM ------------------------------------------------------------------------------------------


def granular_mm(a, a_inv, a_kind: str, b, b_inv, b_kind: str, out_dtype: torch.dtype) -> torch.Tensor:
    """A [M, K] @ B [N, K].T from FP8 operands (both K-contiguous) and their per-tile inverse
    scales: torch's FP8 GEMM on a GPU, its emulation (dequantise, one float32 GEMM) on the CPU."""
    if emulates(a.device):
        return _emulated_granular_mm(a, a_inv, a_kind, b, b_inv, b_kind, out_dtype)
    if a_kind in (ROW, TENSOR):  # rowwise: [M, 1] and [1, N] float32 scales, bf16 output (torch's rule)
        sa = a_inv.expand(a.shape[0], 1).contiguous()
        sb = b_inv.expand(b.shape[0], 1).reshape(1, -1).contiguous()
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)
        return out.to(out_dtype)
    return _blockwise_mm(a, a_inv, b, b_inv, b_kind == SQUARE).to(out_dtype)


@torch.library.custom_op("fp8plug::blockwise_mm", mutates_args=())
def _blockwise_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
                  b_square: bool) -> torch.Tensor:
    """torch's blockwise-scaled FP8 GEMM (1x128 tiles of A; 128x128 blocks or 1x128 tiles of B),
    in bf16 as torchao asks of it. One operator torch.compile calls as it is: dynamo in torch
    2.11 cannot trace `torch._scaled_mm_v2`, which F.scaled_mm calls."""
    kinds = F.ScalingType
    a, b = a.contiguous(), b.contiguous()  # row-major whatever strides the compiler gave (a no-op eagerly)
    sa = _gemm_layout(a_inv, TILE)  # [M, K/128], outer-dimension-major (as the casts make it: no copy)
    if b_square:  # [K/128, N/128] K-major, K blocks padded to a multiple of 4 (16-byte columns)
        nb, kb = b_inv.shape
        sb = b_inv.contiguous()
        if kb % 4:
            sb = b_inv.new_ones(nb, -(-kb // 4) * 4)
            sb[:, :kb] = b_inv
        sb, recipe_b = sb.t(), kinds.BlockWise128x128
    else:
        sb, recipe_b = _gemm_layout(b_inv, TILE), kinds.BlockWise1x128
    return F.scaled_mm(a, b.t(), scale_a=sa, scale_recipe_a=kinds.BlockWise1x128, scale_b=sb,
                       scale_recipe_b=recipe_b, output_dtype=torch.bfloat16)


@_blockwise_mm.register_fake
def _(a, a_inv, b, b_inv, b_square):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("fp8plug::emulated_granular_mm", mutates_args=())
def _emulated_granular_mm(a: torch.Tensor, a_inv: torch.Tensor, a_kind: str, b: torch.Tensor, b_inv: torch.Tensor,
                          b_kind: str, out_dtype: torch.dtype) -> torch.Tensor:
    """The emulation, one operator that torch.compile calls as it is (as backends.gemm's): torch
    2.13's CPU inductor failed to generate code for the tile-wise dequantisation traced into it."""
    with float32_gemm():
        return torch.mm(dequantize(a, a_inv, a_kind), dequantize(b, b_inv, b_kind).t()).to(out_dtype)


@_emulated_granular_mm.register_fake
def _(a, a_inv, a_kind, b, b_inv, b_kind, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


# --- the linear ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GranularConfig:
    """What _GranularLinear needs besides tensors: the scaling word, the GEMMs' output dtype, and
    which GEMMs run in high precision (fprop, dgrad, wgrad: the recipe's override_linear_precision,
    and rowwise_with_gw_hp's wgrad). Frozen: a constant of a compiled graph."""

    scaling: str
    out_dtype: torch.dtype
    override: Tuple[bool, bool, bool]

    def high(self, gemm: int) -> bool:
        return self.override[gemm] or GEMMS[self.scaling][gemm] is None


def _fprop_operands(x: torch.Tensor, weight: torch.Tensor, config: GranularConfig, cast=None) -> list:
    """[x's FP8 cast, its scales, w's, its scales] for the forward GEMM; [] where it runs in high
    precision. `cast`: cast_tiles or another function computing the same."""
    cast = cast or cast_tiles
    if config.high(0):
        return []
    (xa, wb), pow2 = GEMMS[config.scaling][0], POWER_OF_TWO[config.scaling]
    return [*cast(x, xa, pow2), *cast(weight, wb, pow2)]


def _fprop_gemm(x: torch.Tensor, weight: torch.Tensor, operands: list, config: GranularConfig) -> torch.Tensor:
    if config.high(0):
        return F.linear(x.to(config.out_dtype), weight.to(config.out_dtype))
    (xa, wb) = GEMMS[config.scaling][0]
    x_fp8, x_inv, w_fp8, w_inv = operands
    return granular_mm(x_fp8, x_inv, xa, w_fp8, w_inv, wb, config.out_dtype)


def _backward_operands(x: torch.Tensor, weight: torch.Tensor, config: GranularConfig, need_x: bool, need_w: bool,
                       fprop: list, cast=None) -> list:
    """What backward reads: w.T cast along N (dgrad) and x.T cast along M (wgrad), each with its
    scales, or the high-precision tensor where that GEMM runs in high precision. A 128x128 block
    of w is the same block of w.T, so fprop's cast (`fprop`'s last two) is reused where there is one."""
    cast = cast or cast_tiles
    gemms, pow2 = GEMMS[config.scaling], POWER_OF_TWO[config.scaling]
    saved = []
    if need_x and not config.high(1):  # w.T [K, N] scaled along N
        kind = gemms[1][1]
        if kind == SQUARE:
            w_fp8, w_inv = fprop[2:] if fprop else cast(weight, SQUARE, pow2)
            saved += [w_fp8.t().contiguous(), w_inv.t().contiguous()]
        else:
            saved += list(cast(weight.t(), kind, pow2))
    if need_w and not config.high(2):  # x.T [K, M] scaled along M
        saved += list(cast(x.t(), gemms[2][1], pow2))
    if need_w and config.high(2):
        saved.append(x)
    if need_x and config.high(1):
        saved.append(weight)
    return saved


def _grad_operands(grad_out: torch.Tensor, config: GranularConfig, need_x: bool, need_w: bool, cast=None) -> list:
    """grad_output cast for dgrad (along N) and, transposed, for wgrad (along M), where those GEMMs run in FP8."""
    cast = cast or cast_tiles
    gemms, pow2 = GEMMS[config.scaling], POWER_OF_TWO[config.scaling]
    out = []
    if need_x and not config.high(1):
        out += list(cast(grad_out, gemms[1][0], pow2))
    if need_w and not config.high(2):
        out += list(cast(grad_out.t(), gemms[2][0], pow2))
    return out


def _backward_gemms(grad_out: torch.Tensor, grads: list, saved: list, config: GranularConfig, need_x: bool,
                    need_w: bool, x_dtype: torch.dtype, w_dtype: torch.dtype):
    """(grad_x or None, grad_w or None) from grad_output, `_grad_operands` and `_backward_operands`."""
    gemms = GEMMS[config.scaling]
    saved, grads = list(saved), list(grads)
    grad_x = grad_w = None
    if need_x:
        if config.high(1):
            weight = saved.pop()
            grad_x = grad_out.to(config.out_dtype) @ weight.to(config.out_dtype)
        else:
            (ga, wb), (g_fp8, g_inv), (w_t, w_t_inv) = gemms[1], grads[:2], saved[:2]
            grad_x = granular_mm(g_fp8, g_inv, ga, w_t, w_t_inv, wb, config.out_dtype)
            grads, saved = grads[2:], saved[2:]
        grad_x = grad_x.to(x_dtype)
    if need_w:
        if config.high(2):
            x = saved.pop()
            grad_w = grad_out.to(config.out_dtype).t() @ x.to(config.out_dtype)
        else:
            (ga, xb), (g_t_fp8, g_t_inv), (x_t, x_t_inv) = gemms[2], grads[:2], saved[:2]
            grad_w = granular_mm(g_t_fp8, g_t_inv, ga, x_t, x_t_inv, xb, config.out_dtype)
        grad_w = grad_w.to(w_dtype)
    return grad_x, grad_w


class _GranularLinear(torch.autograd.Function):
    """y = x @ w.T with per-row or per-tile FP8 scaling in all three GEMMs (module docstring), run
    eagerly: backward's FP8 operands are cast in forward and kept."""

    @staticmethod
    def forward(ctx, x, weight, config: GranularConfig):
        fprop = _fprop_operands(x, weight, config)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(*_backward_operands(x, weight, config, need_x, need_w, fprop))
        ctx.config = config
        ctx.dtypes = (x.dtype, weight.dtype)
        return _fprop_gemm(x, weight, fprop, config)

    @staticmethod
    def backward(ctx, grad_out):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads = _grad_operands(grad_out, ctx.config, need_x, need_w)
        grad_x, grad_w = _backward_gemms(grad_out, grads, ctx.saved_tensors, ctx.config, need_x, need_w, *ctx.dtypes)
        return grad_x, grad_w, None


# Compiled: the GEMMs are two operators (backends.native.compiled_ops says why); the casts stay
# outside them, traced, where the compiler fuses them (forward's in the forward graph, grad_output's
# in the backward graph, through the autograd formula): `_traced_cast`.
def _config(scaling: str, out_dtype: torch.dtype, override: List[bool]) -> GranularConfig:
    return GranularConfig(scaling, out_dtype, tuple(override))


@torch.library.custom_op("fp8plug::granular_linear", mutates_args=())
def _granular_op(x: torch.Tensor, weight: torch.Tensor, fprop: List[torch.Tensor], saved: List[torch.Tensor],
                 scaling: str, out_dtype: torch.dtype, override: List[bool]) -> torch.Tensor:
    return _fprop_gemm(x, weight, fprop, _config(scaling, out_dtype, override)).contiguous()


@_granular_op.register_fake
def _(x, weight, fprop, saved, scaling, out_dtype, override):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("fp8plug::granular_linear_backward", mutates_args=())
def _granular_op_backward(grad_out: torch.Tensor, grads: List[torch.Tensor], saved: List[torch.Tensor],
                          x_shape: List[int], x_dtype: torch.dtype, w_dtype: torch.dtype, scaling: str,
                          out_dtype: torch.dtype, override: List[bool], need_x: bool,
                          need_w: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_w = _backward_gemms(grad_out, grads, saved, _config(scaling, out_dtype, override), need_x, need_w,
                                     x_dtype, w_dtype)
    return (compiled_ops.or_absent(grad_x, grad_out.new_empty(0, dtype=x_dtype)),
            compiled_ops.or_absent(grad_w, grad_out.new_empty(0, dtype=w_dtype)))


@_granular_op_backward.register_fake
def _(grad_out, grads, saved, x_shape, x_dtype, w_dtype, scaling, out_dtype, override, need_x, need_w):
    return (grad_out.new_empty(tuple(x_shape) if need_x else (0,), dtype=x_dtype),
            grad_out.new_empty((grad_out.shape[1], x_shape[1]) if need_w else (0,), dtype=w_dtype))


def _granular_op_setup(ctx, inputs, output):
    x, weight, fprop, saved, scaling, out_dtype, override = inputs
    ctx.save_for_backward(*saved)
    ctx.lists = (len(fprop), len(saved))  # autograd wants a None per element of the list inputs
    ctx.args = (scaling, out_dtype, override)
    ctx.x = (list(x.shape), x.dtype, weight.dtype)


def _granular_op_autograd(ctx, grad_out):
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_out = grad_out.contiguous()
    grads = _grad_operands(grad_out, _config(*ctx.args), need_x, need_w, _traced_cast)
    x_shape, x_dtype, w_dtype = ctx.x
    out_dtype = ctx.args[1]
    grad_x, grad_w = _granular_op_backward(grad_out, grads, list(ctx.saved_tensors), x_shape, out_dtype, out_dtype,
                                           *ctx.args, need_x, need_w)
    # each gradient leaves the operator as its GEMM wrote it and is converted here, traced: the
    # compiler fuses the conversion into the kernels that read it (the sum of q, k and v's input
    # gradients, the weight gradient's accumulation), where inside the operator it was a copy
    # kernel of its own (4.7 ms a step on the benchmark Llama with float32 master weights, H200)
    grad_x, grad_w = grad_x.to(x_dtype), grad_w.to(w_dtype)
    no_grads = [[None] * n for n in ctx.lists]
    return compiled_ops.or_none(grad_x, need_x), compiled_ops.or_none(grad_w, need_w), *no_grads, None, None, None


_granular_op.register_autograd(_granular_op_autograd, setup_context=_granular_op_setup)


def granular_linear(x2: torch.Tensor, weight: torch.Tensor, scaling: str, out_dtype: torch.dtype,
                    override: Tuple[bool, bool, bool] = (False, False, False)) -> torch.Tensor:
    """x2 [M, K] @ weight.T with `scaling` (one of GRANULAR) in every GEMM, in `out_dtype`."""
    config = GranularConfig(scaling, out_dtype, tuple(override))
    if not compiled_ops.compiling():
        return _GranularLinear.apply(x2, weight, config)
    fprop = _fprop_operands(x2, weight, config, _traced_cast)
    grad = torch.is_grad_enabled()  # no backward operands for a forward under no_grad (eval)
    saved = _backward_operands(x2, weight, config, grad and x2.requires_grad, grad and weight.requires_grad, fprop,
                               _traced_cast)
    return _granular_op(x2, weight, fprop, saved, scaling, out_dtype, list(override))


def granular_forward(layer, x: torch.Tensor, out_dtype: torch.dtype, weight: torch.Tensor,
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A NativeFP8Linear's FP8 forward with its granular scaling (`layer.granular`), on x's
    tokens already padded (backends.padding, to `token_multiple`), with `weight` and `bias` (the
    layer's own, or this rank's shards of them under tensor parallelism)."""
    x2 = x.reshape(-1, x.shape[-1])
    out = granular_linear(x2, weight, layer.granular, out_dtype, layer.override_linear_precision)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])
