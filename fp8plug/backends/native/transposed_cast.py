"""FP8 casts that scale along a tensor's rows and write it transposed, on CUDA, in one or two passes.

Why: a GEMM's operand is scaled along that GEMM's reduction dimension and read with it contiguous.
The weight gradient reduces over the tokens, so the input and the output gradient [tokens, C] are
needed transposed, [C, tokens], with one scale per column of the original (over all its rows:
rowwise; over each 128 rows: blockwise's 1x128 tiles; over each expert's rows: the grouped weight
gradient), and so is the weight for the input gradient. Traced torch ops make of that a column
reduction and a transposed write that the compiler schedules poorly: on the benchmark Llama
(one H200, compiled) these casts took 0.5 ms for a [8192, 14336] gradient, about six times what
reading it twice and writing it once costs, and the MoE experts' padded copies and casts cost
more than their FP8 GEMMs saved (docs/performance.md, "Where the time goes").

Here: pass one walks the tensor in row tiles, a program down a band of columns, keeps the
elementwise maximum of its tiles and reduces it across rows once, into one atomic max a column
and segment (reduced per tile, through shared memory, the pass read a Mixtral gradient at a
sixth of the bandwidth); the scales are then worked out from the amaxes, by the caller's own
torch ops or, for the granular layers' rule (`tile_scale`), in pass two itself; pass two reads
the tensor again, scales, casts, and writes the tile transposed. Rows can be gathered on the way
(`source`: a padded token layout's row map, -1 for a zero row), so the grouped GEMM's padding
costs no copy of its own; a leading batch dimension (an experts weight [E, N, K]) is one more
grid axis. Blockwise's 128-row segments take one pass (`segment_cast_transposed`): a program holds
a whole segment.

`rows_cast` is the grouped GEMM's token cast with that gather (and its weights' forward cast,
without): one scale per row, written as is.

Segments of rows that share a column scale: ALL_ROWS (one), TILES_128 (128 rows each) or GROUPS
(`segment`: each row's group, groups 16-row aligned). On the CPU, and without Triton, callers
keep their torch ops; `usable` says which. Checked against them on a GPU (tests/gpu).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from fp8plug.backends.native.scaling import E4M3, FP8_MAX, SCALE_MAX

ALL_ROWS, TILES_128, GROUPS = 0, 1, 2
SEGMENT_ROWS = 128  # TILES_128's rows per segment
GROUP_ROWS = 16  # GROUPS: every group starts at a multiple of this many rows
# Tiles: (rows, columns, warps) of the amax pass and of the cast; the cast's rows divide
# SEGMENT_ROWS, so a tile of it lies in one 128-row segment.
# The amax pass's tile: 16 rows x 128 columns on 2 warps took 0.74-0.81x the time of 32 x 128 on 4
# for Mixtral's gathered token rows and 0.78-0.89x over whole columns of the benchmark Llama's
# activations, gradients and weights (one H200, GPU time; benchmarks/moe/token_casts.py,
# benchmarks/linear/transposed_cast_passes.py).
AMAX_TILE = (16, 128, 2)
# rows one amax program walks (ALL_ROWS, GROUPS; TILES_128: one segment, the same). The pass waits
# on each tile's load in turn, so short walks in many programs keep more loads in flight: walking
# 128 rows rather than 512 (in 64-row tiles) took 0.60-0.69x the time for Mixtral's gathered token
# rows (one H200, benchmarks/moe/token_casts.py), with four times the atomics; over whole columns of
# [8192, C] activations it took 0.88-1.07x.
AMAX_ROWS_PER_PROGRAM = 128
CAST_TILE = (64, 128, 4)
GROUPS_CAST_TILE = (64, 128, 8)  # GROUPS' gathered token rows: 0.84-0.87x CAST_TILE's time (Mixtral, H200)
# columns and warps of the one-pass TILES_128 cast (a program: 128 rows); 2 warps took 0.84-0.90x
# the time of 4 on the benchmark Llama's [8192, 4096] and [8192, 14336] (one H200, GPU time)
SEGMENT_CAST_TILE = (64, 2)
ROWS_TILE = (8, 512, 4)
# rows_cast reads rows of up to ONE_READ_MAX elements (padded to a power of two) once: a program
# holds whole rows, at least ONE_READ_MIN elements, 64 a thread; longer rows are walked twice
# (ROWS_TILE). On an H200, Mixtral's token rows (4096, 14336 and 28672 wide, bf16) cast in 0.60,
# 0.60 and 0.76 of the time two walks took, and its gate_up weight in 0.67 of the compiled cast's
# (benchmarks/moe/token_casts.py).
ONE_READ_MIN, ONE_READ_MAX = 8192, 32768
TRANSPOSE_TILE = (64, 128, 4)  # rows, columns, warps of transposed()

_KERNELS = None
# Whether Triton can run here: None until load() has looked, then a plain bool that torch.compile
# reads as a constant (load() runs when a layer is built, outside any trace).
_READY = None


def load() -> bool:
    """Look once per process whether the kernels can run here (CUDA and Triton: the one check of
    backends.native.fused_cast); whether they can."""
    global _READY
    if _READY is None:
        from fp8plug.backends.native.fused_cast import triton_on_cuda

        _READY = triton_on_cuda()
    return _READY


def usable(t: torch.Tensor) -> bool:
    """Whether these kernels run for `t`: a CUDA tensor where Triton runs."""
    return t.is_cuda and (_READY if _READY is not None else load())


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _build()
    return _KERNELS


def _build():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def tile_scale(amax, FP8_LIMIT: tl.constexpr, MAX_SCALE: tl.constexpr, POWER_OF_TWO: tl.constexpr):
        """granular.tile_scale in its float32 steps, so the bytes are its torch ops': E4M3's max
        over the amax (torch's reciprocal, then the product), at most MAX_SCALE, 1 where the amax
        is 0 or not finite; floored to a power of two by libdevice's log2, floor and exp2, the
        functions torch's own CUDA kernels call. Worked out here rather than by those torch ops
        between the passes: they were a dozen launches a cast, and a compiled rowwise step of the
        benchmark Llama issued 1,237 kernels (565 without them) and ran 1.36x bf16 (1.38x without;
        one H200, docs/performance.md)."""
        scale = tl.minimum(tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax) * FP8_LIMIT, MAX_SCALE)
        scale = tl.where((amax > 0) & (amax < float("inf")), scale, 1.0)
        if POWER_OF_TWO:
            scale = libdevice.exp2(libdevice.floor(libdevice.log2(scale)))
        return scale

    @triton.jit
    def read_rows(src_ptr, rows, n_rows, GATHER: tl.constexpr):
        """(the row of the tensor each of `rows` reads, whether it reads one): through the row map
        where GATHER (-1: a zero row), else the rows themselves."""
        if GATHER:
            src = tl.load(src_ptr + rows, mask=rows < n_rows, other=-1).to(tl.int64)
            return src, (src >= 0) & (rows < n_rows)
        return rows, rows < n_rows

    @triton.jit
    def load_tile(x_ptr, src_ptr, rows, cols, n_rows, n_cols, x_row, GATHER: tl.constexpr):
        """The tile of `rows` x `cols` (zeros outside the tensor and for zero rows), as stored."""
        src, valid = read_rows(src_ptr, rows, n_rows, GATHER)
        return tl.load(x_ptr + src[:, None] * x_row + cols[None, :], mask=valid[:, None] & (cols[None, :] < n_cols),
                       other=0.0)

    @triton.jit
    def abs_nan_as_inf(x):
        """|x| in float32, NaN read as inf (so a column holding one gets an inf amax)."""
        a = tl.abs(x.to(tl.float32))
        return tl.where(a != a, float("inf"), a)

    @triton.jit
    def quantize(x, s, FP8_LIMIT: tl.constexpr):
        """x * s in e4m3: finite values saturated, inf and NaN made NaN (scaling.quantize's rule)."""
        scaled = x.to(tl.float32) * s
        finite = (scaled == scaled) & (tl.abs(scaled) < float("inf"))
        return tl.where(finite, tl.clamp(scaled, -FP8_LIMIT, FP8_LIMIT), float("nan")).to(tl.float8e4nv)

    @triton.jit
    def store_transposed(y_ptr, y, rows, cols, n_rows, n_cols):
        """y [rows, cols] of e4m3 written at y_ptr [C, R] transposed, in registers as 16-bit lanes
        (backends.native.fused_cast transposes 16-bit tiles)."""
        y_t = tl.trans(y.to(tl.uint8, bitcast=True).to(tl.uint16)).to(tl.uint8)
        tl.store(y_ptr + cols[:, None] * n_rows + rows[None, :], y_t,
                 mask=(cols[:, None] < n_cols) & (rows[None, :] < n_rows))

    @triton.jit
    def column_amax(x_ptr, src_ptr, seg_ptr, amax_ptr, n_rows, n_cols, x_batch, x_row, n_segments,
                    GATHER: tl.constexpr, SEGMENTS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                    STEPS: tl.constexpr, GR: tl.constexpr):
        """amax[b, segment, c] = max |x| over the segment's rows of column c (NaN read as inf). A
        program walks STEPS tiles of BR rows down its columns. Where its rows lie in one segment
        (always for ALL_ROWS and TILES_128, whose programs walk one 128-row segment; for GROUPS
        where no group starts inside them) it keeps an elementwise maximum of the tiles in
        registers and reduces it across rows once, at the end, into one atomic max a column: a
        reduction across rows is a trip through shared memory, which taken per tile (per 16 rows
        for GROUPS) held this pass to a sixth of the bandwidth. A GROUPS program that a group
        starts inside walks GR-row pieces (a group starts at a multiple of GR rows) and folds
        each group's maxima when the next one opens."""
        pr, pc, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        cols = pc.to(tl.int64) * BC + tl.arange(0, BC)
        first_row = pr.to(tl.int64) * (BR * STEPS)
        out = amax_ptr + b * n_segments * n_cols + cols
        x_base = x_ptr + b * x_batch
        if SEGMENTS == 2:  # the grid starts every program inside
            current = tl.load(seg_ptr + first_row).to(tl.int64)
            last = tl.load(seg_ptr + tl.minimum(first_row + BR * STEPS, n_rows) - 1).to(tl.int64)
        else:
            current = (first_row // 128) if SEGMENTS == 1 else first_row * 0
            last = current
        if current == last:
            acc = tl.zeros((BR, BC), dtype=tl.float32)
            for step in range(STEPS):
                rows = first_row + step * BR + tl.arange(0, BR)
                a = abs_nan_as_inf(load_tile(x_base, src_ptr, rows, cols, n_rows, n_cols, x_row, GATHER))
                acc = tl.maximum(acc, a)
            tl.atomic_max(out + current * n_cols, tl.max(acc, axis=0), mask=cols < n_cols)
        else:
            running = tl.zeros((BC,), dtype=tl.float32)
            for piece in range(STEPS * BR // GR):
                start = first_row + piece * GR
                if start < n_rows:
                    seg = tl.load(seg_ptr + start).to(tl.int64)
                    if seg != current:  # another group opens: the last one's maxima are complete
                        tl.atomic_max(out + current * n_cols, running, mask=cols < n_cols)
                        running = tl.zeros((BC,), dtype=tl.float32)
                        current = seg
                    rows = start + tl.arange(0, GR)
                    a = abs_nan_as_inf(load_tile(x_base, src_ptr, rows, cols, n_rows, n_cols, x_row, GATHER))
                    running = tl.maximum(running, tl.max(a, axis=0))
            tl.atomic_max(out + current * n_cols, running, mask=cols < n_cols)

    @triton.jit
    def cast_transposed(x_ptr, src_ptr, seg_ptr, scale_ptr, inv_ptr, y_ptr, n_rows, n_cols, x_batch, x_row,
                        n_segments, FP8_LIMIT: tl.constexpr, GATHER: tl.constexpr, SEGMENTS: tl.constexpr,
                        FROM_AMAX: tl.constexpr, MAX_SCALE: tl.constexpr, POWER_OF_TWO: tl.constexpr,
                        BR: tl.constexpr, BC: tl.constexpr):
        """y[b, c, r] = fp8(x[b, r, c] * scale[b, segment(r), c]): finite values saturated, inf and
        NaN made NaN (scaling.quantize's rule). FROM_AMAX (ALL_ROWS, TILES_128): `scale_ptr` holds
        the amaxes, the scale is tile_scale's, and the first program of each segment writes the
        inverse scales to `inv_ptr`."""
        pr, pc, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        rows = pr.to(tl.int64) * BR + tl.arange(0, BR)
        cols = pc.to(tl.int64) * BC + tl.arange(0, BC)
        in_cols = cols[None, :] < n_cols
        x = load_tile(x_ptr + b * x_batch, src_ptr, rows, cols, n_rows, n_cols, x_row, GATHER)
        scales = scale_ptr + b * n_segments * n_cols
        if SEGMENTS < 2:
            if SEGMENTS == 1:  # this program's 128-row segment, and whether the program is its first
                offset = ((pr * BR) // 128).to(tl.int64) * n_cols + cols
                starts = (pr * BR) % 128 == 0
            else:
                offset = cols
                starts = pr == 0
            s = tl.load(scales + offset, mask=cols < n_cols, other=1.0)
            if FROM_AMAX:
                s = tile_scale(s, FP8_LIMIT, MAX_SCALE, POWER_OF_TWO)
                if starts:
                    tl.store(inv_ptr + b * n_segments * n_cols + offset,
                             tl.math.div_rn(tl.full((BC,), 1.0, tl.float32), s), mask=cols < n_cols)
            s = s[None, :]
        else:
            seg = tl.load(seg_ptr + rows, mask=rows < n_rows, other=0).to(tl.int64)
            s = tl.load(scales + seg[:, None] * n_cols + cols[None, :], mask=(rows[:, None] < n_rows) & in_cols,
                        other=1.0)
        store_transposed(y_ptr + b * n_cols * n_rows, quantize(x, s, FP8_LIMIT), rows, cols, n_rows, n_cols)

    @triton.jit
    def segment_cast_transposed(x_ptr, inv_ptr, y_ptr, n_rows, n_cols, x_row, FP8_LIMIT: tl.constexpr,
                                MAX_SCALE: tl.constexpr, POWER_OF_TWO: tl.constexpr, BC: tl.constexpr):
        """TILES_128 in one pass, scales tile_scale's: a program holds one 128-row segment of BC
        columns, so it finds their amaxes (NaN read as inf) in registers, writes the inverse
        scales, and casts the tile it already holds: no amax pass, no second read."""
        pr, pc = tl.program_id(0), tl.program_id(1)
        rows = pr.to(tl.int64) * 128 + tl.arange(0, 128)
        cols = pc.to(tl.int64) * BC + tl.arange(0, BC)
        x = load_tile(x_ptr, x_ptr, rows, cols, n_rows, n_cols, x_row, False)
        s = tile_scale(tl.max(abs_nan_as_inf(x), axis=0), FP8_LIMIT, MAX_SCALE, POWER_OF_TWO)
        tl.store(inv_ptr + pr.to(tl.int64) * n_cols + cols, tl.math.div_rn(tl.full((BC,), 1.0, tl.float32), s),
                 mask=cols < n_cols)
        store_transposed(y_ptr, quantize(x, s[None, :], FP8_LIMIT), rows, cols, n_rows, n_cols)

    @triton.jit
    def row_scales(nan, amax, AMAX_FLOOR: tl.constexpr, FP8_LIMIT: tl.constexpr):
        """The scales of rows whose largest |value| besides NaN is `amax` and that hold `nan` > 0
        NaNs: FP8_LIMIT * (1 / max(amax, AMAX_FLOOR)) correctly rounded, NaN for a NaN row."""
        amax = tl.where(nan > 0, float("nan"), tl.maximum(amax, AMAX_FLOOR))
        return tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax) * FP8_LIMIT

    @triton.jit
    def row_amax_parts(x):
        """Per row of the tile `x`: (whether it holds a NaN, 1 or 0; its largest |value| besides NaN)."""
        a = tl.abs(x.to(tl.float32))
        return tl.max((a != a).to(tl.int32), axis=1), tl.max(tl.where(a != a, 0.0, a), axis=1)

    @triton.jit
    def store_rows(y_ptr, x, scale, rows, cols, n_rows, n_cols):
        """fp8(x * its row's scale) written at y_ptr [n_rows, n_cols], as grouped.rowwise's torch ops cast."""
        tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], (x.to(tl.float32) * scale[:, None]).to(tl.float8e4nv),
                 mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))

    @triton.jit
    def rows_cast(x_ptr, src_ptr, y_ptr, inv_ptr, n_rows, n_cols, x_row, AMAX_FLOOR: tl.constexpr,
                  FP8_LIMIT: tl.constexpr, GATHER: tl.constexpr, ONE_READ: tl.constexpr, BR: tl.constexpr,
                  BC: tl.constexpr):
        """y[r] = fp8(x[src(r)] * scale_r) (`row_scales`), inv[r] = 1 / scale_r; through the row
        map where GATHER (zero rows where it says -1). ONE_READ: BC holds a whole row, so each
        tile is read once and cast from registers; else a first walk along the rows finds their
        amaxes and a second reads them again to cast."""
        rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        if ONE_READ:
            cols = tl.arange(0, BC)
            x = load_tile(x_ptr, src_ptr, rows, cols, n_rows, n_cols, x_row, GATHER)
            nan, amax = row_amax_parts(x)
            scale = row_scales(nan, amax, AMAX_FLOOR, FP8_LIMIT)
            store_rows(y_ptr, x, scale, rows, cols, n_rows, n_cols)
        else:
            amax = tl.zeros((BR,), dtype=tl.float32)
            nan = tl.zeros((BR,), dtype=tl.int32)
            for start in range(0, n_cols, BC):
                cols = start + tl.arange(0, BC)
                tile_nan, tile_amax = row_amax_parts(load_tile(x_ptr, src_ptr, rows, cols, n_rows, n_cols, x_row,
                                                               GATHER))
                nan, amax = tl.maximum(nan, tile_nan), tl.maximum(amax, tile_amax)
            scale = row_scales(nan, amax, AMAX_FLOOR, FP8_LIMIT)
            for start in range(0, n_cols, BC):
                cols = start + tl.arange(0, BC)
                store_rows(y_ptr, load_tile(x_ptr, src_ptr, rows, cols, n_rows, n_cols, x_row, GATHER), scale, rows,
                           cols, n_rows, n_cols)
        tl.store(inv_ptr + rows, tl.math.div_rn(tl.full((BR,), 1.0, tl.float32), scale), mask=rows < n_rows)

    @triton.jit
    def transpose_bytes(x_ptr, y_ptr, n_rows, n_cols, BR: tl.constexpr, BC: tl.constexpr):
        """y[c, r] = x[r, c] for one-byte elements, a tile at a time (read and written in order)."""
        pr, pc = tl.program_id(0), tl.program_id(1)
        rows = pr.to(tl.int64) * BR + tl.arange(0, BR)
        cols = pc.to(tl.int64) * BC + tl.arange(0, BC)
        x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :],
                    mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
        tl.store(y_ptr + cols[:, None] * n_rows + rows[None, :], tl.trans(x),
                 mask=(cols[:, None] < n_cols) & (rows[None, :] < n_rows))

    return dict(triton=triton, column_amax=column_amax, cast_transposed=cast_transposed, rows_cast=rows_cast,
                transpose_bytes=transpose_bytes, tile_scale=tile_scale, quantize=quantize,
                segment_cast_transposed=segment_cast_transposed)


def _as_batched(t: torch.Tensor) -> Tuple[torch.Tensor, int, int, int]:
    """(t with a batch dimension, batches, its batch stride, its row stride); columns contiguous."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:
        return t, 1, 0, t.stride(0)
    return t, t.shape[0], t.stride(0), t.stride(1)


def column_amax(t: torch.Tensor, segments: int, n_segments: int, source: Optional[torch.Tensor] = None,
                segment: Optional[torch.Tensor] = None, n_rows: Optional[int] = None) -> torch.Tensor:
    """float32 [batch, n_segments, C] (batch 1 for a 2-D `t`): each segment's max |t| per column
    (inf where it holds a NaN or inf). `t`: [R, C] or [batch, R, C], columns contiguous; `source`:
    the row each of `n_rows` rows reads (-1: zero); `segment`: each row's group (GROUPS)."""
    k = _kernels()
    t, batch, x_batch, x_row = _as_batched(t)
    rows = n_rows if n_rows is not None else t.shape[-2]
    cols = t.shape[-1]
    amax = torch.zeros((batch, n_segments, cols), device=t.device, dtype=torch.float32)
    br, bc, warps = AMAX_TILE
    # rows a program walks: a 128-row segment (TILES_128), else AMAX_ROWS_PER_PROGRAM
    steps = SEGMENT_ROWS // br if segments == TILES_128 else AMAX_ROWS_PER_PROGRAM // br
    grid = (k["triton"].cdiv(rows, br * steps), k["triton"].cdiv(cols, bc), batch)
    k["column_amax"][grid](t, source if source is not None else t, segment if segment is not None else t, amax, rows,
                           cols, x_batch, x_row, n_segments, GATHER=source is not None, SEGMENTS=segments, BR=br,
                           BC=bc, STEPS=steps, GR=GROUP_ROWS, num_warps=warps)
    return amax


def cast_transposed(t: torch.Tensor, scale: torch.Tensor, segments: int, source: Optional[torch.Tensor] = None,
                    segment: Optional[torch.Tensor] = None, n_rows: Optional[int] = None) -> torch.Tensor:
    """e4m3 [C, R] (or [batch, C, R]), contiguous: `t` [R, C] (or [batch, R, C]) times `scale`
    [batch, n_segments, C] of each row's segment, saturated, non-finite values NaN, transposed.
    `source`, `segment`, `n_rows` as in column_amax."""
    return _cast_transposed(t, scale.contiguous(), None, segments, source, segment, n_rows)


def _cast_transposed(t, scale, power_of_two, segments, source=None, segment=None, n_rows=None):
    """cast_transposed's launch; with `power_of_two` a bool, `scale` holds the amaxes, the scales
    are tile_scale's, worked out in the kernel, and the inverse scales are returned too."""
    k = _kernels()
    squeeze = t.dim() == 2
    t, batch, x_batch, x_row = _as_batched(t)
    rows = n_rows if n_rows is not None else t.shape[-2]
    cols = t.shape[-1]
    y = torch.empty((batch, cols, rows), device=t.device, dtype=E4M3)
    from_amax = power_of_two is not None
    inv = torch.empty_like(scale) if from_amax else scale
    br, bc, warps = GROUPS_CAST_TILE if segments == GROUPS else CAST_TILE
    grid = (k["triton"].cdiv(rows, br), k["triton"].cdiv(cols, bc), batch)
    k["cast_transposed"][grid](t, source if source is not None else t, segment if segment is not None else t,
                               scale, inv, y.view(torch.uint8), rows, cols, x_batch, x_row, scale.shape[-2],
                               FP8_LIMIT=FP8_MAX[E4M3], GATHER=source is not None, SEGMENTS=segments,
                               FROM_AMAX=from_amax, MAX_SCALE=SCALE_MAX, POWER_OF_TWO=bool(power_of_two),
                               BR=br, BC=bc, num_warps=warps)
    y = y[0] if squeeze else y
    return (y, inv) if from_amax else y


def cast_columns(t: torch.Tensor, scale_of: Callable[[torch.Tensor], torch.Tensor], segments: int, n_segments: int,
                 source: Optional[torch.Tensor] = None, segment: Optional[torch.Tensor] = None,
                 n_rows: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both passes: (`t` cast per segment and column and written transposed, as cast_transposed
    gives it; the float32 scales [batch, n_segments, C]). `scale_of` makes the scales from the
    column maxima (column_amax's), in the caller's own arithmetic, so the bytes are its torch
    path's. `source`, `segment`, `n_rows` as in column_amax."""
    scale = scale_of(column_amax(t, segments, n_segments, source, segment, n_rows))
    return cast_transposed(t, scale, segments, source, segment, n_rows), scale


def tile_scaled_columns(t: torch.Tensor, power_of_two: bool, segments: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both passes with granular.tile_scale's scales, worked out in the cast kernel: (`t` [R, C]
    cast per column (ALL_ROWS) or per column and 128 rows (TILES_128) and written transposed; the
    float32 inverse scales [1, n_segments, C])."""
    if segments == ALL_ROWS:
        return _cast_transposed(t, column_amax(t, segments, 1), power_of_two, segments)
    if segments != TILES_128:
        raise ValueError(f"tile_scaled_columns: segments must be ALL_ROWS or TILES_128, not {segments}")
    k = _kernels()
    t = t if t.stride(-1) == 1 else t.contiguous()
    rows, cols = t.shape
    y = torch.empty((cols, rows), device=t.device, dtype=E4M3)
    inv = torch.empty((1, -(-rows // SEGMENT_ROWS), cols), device=t.device, dtype=torch.float32)
    bc, warps = SEGMENT_CAST_TILE
    k["segment_cast_transposed"][(k["triton"].cdiv(rows, SEGMENT_ROWS), k["triton"].cdiv(cols, bc))](
        t, inv, y.view(torch.uint8), rows, cols, t.stride(0), FP8_LIMIT=FP8_MAX[E4M3], MAX_SCALE=SCALE_MAX,
        POWER_OF_TWO=power_of_two, BC=bc, num_warps=warps)
    return y, inv


def rows_cast(t: torch.Tensor, amax_floor: float, source: Optional[torch.Tensor] = None,
              n_rows: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [n_rows, C] with one scale per row, the float32 inverse scales [n_rows]): row r is
    `t`'s row source[r] (zero where -1; without `source`, `t` [R, C] itself), scaled by E4M3's
    max over its amax (at least `amax_floor`): backends.native.grouped.rowwise's bytes, with the
    padding gather done on the way. Rows of up to ONE_READ_MAX elements are read once."""
    k = _kernels()
    if t.stride(-1) != 1:
        t = t.contiguous()
    rows, cols = (n_rows if source is not None else t.shape[0]), t.shape[1]
    y = torch.empty((rows, cols), device=t.device, dtype=E4M3)
    inv = torch.empty((rows,), device=t.device, dtype=torch.float32)
    whole = k["triton"].next_power_of_2(cols)
    one_read = whole <= ONE_READ_MAX
    held = max(whole, ONE_READ_MIN)
    br, bc, warps = (held // whole, whole, held // (64 * 32)) if one_read else ROWS_TILE
    k["rows_cast"][(k["triton"].cdiv(rows, br),)](
        t, source if source is not None else t, y, inv, rows, cols, t.stride(0), AMAX_FLOOR=amax_floor,
        FP8_LIMIT=FP8_MAX[E4M3], GATHER=source is not None, ONE_READ=one_read, BR=br, BC=bc, num_warps=warps)
    return y, inv


def transposed(t: torch.Tensor) -> torch.Tensor:
    """`t` [R, C] of one-byte elements (FP8) as a contiguous [C, R]: torch's copy of a transposed
    view runs a generic, unvectorized kernel at about an eighth of the bandwidth (0.23 ms for an
    8B model's 4096 x 14336 weight on an H200)."""
    k = _kernels()
    t = t.contiguous()
    rows, cols = t.shape
    y = torch.empty((cols, rows), device=t.device, dtype=t.dtype)
    br, bc, warps = TRANSPOSE_TILE
    k["transpose_bytes"][(k["triton"].cdiv(rows, br), k["triton"].cdiv(cols, bc))](
        t.view(torch.uint8), y.view(torch.uint8), rows, cols, BR=br, BC=bc, num_warps=warps)
    return y


__all__ = ["ALL_ROWS", "GROUPS", "TILES_128", "cast_columns", "cast_transposed", "column_amax", "load", "rows_cast",
           "tile_scaled_columns", "transposed", "usable"]
