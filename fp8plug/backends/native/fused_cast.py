"""One-pass FP8 cast on CUDA: both layouts and the amax from one read (delayed scaling), or from
two (dynamic scaling, whose scale needs the amax first).

An FP8 Linear needs each operand in FP8 as is and transposed (Hopper's FP8 GEMMs take the reduced
dimension contiguous on both sides). With delayed scaling the scale is known before the tensor is
read, so one pass can cast, write both layouts and find the next step's amax, as
TransformerEngine's cast-transpose does; the first-step fallback is decided on the GPU. The native
engine uses it eagerly on CUDA; compiled, on the CPU or without Triton it casts with torch ops
(fp8plug.backends.native.scaling), which give the same bytes. Measured against TransformerEngine's cast:
docs/results/h100/2026-11-23-cast-launches/ (bench_eager_rounds.json, fused_cast_tiles.json).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from fp8plug.backends.native.scaling import FP8_MAX, SCALE_MAX

# The cast-transpose kernel's tile (rows, columns) and warps; whether 16-bit input is transposed in
# registers (tl.trans) rather than loaded a second time in transposed order (float32 input always
# is: tl.trans gave wrong tiles for it on an H100 with Triton 3.6). Both picked by
# benchmarks/linear/fused_cast_tiles.py.
TILE = (64, 256, 8)
TRANSPOSE_16BIT_IN_REGISTERS = True
# The first-step amax pass: elements per block, and at most this many programs, each walking
# blocks a grid's width apart, so that once the slot is scaled the pass is a handful of programs
# that return at once.
_AMAX_BLOCK = 8192
_AMAX_PROGRAMS = 1024


# Whether load() built the op: None until it has run, then a plain bool that torch.compile reads
# as a constant.
_READY = None


def load() -> bool:
    """Build the custom op once per process where it can run (CUDA, Triton, torch's
    triton_op); whether it is there. Called when a delayed-scaling layer is set up, outside
    torch.compile, so that the compiled forward only reads a flag."""
    global _READY
    if _READY is None:
        _READY = _can_build()
        if _READY:
            _build()
    return _READY


def usable(t: torch.Tensor) -> bool:
    """Whether the fused cast runs on `t`: a 2-D CUDA tensor, the op built, and no torch.compile
    tracing. Under torch.compile the torch-op cast is kept: the compiler fuses it into the kernel
    that makes the tensor (a norm, an activation), and on a whole Hugging Face Llama that was
    faster and 2.3 GB lighter than this op
    (docs/results/h100/2026-11-23-cast-launches/hf_llama_delayed_fused_compiled.json)."""
    return bool(_READY) and t.is_cuda and t.dim() == 2 and not torch.compiler.is_compiling()


def cast_transpose(t: torch.Tensor, prev_scale: torch.Tensor, use_prev: torch.Tensor, dtype: torch.dtype,
                   margin: int) -> Tuple[torch.Tensor, ...]:
    """(t in FP8, its transpose in FP8 and contiguous, the scale used, max |t|, 1 / scale) for a
    delayed slot, the scale as scaling.delayed_scale gives it, as in NativeFP8Linear's torch path
    (1 / scale as torch's reciprocal gives it: the factor the GEMM takes, written by the kernel
    rather than by one more launch). max |t| is NaN if t holds a NaN. Needs `usable(t)`."""
    return torch.ops.fp8plug.cast_transpose(t.contiguous(), prev_scale.reshape(1).float(), use_prev.reshape(1),
                                            dtype, margin, False)


# Per device, the (scale, flag) of a slot that has never been scaled: a dynamic cast is the first
# step of a delayed one, every time (the scale from the tensor's own amax), made once so that a
# cast adds no launch to fill them.
_NEVER_SCALED = {}


def cast_transpose_dynamic(t: torch.Tensor, dtype: torch.dtype,
                           amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, ...]:
    """cast_transpose for dynamic scaling: the scale is scaling.scale_from_amax of t's own amax
    (no margin, as the torch path's dynamic cast). Two passes over t (the amax, then the cast of
    both layouts) in three launches, where torch ops take one launch an op; one pass where the
    kernel that made t found its amax already (`amax`, a float32 scalar, inf where t holds a NaN:
    backends.native.fused_norm). The amax returned is that amax: a dynamic slot keeps no history, so
    the cast's per-tile maxima are not reduced again."""
    flags = _NEVER_SCALED.get(t.device)
    if flags is None:
        flags = _NEVER_SCALED[t.device] = (torch.ones(1, device=t.device),
                                           torch.zeros(1, dtype=torch.bool, device=t.device))
    return torch.ops.fp8plug.cast_transpose(t.contiguous(), flags[0], flags[1], dtype, 0, True, amax)


def triton_on_cuda() -> bool:
    """Whether Triton kernels can be built and launched here: a CUDA GPU and Triton installed.
    The one check for this module's kernels and backends.native.fused_norm's."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _can_build() -> bool:
    return hasattr(torch.library, "triton_op") and triton_on_cuda()


def _build():
    """Define the two Triton kernels and register the op (torch.ops.fp8plug.cast_transpose).

    Four launches a cast, whatever the slot's state: zeroing the first-step amax, the amax pass
    (which returns at once once the slot is scaled), the cast, which works out the scale and its
    inverse itself, and the reduction of its per-tile amaxes (not for a dynamic cast, whose amax
    the amax pass found), and one launch for a dynamic cast whose amax is known already. Working
    the scale out with torch ops took about ten
    more tiny launches a cast, each a gap in the GPU's queue."""
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    @triton.jit
    def amax_unless_scaled(x_ptr, numel, use_prev_ptr, amax_ptr, BLOCK: tl.constexpr):
        """max |x| into amax_ptr (an atomic max; NaN counts as inf, and both give the fallback
        scale), unless the slot is scaled already: then nothing is read."""
        if tl.load(use_prev_ptr) != 0:
            return
        running = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, tl.num_programs(0) * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            a = tl.abs(tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32))
            running = tl.maximum(running, tl.where(a != a, float("inf"), a))
        tl.atomic_max(amax_ptr, tl.max(running, axis=0))

    @triton.jit
    def cast_both_layouts(x_ptr, prev_ptr, use_prev_ptr, amax_ptr, scale_ptr, inv_ptr, y_ptr, yt_ptr, partial_ptr, M, N,
                          FP8_LIMIT: tl.constexpr, INV_MARGIN: tl.constexpr, MAX_SCALE: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, TRANSPOSE_IN_REGISTERS: tl.constexpr):
        """y = saturate(x * scale) in FP8, written row-major and transposed; per-tile max |x|;
        the first program also writes the scale and its inverse."""
        pm, pn = tl.program_id(0), tl.program_id(1)
        # scaling.delayed_scale, in torch's float32 steps (reciprocal, times fp8_max, times
        # 2**-margin, clamp; 1 where the amax is 0 or not finite), so the bytes match
        amax = tl.load(amax_ptr)
        fresh = tl.minimum(tl.math.div_rn(tl.full((), 1.0, tl.float32), amax) * FP8_LIMIT * INV_MARGIN, MAX_SCALE)
        fresh = tl.where((amax > 0) & (amax < float("inf")), fresh, 1.0)
        scale = tl.where(tl.load(use_prev_ptr) != 0, tl.load(prev_ptr), fresh).to(tl.float32)
        if (pm == 0) & (pn == 0):
            tl.store(scale_ptr, scale)
            tl.store(inv_ptr, tl.math.div_rn(tl.full((), 1.0, tl.float32), scale))  # torch's reciprocal
        rows = pm.to(tl.int64) * BM + tl.arange(0, BM)
        cols = pn.to(tl.int64) * BN + tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
        # scaling.quantize's rule: finite values clamped to the range, inf and NaN made NaN
        s = x.to(tl.float32) * scale
        y = tl.where((s == s) & (tl.abs(s) < float("inf")), tl.clamp(s, -FP8_LIMIT, FP8_LIMIT), float("nan"))
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], y, mask=mask)
        mask_t = (cols[:, None] < N) & (rows[None, :] < M)
        if TRANSPOSE_IN_REGISTERS:
            x_t = tl.trans(x)
        else:  # loaded again in its own order (the tile is in cache by now)
            x_t = tl.load(x_ptr + rows[None, :] * N + cols[:, None], mask=mask_t, other=0.0)
        s_t = x_t.to(tl.float32) * scale
        y_t = tl.where((s_t == s_t) & (tl.abs(s_t) < float("inf")), tl.clamp(s_t, -FP8_LIMIT, FP8_LIMIT), float("nan"))
        y_t = y_t.to(yt_ptr.dtype.element_ty)
        tl.store(yt_ptr + cols[:, None] * M + rows[None, :], y_t, mask=mask_t)
        a = tl.abs(x.to(tl.float32))
        nan = tl.max(tl.max((a != a).to(tl.int32), axis=1), axis=0)
        tile_max = tl.max(tl.max(a, axis=1), axis=0)
        tl.store(partial_ptr + pm * tl.num_programs(1) + pn, tl.where(nan > 0, float("nan"), tile_max))

    @triton_op("fp8plug::cast_transpose", mutates_args={})
    def op(x: torch.Tensor, prev_scale: torch.Tensor, use_prev: torch.Tensor, dtype: torch.dtype,
           margin: int, dynamic: bool, known_amax: Optional[torch.Tensor] = None,
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        m, n = x.shape
        if known_amax is not None:  # found by the kernel that made x: no amax pass
            first_amax = known_amax.reshape(()).float()
        else:
            first_amax = torch.zeros((), device=x.device, dtype=torch.float32)
            programs = max(1, min(triton.cdiv(x.numel(), _AMAX_BLOCK), _AMAX_PROGRAMS))
            wrap_triton(amax_unless_scaled)[(programs,)](x, x.numel(), use_prev, first_amax, BLOCK=_AMAX_BLOCK,
                                                        num_warps=8)
        scale = torch.empty((), device=x.device, dtype=torch.float32)
        inv = torch.empty((), device=x.device, dtype=torch.float32)
        y = torch.empty((m, n), device=x.device, dtype=dtype)
        yt = torch.empty((n, m), device=x.device, dtype=dtype)
        bm, bn, warps = TILE
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        tiles = torch.empty(grid[0] * grid[1], device=x.device, dtype=torch.float32)
        in_registers = TRANSPOSE_16BIT_IN_REGISTERS and x.element_size() == 2
        wrap_triton(cast_both_layouts)[grid](x, prev_scale, use_prev, first_amax, scale, inv, y, yt, tiles, m, n,
                                             FP8_LIMIT=FP8_MAX[dtype], INV_MARGIN=2.0**-margin, MAX_SCALE=SCALE_MAX,
                                             BM=bm, BN=bn, TRANSPOSE_IN_REGISTERS=in_registers, num_warps=warps)
        # dynamic: the amax pass's result is t's amax (never NaN: inf instead); no reduction launch.
        # A given amax is copied: a custom op's output may not be one of its inputs.
        amax = tiles.amax() if not dynamic else first_amax if known_amax is None else first_amax.clone()
        return y, yt, scale, amax, inv

    return op
