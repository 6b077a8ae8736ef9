"""The FP8 GEMM itself, on any device: `torch._scaled_mm` where the hardware has FP8 matrix units,
an emulation on the CPU.

torch's CPU `_scaled_mm` takes oneDNN's reference kernel on some Xeons (hundreds of times bf16's
time). What it computes is simple: both operands dequantised to float32 and one float32 GEMM. The
emulation computes exactly that, to the bit (tests/cpu/test_fp8_gemm.py), reading FP8 into float32
with a few vectorised integer passes (`fp8_to_float`). `fp8_gemm_speed` times FP8 against bf16 in
milliseconds for `fp8plug env`. Measured: docs/performance.md, "FP8 on a CPU".

What an "x" figure means wherever fp8plug prints one (`fp8plug env`, `fp8plug bench`, the demo) is
written here once, `speedup`, beside the one sentence that says why a CPU's FP8 times are no speed-up
(`EMULATION_NOTE`): a CPU's bf16 runs fast or slowly by whether it has bf16 instructions, so the
ratio of an emulated FP8 time to it says something about the CPU, nothing about FP8.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

# shape of the GEMM `fp8_gemm_speed` times: the README demo's largest (tokens x dim x ffn)
PROBE_SHAPE = (512, 128, 512)
EMULATION_NOTE = ("FP8 GEMMs are emulated on a CPU (float32 arithmetic on FP8 values; a CPU has no FP8 matrix "
                  "units), so FP8 here checks numerics and code paths, not speed; these times are no FP8 speed-up")


def speedup(baseline: Optional[float], measured: Optional[float]) -> Optional[float]:
    """How many times faster than `baseline` (bf16's time) something ran in `measured` (same unit):
    baseline / measured, so bigger is faster and 1 is bf16's speed. The one meaning of the "x"
    figures fp8plug prints; None where either time is missing or zero."""
    return baseline / measured if baseline and measured else None


def format_speedup(value: Optional[float]) -> str:
    """A `speedup` as printed: "1.36x", or "-" where there is none."""
    return "-" if value is None else f"{value:.2f}x"


def emulates(device: torch.device) -> bool:
    """Whether FP8 GEMMs on `device` are emulated (every CPU) rather than run by FP8 hardware."""
    return device.type == "cpu"


def scaled_mm(a: torch.Tensor, b: torch.Tensor, inv_scale_a: torch.Tensor, inv_scale_b: torch.Tensor,
              out_dtype: torch.dtype, use_fast_accum: bool = False,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(a * inv_scale_a) @ (b * inv_scale_b) (+ bias) in `out_dtype`, a and b in FP8: torch's
    `_scaled_mm` on a GPU, the emulation (module docstring) on the CPU. The scales are
    `_scaled_mm`'s: the factors that turn the FP8 values back into real ones (per tensor, or per
    row of a and per column of b)."""
    if not emulates(a.device):
        return torch._scaled_mm(a, b, scale_a=inv_scale_a, scale_b=inv_scale_b, bias=bias,
                                out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    return _emulated_scaled_mm(a, b, inv_scale_a, inv_scale_b, out_dtype, bias)


def writable_dtype(wanted: torch.dtype, fallback: torch.dtype) -> torch.dtype:
    """`wanted` where an FP8 GEMM can write it (a float32, bfloat16 or float16 result), else
    `fallback`: a GEMM that writes its result in the dtype it is wanted in saves the copy kernel
    after it, which reads and writes the whole result once more."""
    return wanted if wanted in (torch.float32, torch.bfloat16, torch.float16) else fallback


@torch.library.custom_op("fp8plug::emulated_scaled_mm", mutates_args=())
def _emulated_scaled_mm(a: torch.Tensor, b: torch.Tensor, inv_scale_a: torch.Tensor, inv_scale_b: torch.Tensor,
                        out_dtype: torch.dtype, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The emulation, as one operator that torch.compile calls as it is (as it calls
    `_scaled_mm`) rather than tracing into: torch 2.11's inductor, fusing the FP8 reads into the
    casts that made the operands, gave zero gradients on the CPU (seen on the H100 host's Xeon)."""
    with float32_gemm():
        out = torch.mm(fp8_to_float(a) * inv_scale_a, fp8_to_float(b) * inv_scale_b)
        if bias is not None:
            out = out + bias.float()
    return out.to(out_dtype)


def float32_gemm():
    """The emulations' float32 GEMM kept in float32 under CPU autocast. Why: an emulation is a
    custom op, and eagerly the ops inside it still see autocast (bf16 on the CPU under mixed
    precision "fp8"), while a compiled graph calls it with autocast off; eager and compiled then
    ran different GEMMs (bf16 and float32) and their gradients agreed only to ~20 dB in a tiny
    MoE model. What `_scaled_mm` computes is float32 accumulation either way."""
    return torch.autocast("cpu", enabled=False)


@_emulated_scaled_mm.register_fake
def _(a, b, inv_scale_a, inv_scale_b, out_dtype, bias):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def fp8_to_float(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's exact values in float32, NaN, inf and subnormals included.

    Why not `t.float()`: torch converts FP8 on the CPU one element at a time (0.6-0.8 ms for
    512x512 on the CPUs measured, 40x an fp16 conversion). Both FP8 formats are short float16s:
    E5M2 is float16's top byte, and E4M3's magnitude bits, moved into float16's places, read as
    that value times 2**-8 (subnormals too, float16's exponent bias being 8 more). So the
    conversion is a few integer passes and float16's vectorised conversion to float32."""
    bits = t.view(torch.uint8).to(torch.int16)
    if t.dtype == torch.float8_e5m2:
        return (bits << 8).view(torch.float16).float()
    if t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_to_float: expected float8_e4m3fn or float8_e5m2, got {t.dtype}")
    magnitude = bits & 0x7F
    half = (magnitude << 7) | ((bits >> 7) * -0x8000)  # sign to float16's sign bit
    # E4M3FN has no inf: its one NaN pattern per sign, 0x7F, would read as 1.875; make it NaN
    half = half | (((magnitude + 1) >> 7) * 0x7E00)
    return half.view(torch.float16).float() * 256.0


@dataclass(frozen=True)
class GemmSpeed:
    """How FP8 GEMMs run on a device, and one FP8 GEMM's time against bf16's."""

    how: str  # "FP8 hardware" or "emulated"
    fp8_ms: float
    bf16_ms: float

    @property
    def speedup(self) -> Optional[float]:
        """FP8's speed in bf16's: bf16's time / FP8's (`speedup`)."""
        return speedup(self.bf16_ms, self.fp8_ms)

    def describe(self) -> str:
        """One line: how FP8 GEMMs run, both times, and FP8's speed-up where FP8 hardware ran it;
        where they are emulated, the EMULATION_NOTE in its place (no ratio is a speed-up there)."""
        m, k, n = PROBE_SHAPE
        times = f"a {m}x{k}x{n} GEMM takes {self.fp8_ms:.3g} ms in FP8, {self.bf16_ms:.3g} ms in bf16"
        if self.how == "emulated":
            return f"{self.how}; {times}; {EMULATION_NOTE}"
        return f"{self.how}; {times} (FP8 at {format_speedup(self.speedup)} bf16's speed)"


def fp8_gemm_speed(device=None, repeats: int = 5) -> GemmSpeed:
    """Time `scaled_mm` against a bf16 GEMM of PROBE_SHAPE on `device` (best of `repeats`, after
    one warm-up each): a few milliseconds on a CPU, less on a GPU."""
    device = torch.device(device or "cpu")
    m, k, n = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device)
    w = torch.randn(n, k, generator=gen).to(device)
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    fp8 = _best_ms(lambda: scaled_mm(x8, w8.t(), one, one, torch.bfloat16, use_fast_accum=True), device, repeats)
    bf16 = _best_ms(lambda: torch.mm(xb, wb.t()), device, repeats)
    return GemmSpeed("emulated" if emulates(device) else "FP8 hardware", fp8, bf16)


def _best_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best * 1e3
