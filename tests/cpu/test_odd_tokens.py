"""FP8 for any token count, on the CPU with the ao engine: a token count an FP8 GEMM cannot take
(not a multiple of 16: 7, 31, 33, 2047, or 3 x 7) is zero-padded inside the layer, and the real
rows' outputs and gradients equal the unpadded FP8 computation (torch's CPU _scaled_mm takes any
token count, so that computation exists here to compare with) and float64 within FP8's error.
The GPU versions, for ao and te, are in tests/gpu/test_odd_tokens.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchao.float8")

from torchao.float8.float8_linear import Float8Linear  # noqa: E402

import fp8plug  # noqa: E402
from fp8plug import FP8RecipeKwargs  # noqa: E402
from fp8plug.backends.padding import pad_tokens  # noqa: E402
from tests.support.numerics import rel_error, sqnr_db  # noqa: E402

SHAPES = [(7,), (31,), (33,), (3, 7), (1, 2047)]


def layer(scaling, k=64, n=96):
    torch.manual_seed(0)
    holder = nn.Sequential(nn.Linear(k, n))
    fp8plug.convert_model(holder, recipe=FP8RecipeKwargs(backend="ao", scaling=scaling))
    return holder[0]


def run(forward, module, x, grad):
    x = x.clone().requires_grad_()
    module.weight.grad = module.bias.grad = None
    out = forward(x)
    out.backward(grad)
    return out, x.grad, module.weight.grad, module.bias.grad


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_padded_rows_equal_the_unpadded_fp8_computation_and_float64(scaling, shape):
    padded = layer(scaling)
    unpadded = copy.deepcopy(padded)
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(*shape, 64, generator=gen), torch.randn(*shape, 96, generator=gen)
    got = run(padded, padded, x, grad)
    direct = run(lambda t: Float8Linear.forward(unpadded, t), unpadded, x, grad)  # torchao, no padding
    for name, a, b in zip(("output", "input grad", "weight grad", "bias grad"), got, direct):
        assert a.shape == b.shape, name
        assert rel_error(a, b) < 1e-6, name  # the same FP8 computation (bit-exact but for GEMM blocking)
    xd = x.double().requires_grad_()
    wd, bd = padded.weight.detach().double().requires_grad_(), padded.bias.detach().double().requires_grad_()
    ref = F.linear(xd, wd, bd)
    ref.backward(grad.double())
    out, dx, dw, db = got
    assert 20 <= sqnr_db(out, ref) <= 45  # FP8 ran (float32 alone gives ~140 dB), and ran right
    assert sqnr_db(dx, xd.grad) >= 18 and sqnr_db(dw, wd.grad) >= 18
    assert sqnr_db(db, bd.grad) >= 100  # the bias gradient is a plain sum over the real rows only
    assert fp8plug.fp8_coverage(nn.Sequential(padded))["layers"]["0"] == (1, 0)


def test_bf16_autocast_with_an_odd_token_count():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    reference = copy.deepcopy(model).double()
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="ao"))
    x = torch.randn(8, 31, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and out.shape == (8, 31, 32)
    assert 18 <= sqnr_db(out, reference(x.double())) <= 45
    assert fp8plug.fp8_coverage(model) == {"fp8_gemms": 2, "high_precision_gemms": 0,
                                           "layers": {"0": (1, 0), "2": (1, 0)}}


def test_pad_tokens_pads_only_what_it_must():
    seen = []

    def forward(rows):
        seen.append(tuple(rows.shape))
        return rows[..., :3] * 2

    x = torch.randn(2, 5, 8)
    out = pad_tokens(forward, x, 16)
    assert seen == [(16, 8)] and out.shape == (2, 5, 3) and torch.equal(out, x[..., :3] * 2)
    aligned = torch.randn(4, 4, 8)
    assert torch.equal(pad_tokens(forward, aligned, 16), aligned[..., :3] * 2) and seen[-1] == (4, 4, 8)
    assert pad_tokens(forward, x, 1).shape == (2, 5, 3) and seen[-1] == (2, 5, 8)
