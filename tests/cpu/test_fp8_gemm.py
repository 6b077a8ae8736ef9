"""The CPU's FP8 GEMM emulation (fp8plug.backends.gemm) against torch's own CPU `torch._scaled_mm`.

The emulation exists for speed (torch's CPU kernel took 1 s for a 512x128x512 GEMM on an AMX Xeon,
docs/performance.md "FP8 on a CPU"), and must not change a single result: every check here is bit
for bit against torch's kernel, which is what fp8plug ran on the CPU before.
"""

import re

import pytest
import torch

import fp8plug
from fp8plug.backends import gemm as fp8_gemm
from fp8plug.backends.native import engine as native
from fp8plug.backends.native import fp8_matmul  # where the layer's GEMMs run

FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
ENGINE = fp8plug.get_backend("native")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit, NaN where the other is NaN."""
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_fp8_value_converts_exactly(fmt):
    every = torch.arange(256, dtype=torch.uint8).view(fmt)
    assert same_bits(fp8_gemm.fp8_to_float(every), every.float())
    grid = every.view(16, 16).t()  # a transposed (non-contiguous) operand, as the GEMMs get them
    assert same_bits(fp8_gemm.fp8_to_float(grid), grid.float())


def test_other_dtypes_are_refused_by_name():
    with pytest.raises(TypeError, match="fp8_to_float: expected float8_e4m3fn or float8_e5m2"):
        fp8_gemm.fp8_to_float(torch.zeros(2, dtype=torch.bfloat16))


def operands(fmt_a, fmt_b, m=48, k=96, n=80, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=gen) * 40).to(fmt_a)
    b = (torch.randn(n, k, generator=gen) * 3).to(fmt_b).t()
    return a, b


@pytest.mark.parametrize("fmt_a, fmt_b", [(FORMATS[0], FORMATS[0]), (FORMATS[1], FORMATS[0]), (FORMATS[0], FORMATS[1])])
@pytest.mark.parametrize("out_dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_gemm_equals_torch_cpu_scaled_mm_to_the_bit(fmt_a, fmt_b, out_dtype):
    a, b = operands(fmt_a, fmt_b)
    inv_a, inv_b = torch.tensor(0.0371), torch.tensor(1.37)  # not powers of two: rounding shows
    expected = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)
    assert same_bits(fp8_gemm.scaled_mm(a, b, inv_a, inv_b, out_dtype), expected)
    bias = torch.randn(b.shape[1]).to(out_dtype)
    if out_dtype != torch.float32:  # torch's kernel takes no bias with a float32 output
        expected = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, bias=bias, out_dtype=out_dtype)
        assert same_bits(fp8_gemm.scaled_mm(a, b, inv_a, inv_b, out_dtype, bias=bias), expected)


def test_non_finite_operands_stay_non_finite():
    a, b = operands(FORMATS[1], FORMATS[0])
    a[3, 5] = float("inf")
    a[7, 1] = float("nan")
    out = fp8_gemm.scaled_mm(a, b, torch.tensor(1.0), torch.tensor(1.0), torch.float32)
    expected = torch._scaled_mm(a, b, scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0), out_dtype=torch.float32)
    assert same_bits(out, expected) and not out[3].isfinite().any() and out[7].isnan().all()


def test_the_cpu_never_calls_torch_scaled_mm(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch._scaled_mm called on the CPU")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    a, b = operands(FORMATS[0], FORMATS[0])
    fp8_gemm.scaled_mm(a, b, torch.tensor(1.0), torch.tensor(1.0), torch.bfloat16)
    layer = native.NativeFP8Linear(32, 48)
    with ENGINE.autocast(fp8plug.FP8RecipeKwargs(backend="native")):
        layer(torch.randn(16, 32)).sum().backward()


def torch_kernel(a, b, inv_scale_a, inv_scale_b, out_dtype, use_fast_accum=False, bias=None):
    # torch's CPU kernel itself sees CPU autocast (its result under bf16 autocast differs from
    # without); the emulation computes what it computes without, as a compiled graph calls it
    # (tests/cpu/test_compiled_fp8_grads.py)
    with torch.autocast("cpu", enabled=False):
        return torch._scaled_mm(a, b, scale_a=inv_scale_a, scale_b=inv_scale_b, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=use_fast_accum)


@pytest.mark.parametrize("scaling", ("delayed", "dynamic"))
def test_native_training_is_unchanged_to_the_bit(monkeypatch, scaling):
    """Three steps of a native FP8 Linear pair under bf16 autocast, once on the emulation and once
    on torch's kernel (the engine's GEMM swapped back): outputs, gradients, weights and scaling
    state are bit-identical."""

    def train(gemm):
        monkeypatch.setattr(fp8_matmul, "scaled_mm", gemm)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
        recipe = fp8plug.FP8RecipeKwargs(backend="native", scaling=scaling, auto_filter=False)
        fp8plug.convert_model(model, recipe=recipe, backend="native")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outs = []
        for step in range(3):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
            with ENGINE.autocast(recipe), torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().square().mean().backward()
            opt.step()
            fp8plug.sync_fp8_scaling(model)
            opt.zero_grad()
            outs.append(out.detach())
        return outs, [p.detach().clone() for p in model.parameters()], ENGINE.fp8_state(model)

    emulated, kernel = train(fp8_gemm.scaled_mm), train(torch_kernel)
    assert all(same_bits(a, b) for a, b in zip(emulated[0], kernel[0]))
    assert all(same_bits(a, b) for a, b in zip(emulated[1], kernel[1]))
    for name, slots in emulated[2].items():
        assert all(same_bits(t, kernel[2][name][k]) for k, t in slots.items() if isinstance(t, torch.Tensor))


def test_speed_probe_says_how_fp8_runs():
    speed = fp8_gemm.fp8_gemm_speed("cpu", repeats=1)
    assert speed.how == "emulated" and speed.fp8_ms > 0 and speed.bf16_ms > 0
    assert "512x128x512" in speed.describe() and "emulated" in speed.describe()


def test_speed_probe_says_a_speed_up_only_where_fp8_hardware_ran():
    """An "x" is bf16's time / FP8's (bigger is faster); an emulated FP8 time gets no ratio, since
    it says how the CPU runs bf16, not what FP8 gains."""
    hardware = fp8_gemm.GemmSpeed("FP8 hardware", fp8_ms=0.5, bf16_ms=1.0)
    assert hardware.speedup == 2.0 and "(FP8 at 2.00x bf16's speed)" in hardware.describe()
    emulated = fp8_gemm.GemmSpeed("emulated", fp8_ms=0.5, bf16_ms=8.0).describe()
    assert not re.search(r"\dx\b", emulated) and fp8_gemm.EMULATION_NOTE in emulated
    assert fp8_gemm.speedup(3.0, 1.5) == 2.0 and fp8_gemm.speedup(None, 1.0) is None
    assert fp8_gemm.format_speedup(1.234) == "1.23x" and fp8_gemm.format_speedup(None) == "-"


@pytest.mark.slow  # two compiled trainings: about 15 s
def test_compiled_training_matches_torch_kernel(monkeypatch):
    """Under torch.compile the emulation must give the gradients torch's kernel gives (torch
    2.11's inductor turned the bit views of fp8_to_float into zeros when fused after the cast)."""

    def grads(gemm):
        monkeypatch.setattr(fp8_matmul, "scaled_mm", gemm)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        recipe = fp8plug.FP8RecipeKwargs(backend="native", scaling="dynamic", auto_filter=False)
        fp8plug.convert_model(model, recipe=recipe, backend="native")
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
        with ENGINE.autocast(recipe):
            torch.compile(model)(x).float().logsumexp(-1).mean().backward()
        return [p.grad for p in model.parameters()]

    emulated, kernel = grads(fp8_gemm.scaled_mm), grads(torch_kernel)
    assert all(g.abs().sum() > 0 for g in emulated)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(emulated, kernel))
