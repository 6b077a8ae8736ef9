"""FP8 casts scaled along rows and written as they are (one scale per row, per 1x128 tile, per
128x128 block or per tensor), on CUDA, in two Triton passes: the eager form of the finer scalings'
casts (backends.native.granular).

Why: eagerly, the torch ops of such a cast (abs, the tile maxima, the scale, the multiply, the
clamp, the conversion) each read and write the whole tensor; on the benchmark Llama (one H200)
eager rowwise and blockwise training ran at 0.84x and 0.76x bf16 eager while per-tensor scaling,
whose cast is one kernel (backends.native.fused_cast), ran at 1.39x. Compiled, the torch ops are
kept: the compiler fuses them into the kernel that makes the tensor.

Pass one reads the tensor once and writes each tile's amax (NaN read as inf, which gives the
scale the torch ops give a NaN amax); pass two works each tile's scale out from its amax by
granular.tile_scale's rule in its float32 steps (transposed_cast's `tile_scale`, so the bytes are
the torch path's), writes the inverse scales, reads the tensor again, scales, saturates, casts
(non-finite values NaN: scaling.quantize's rule) and writes it.
Checked byte for byte against the torch ops on a GPU (tests/gpu/test_transposed_cast.py).
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch

from fp8plug.backends.native import transposed_cast
from fp8plug.backends.native.scaling import E4M3, FP8_MAX, SCALE_MAX

# rows and columns one program reads at a time, and its warps (both passes)
BLOCK_ROWS, BLOCK_COLS, WARPS = 32, 128, 4

def usable(t: torch.Tensor) -> bool:
    """Whether these kernels run for `t`: a row-major 2-D CUDA tensor where Triton runs, and no
    torch.compile tracing (compiled, the torch ops fuse with their producer)."""
    return (t.dim() == 2 and t.stride(-1) == 1 and transposed_cast.usable(t)
            and not torch.compiler.is_compiling())


@functools.cache
def _kernels():
    """The two kernels, built on first use (Triton is imported only where they run)."""
    import triton
    import triton.language as tl

    @triton.jit
    def tile_amax(x_ptr, amax_ptr, n_rows, n_cols, x_row, tile_rows, tile_cols, n_tile_cols,
                  ONE_ROW: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """amax[r // tile_rows, c // tile_cols] = max |x| over the tile (NaN read as inf). A
        program reads BR rows of one column tile, walking its columns; with one row a tile
        (ONE_ROW) it writes each row's maximum, else it folds the BR rows' into the tile's with an
        atomic max (BR divides tile_rows, so its rows share a tile)."""
        pr, pc = tl.program_id(0), tl.program_id(1)
        rows = pr.to(tl.int64) * BR + tl.arange(0, BR)
        first = pc.to(tl.int64) * tile_cols
        last = tl.minimum(first + tile_cols, n_cols)
        running = tl.zeros((BR,), dtype=tl.float32)
        for start in range(first, last, BC):
            cols = start + tl.arange(0, BC)
            x = tl.load(x_ptr + rows[:, None] * x_row + cols[None, :],
                        mask=(rows[:, None] < n_rows) & (cols[None, :] < last), other=0.0)
            a = tl.abs(x.to(tl.float32))
            running = tl.maximum(running, tl.max(tl.where(a != a, float("inf"), a), axis=1))
        if ONE_ROW:
            tl.store(amax_ptr + rows * n_tile_cols + pc, running, mask=rows < n_rows)
        else:
            tile_row = (pr.to(tl.int64) * BR) // tile_rows
            tl.atomic_max(amax_ptr + tile_row * n_tile_cols + pc, tl.max(running, axis=0))

    shared = transposed_cast._kernels()  # the scale rule and the quantisation, written once there
    tile_scale, quantize = shared["tile_scale"], shared["quantize"]

    @triton.jit
    def cast_tiles(x_ptr, scale_ptr, inv_ptr, y_ptr, n_rows, n_cols, x_row, tile_rows, tile_cols, n_tile_cols,
                   inv_row, inv_col, FP8_LIMIT: tl.constexpr, FROM_AMAX: tl.constexpr, MAX_SCALE: tl.constexpr,
                   POWER_OF_TWO: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """y[r, c] = fp8(x[r, c] * scale[r // tile_rows, c // tile_cols]): finite values
        saturated, inf and NaN made NaN (scaling.quantize's rule). FROM_AMAX: `scale_ptr` holds the
        tiles' amaxes, the scales are tile_scale's, and the program at a tile's first column writes
        the inverse scales of the tiles its rows start, `inv_row` and `inv_col` apart; a program's
        BC columns lie in one tile (tile_cols is a multiple of BC or spans every column)."""
        pr, pc = tl.program_id(0), tl.program_id(1)
        rows = pr.to(tl.int64) * BR + tl.arange(0, BR)
        cols = pc.to(tl.int64) * BC + tl.arange(0, BC)
        inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        x = tl.load(x_ptr + rows[:, None] * x_row + cols[None, :], mask=inside, other=0.0)
        if FROM_AMAX:
            tile_row, tile_col = rows // tile_rows, (pc.to(tl.int64) * BC) // tile_cols
            scale = tile_scale(tl.load(scale_ptr + tile_row * n_tile_cols + tile_col, mask=rows < n_rows, other=1.0),
                               FP8_LIMIT, MAX_SCALE, POWER_OF_TWO)
            if (pc * BC) % tile_cols == 0:
                tl.store(inv_ptr + tile_row * inv_row + tile_col * inv_col,
                         tl.math.div_rn(tl.full((BR,), 1.0, tl.float32), scale),
                         mask=(rows < n_rows) & (rows % tile_rows == 0))
            s = scale[:, None]
        else:
            s = tl.load(scale_ptr + (rows // tile_rows)[:, None] * n_tile_cols + (cols // tile_cols)[None, :],
                        mask=inside, other=1.0)
        y = quantize(x, s, FP8_LIMIT)
        tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(tl.uint8, bitcast=True), mask=inside)

    return dict(triton=triton, tile_amax=tile_amax, cast_tiles=cast_tiles)


def cast(t: torch.Tensor, tile: Tuple[int, int], power_of_two: bool,
         columns_major: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(`t` [R, C] in E4M3, row-major; the float32 inverse scales [ceil(R/r), ceil(C/c)], stored
    column-major where `columns_major`): each tile of `tile` = (r, c) rows x columns scaled by
    granular.tile_scale of its amax (floored to a power of two where `power_of_two`), worked out
    in the cast kernel. r is 1, a multiple of BLOCK_ROWS, or R (one scale for the rows); c a
    multiple of BLOCK_COLS or C."""
    k = _kernels()
    rows, cols = t.shape
    r, c = tile
    if r != 1 and r % BLOCK_ROWS and r < rows:
        raise ValueError(f"tile_cast: tile rows {r} must be 1, the row count or a multiple of {BLOCK_ROWS}")
    r, c = min(r, rows) if r != 1 else 1, max(1, min(c, cols))
    if c % BLOCK_COLS and c != cols:
        raise ValueError(f"tile_cast: tile columns {c} must be a multiple of {BLOCK_COLS} or the column count")
    tiles = (-(-rows // r), -(-cols // c))
    amax = torch.zeros(tiles, device=t.device, dtype=torch.float32)
    grid = (k["triton"].cdiv(rows, BLOCK_ROWS), tiles[1])
    k["tile_amax"][grid](t, amax, rows, cols, t.stride(0), r, c, tiles[1], ONE_ROW=r == 1, BR=BLOCK_ROWS,
                         BC=BLOCK_COLS, num_warps=WARPS)
    inv = torch.empty(tiles[::-1], device=t.device, dtype=torch.float32).t() if columns_major else amax.new_empty(tiles)
    y = torch.empty((rows, cols), device=t.device, dtype=E4M3)
    grid = (k["triton"].cdiv(rows, BLOCK_ROWS), k["triton"].cdiv(cols, BLOCK_COLS))
    k["cast_tiles"][grid](t, amax, inv, y.view(torch.uint8), rows, cols, t.stride(0), r, c, tiles[1], *inv.stride(),
                          FP8_LIMIT=FP8_MAX[E4M3], FROM_AMAX=True, MAX_SCALE=SCALE_MAX, POWER_OF_TWO=power_of_two,
                          BR=BLOCK_ROWS, BC=BLOCK_COLS, num_warps=WARPS)
    return y, inv


def cast_scaled(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`t` [R, C] in E4M3 with one scale known already (a float32 scalar): scaling.quantize's
    bytes in one pass, where its torch ops take five launches, each reading the whole tensor."""
    k = _kernels()
    rows, cols = t.shape
    y = torch.empty((rows, cols), device=t.device, dtype=E4M3)
    grid = (k["triton"].cdiv(rows, BLOCK_ROWS), k["triton"].cdiv(cols, BLOCK_COLS))
    scale = scale.reshape(1).float()
    k["cast_tiles"][grid](t, scale, scale, y.view(torch.uint8), rows, cols, t.stride(0), max(rows, 1),
                          max(cols, 1), 1, 0, 0, FP8_LIMIT=FP8_MAX[E4M3], FROM_AMAX=False, MAX_SCALE=SCALE_MAX,
                          POWER_OF_TWO=False, BR=BLOCK_ROWS, BC=BLOCK_COLS, num_warps=WARPS)
    return y


__all__ = ["cast", "cast_scaled", "usable"]
