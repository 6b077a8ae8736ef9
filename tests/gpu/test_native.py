"""The native engine with real FP8 GEMMs on an sm_89+ GPU: numerics against float64, compile, and
training a small decoder within 10% of bf16."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8plug
from fp8plug.backends.native.engine import NativeFP8Linear
from fp8plug.bench.toy_model import DecoderConfig, TinyDecoder, synthetic_batches
from tests.support.numerics import sqnr_db
from tests.support.training import adamw_tail_loss

OPTIONS = dict(fp8_format="HYBRID", margin=0, interval=1, amax_history_len=16,
               amax_compute_algo="most_recent", override_linear_precision=(False, False, False))


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_fp8_numerics(scaling, dtype):
    torch.manual_seed(0)
    layer = NativeFP8Linear.from_linear(nn.Linear(512, 256), scaling=scaling, **OPTIONS).cuda().to(dtype)
    for _ in range(3):
        x = torch.randn(256, 512, device="cuda", dtype=dtype, requires_grad=True)
        grad = torch.randn(256, 256, device="cuda", dtype=dtype)
        layer.weight.grad = layer.bias.grad = None
        out = layer(x)
        out.backward(grad)
    xd = x.detach().double().requires_grad_()
    wd = layer.weight.detach().double().requires_grad_()
    ref = F.linear(xd, wd, layer.bias.detach().double())
    ref.backward(grad.double())
    assert sqnr_db(out, ref) >= 20
    assert sqnr_db(x.grad, xd.grad) >= 18
    assert sqnr_db(layer.weight.grad, wd.grad) >= 18


def test_compiled_matches_eager_on_gpu():
    torch.manual_seed(0)
    layer = NativeFP8Linear.from_linear(nn.Linear(1024, 1024), scaling="delayed", **OPTIONS).cuda().bfloat16()
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, fullgraph=True)
    for _ in range(3):
        x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
        a = compiled(x)
        a.float().sum().backward()
        b = eager(x)
        b.float().sum().backward()
    assert sqnr_db(a, b) >= 30
    torch.testing.assert_close(layer.fp8_scale, eager.fp8_scale)


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_decoder_trains_close_to_bf16(scaling):
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, ffn_dim=1024, max_seq_len=128)
    base = TinyDecoder(cfg).cuda()
    batches = synthetic_batches(32, 16, 128, cfg.vocab_size, device="cuda")
    bf16 = adamw_tail_loss(copy.deepcopy(base), batches, 150, autocast="cuda")
    model = copy.deepcopy(base)
    recipe = fp8plug.FP8RecipeKwargs(backend="native", scaling=scaling, modules_to_ignore=["lm_head"])
    fp8plug.convert_model(model, recipe=recipe)
    fp8plug.apply_fp8_autowrap(model, recipe)
    fp8 = adamw_tail_loss(model, batches, 150, autocast="cuda")
    assert abs(fp8 - bf16) / bf16 <= 0.10, (fp8, bf16)


def test_the_autocast_wrapped_model_compiles_as_one_graph():
    """The FP8 autocast wrapper (how Accelerate and fp8plug.Accelerator run a model) traces in one
    graph under torch.compile: on torch 2.11 opening the region once broke the graph, so a wrapped
    Hugging Face model compiled as two."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda().bfloat16()
    recipe = fp8plug.FP8RecipeKwargs(backend="native", auto_filter=False)
    report = fp8plug.convert_model(model, recipe=recipe)
    assert len(report.converted) == 2
    fp8plug.apply_fp8_autowrap(model, recipe)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    out = compiled(x)
    out.float().sum().backward()
    reference = F.linear(F.gelu(F.linear(x.double(), model[0].weight.double(), model[0].bias.double())),
                         model[2].weight.double(), model[2].bias.double())
    assert sqnr_db(out, reference) >= 20


def test_compiled_norm_is_fused_into_the_fp8_cast_on_gpu():
    """The norm fused into the FP8 cast, with the GPU's Triton kernels: one kernel takes the
    RMSNorm's statistics and the amax of its output, the cast recomputes the normalised value, and
    the forward allocates q/k/v's shared input only in FP8. (The Llama's profile shows the same kernel,
    `triton_red_fused_abs_add_amax_mean_mul_pow_rsqrt`,
    docs/results/h100/2026-11-24-llama3-first-step/norm_fusion_kernels.py.txt.)"""
    from tests.support.fusion import check_norm_fused_into_the_cast

    # the norm's statistics and the amax of its output (Triton's max2) in one kernel
    check_norm_fused_into_the_cast("cuda", tokens=4096, norm_kernel_has=("rsqrt", "max2"))
