"""Compiled FP8 gradients equal eager ones on the CPU (docs/numerics.md, "Compiled and eager").

The CPU's FP8 GEMMs are emulations, custom ops that torch.compile calls as they are; the casts
around them are the same torch ops either way. So eager and compiled must agree to the bit, and
any difference is a bug (one FP8 rounding flip upstream moves every dynamic scale after it, so a
tiny difference shows as a whole FP8 quantisation noise, ~25-30 dB). What these caught: eagerly
the emulations' float32 GEMM ran under the caller's bf16 autocast (a custom op does not switch
autocast off for the ops inside it), while the compiled graph called them with autocast off; a
tiny MoE model's compiled and eager gradients then agreed to ~23 dB only.

Two FP8 layers in a row, so that a difference in the first one's output reaches the second's
scales and gradients, under CPU bf16 autocast as the Accelerator runs mixed precision "fp8".
"""

import pytest
import torch

from fp8plug.backends import gemm
from fp8plug.backends.native import granular, grouped
from tests.support.numerics import sqnr_db
from tests.support.threads import one_thread  # noqa: F401

SAME = 80.0  # dB: eager and compiled run the same casts and GEMMs (bit-exact here: inf)


def _grads(fn, inputs, seed=1):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(*leaves)
    out.float().backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
    return [out.detach()] + [t.grad for t in leaves if t.requires_grad]


def _compare(fn, inputs):
    eager = _grads(fn, inputs)
    torch._dynamo.reset()
    compiled = _grads(torch.compile(fn, backend="aot_eager", fullgraph=True), inputs)
    return [sqnr_db(c, e) for c, e in zip(compiled, eager)]


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_compiled_granular_layers_give_eager_gradients(scaling):
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    w1, w2 = torch.randn(256, 128) * 0.05, torch.randn(128, 256) * 0.05

    def two_layers(x, w1, w2):
        h = granular.granular_linear(x, w1, scaling, torch.bfloat16)
        return granular.granular_linear(torch.nn.functional.gelu(h), w2, scaling, torch.bfloat16)

    sqnr = _compare(two_layers, [x, w1, w2])
    assert min(sqnr) > SAME, dict(zip(["out", "x", "w1", "w2"], sqnr))


@pytest.mark.parametrize("transposed", [False, True])
def test_compiled_grouped_experts_give_eager_gradients(transposed):
    torch.manual_seed(0)
    sizes = [5, 0, 37, 22]  # unaligned, an empty expert
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), 64)
    w1, w2 = torch.randn(4, 128, 64) * 0.05, torch.randn(4, 64, 128) * 0.05
    if transposed:
        w1, w2 = w1.transpose(-2, -1).contiguous(), w2.transpose(-2, -1).contiguous()

    def two_projections(x, w1, w2, offs):
        h = grouped.grouped_fp8_linear(x, w1, offs, transposed)
        return grouped.grouped_fp8_linear(torch.nn.functional.silu(h), w2, offs, transposed)

    sqnr = _compare(two_projections, [x, w1, w2, offs])
    assert min(sqnr) > SAME, dict(zip(["out", "x", "w1", "w2"], sqnr))


def test_emulated_gemm_is_float32_under_autocast():
    """What `_scaled_mm` computes (float32 accumulation), whatever autocast the caller has on."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 128, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(96, 128, generator=gen).to(torch.float8_e4m3fn)
    one = torch.ones(())
    plain = gemm.scaled_mm(a, b.t(), one, one, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = gemm.scaled_mm(a, b.t(), one, one, torch.float32)
    torch.testing.assert_close(under_autocast, plain, rtol=0, atol=0)
