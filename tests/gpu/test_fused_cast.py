"""The one-pass FP8 cast of delayed slots (fp8plug.backends.native.fused_cast) against the torch ops it
replaces: the same FP8 bytes in both layouts, the same scale (the previous one once the slot has
an update, the current amax's before), the same amax (NaN included), eager and compiled, and a
NativeFP8Linear whose delayed slots take this path matching one that casts with torch ops."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug.backends.native import fused_cast
from fp8plug.backends.native.engine import NativeFP8Linear
from fp8plug.backends.native.scaling import E4M3, E5M2, FP8_MAX, quantize, scale_from_amax

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def reference(t, prev_scale, use_prev, dtype, margin):
    amax = t.abs().amax().float()
    first = scale_from_amax(amax, FP8_MAX[dtype], margin)
    scale = prev_scale if use_prev else first
    t_fp8 = quantize(t, scale, dtype)
    return t_fp8, t_fp8.t().contiguous(), scale, amax


def same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("shape", [(4096, 1024), (2048, 14336), (144, 80), (8192, 4096)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("use_prev", [False, True])
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])
def test_fused_cast_gives_the_torch_bytes(shape, dtype, use_prev, source):
    assert fused_cast.load(), "Triton or torch.library.triton_op missing"
    torch.manual_seed(0)
    t = (torch.randn(*shape, device="cuda") * 3).to(source)
    prev = torch.tensor(11.5, device="cuda")
    got = fused_cast.cast_transpose(t, prev, torch.tensor(use_prev, device="cuda"), dtype, 1)
    want = reference(t, prev, use_prev, dtype, 1)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
    assert got[1].shape == (shape[1], shape[0]) and got[1].is_contiguous()
    assert torch.equal(got[2].float(), want[2].float()) and torch.equal(got[3], want[3])
    assert torch.equal(got[4], want[2].float().reciprocal())  # the inverse, bit for bit torch's


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])
def test_dynamic_fused_cast_gives_the_torch_bytes(dtype, source):
    """Dynamic scaling's cast: the scale from the tensor's own amax, no margin, as the torch path."""
    fused_cast.load()
    torch.manual_seed(0)
    t = (torch.randn(2048, 14336, device="cuda") * 3).to(source)
    got = fused_cast.cast_transpose_dynamic(t, dtype)
    want = reference(t, None, False, dtype, 0)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
    assert torch.equal(got[2].float(), want[2].float()) and torch.equal(got[3], want[3])
    assert torch.equal(got[4], want[2].float().reciprocal())


def test_fused_cast_reports_nan_and_saturates():
    fused_cast.load()
    t = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    t[7, 9] = 1e6
    fp8, _, _, amax, _ = fused_cast.cast_transpose(t, torch.tensor(1.0, device="cuda"),
                                                torch.tensor(True, device="cuda"), E4M3, 0)
    assert amax.item() == pytest.approx(1e6, rel=1e-2)
    assert fp8[7, 9].float().item() == FP8_MAX[E4M3]  # saturated, not NaN
    t[3, 4] = float("nan")
    _, _, _, amax, _ = fused_cast.cast_transpose(t, torch.tensor(1.0, device="cuda"),
                                              torch.tensor(True, device="cuda"), E4M3, 0)
    assert torch.isnan(amax)


def test_fused_cast_compiles_to_the_same_bytes():
    fused_cast.load()
    t = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    prev = torch.tensor(20.0, device="cuda")
    for use_prev in (False, True):
        flag = torch.tensor(use_prev, device="cuda")
        eager = fused_cast.cast_transpose(t, prev, flag, E4M3, 0)
        compiled = torch.compile(fused_cast.cast_transpose, fullgraph=True)(t, prev, flag, E4M3, 0)
        assert all(same_bytes(a, b) if a.dtype == E4M3 else torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_layer_on_the_fused_path_matches_the_torch_path(monkeypatch, scaling):
    """Three steps of a NativeFP8Linear (delayed: the first one's fallback included): outputs,
    gradients and the scaling state equal to the torch-op path's."""
    torch.manual_seed(0)
    base = nn.Linear(1024, 2048, bias=False, device="cuda")
    options = dict(scaling=scaling, fp8_format="HYBRID", margin=0, interval=1, amax_history_len=16,
                   amax_compute_algo="most_recent", override_linear_precision=(False, False, False))
    fused = NativeFP8Linear.from_linear(copy.deepcopy(base), **options)
    plain = NativeFP8Linear.from_linear(copy.deepcopy(base), **options)
    from fp8plug.backends.native import fused_cast

    results = []
    for layer, use_fused in ((fused, True), (plain, False)):
        monkeypatch.setattr(fused_cast, "usable", lambda t, on=use_fused: on and t.is_cuda)
        outs = []
        torch.manual_seed(1)
        for _ in range(3):
            x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x)
            y.float().pow(2).mean().backward()
            outs.append((y.detach(), x.grad, layer.weight.grad.clone()))
            layer.weight.grad = None
            fp8plug.sync_fp8_scaling(layer)
        results.append((outs, layer.fp8_scale.clone(), layer.fp8_amax_history[:4].clone()))
    (fused_outs, fused_scale, fused_hist), (plain_outs, plain_scale, plain_hist) = results
    for a, b in zip(fused_outs, plain_outs):
        for u, v in zip(a, b):
            assert torch.equal(u, v)
    assert torch.equal(fused_scale, plain_scale) and torch.equal(fused_hist, plain_hist)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fused_cast_keeps_non_finite_values_non_finite(dtype):
    """inf and NaN become NaN in FP8, exactly where scaling.quantize puts them, finite values
    saturate as before: a bad batch's loss stays non-finite (tests/cpu/test_nonfinite.py)."""
    fused_cast.load()
    t = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    t[7, 9], t[3, 4], t[100, 200], t[11, 12] = float("inf"), float("nan"), -float("inf"), 1e6
    prev = torch.tensor(1.0, device="cuda")
    got = fused_cast.cast_transpose(t, prev, torch.tensor(True, device="cuda"), dtype, 0)
    want = reference(t, prev, True, dtype, 0)
    for g, w in zip(got[:2], want[:2]):
        assert torch.equal(torch.isnan(g.float()), torch.isnan(w.float()))
        assert int(torch.isnan(g.float()).sum()) == 3
        finite = ~torch.isnan(w.float())
        assert same_bytes(g[finite], w[finite])
    assert got[0][11, 12].float().item() == FP8_MAX[dtype]  # a finite value still saturates
