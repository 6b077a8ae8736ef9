"""The `ao` engine with real torchao float8 GEMMs on one sm_89+ GPU (H100/H200): tensorwise and
rowwise numerics against float64, inductor compile, the eval policy, padding, training a small
decoder within 10% of bf16, and (slow) the probe decoder (4 layers, d=4096, ffn 16384) against raw
torchao.

Run: source .gpu/install.sh && python3 -m pytest tests/gpu/test_ao.py -q -s
"""

import copy
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchao.float8")

import fp8plug  # noqa: E402
from fp8plug import FP8RecipeKwargs  # noqa: E402
from fp8plug.backends import get_backend  # noqa: E402
from fp8plug.bench.toy_model import DecoderConfig, TinyDecoder, lm_loss, synthetic_batches  # noqa: E402
from tests.support.numerics import sqnr_db  # noqa: E402
from tests.support.training import adamw_tail_loss  # noqa: E402

ROWWISE_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
SCALINGS = [
    "tensorwise",
    pytest.param("rowwise", marks=pytest.mark.skipif(not ROWWISE_OK, reason="rowwise GEMMs need sm_90")),
    pytest.param("rowwise_with_gw_hp", marks=pytest.mark.skipif(not ROWWISE_OK, reason="rowwise GEMMs need sm_90")),
]


def converted_layer(k=512, n=256, dtype=torch.bfloat16, **recipe):
    torch.manual_seed(0)
    holder = nn.Sequential(nn.Linear(k, n)).cuda().to(dtype)
    report = get_backend("ao").convert(holder, FP8RecipeKwargs(backend="ao", **recipe))
    assert report.converted == ["0"]
    layer = holder[0]
    assert layer.config.emulate is False  # real FP8 GEMMs, not emulation
    return layer


def reference(layer, x, grad):
    xd = x.detach().double().requires_grad_()
    wd = layer.weight.detach().double().requires_grad_()
    out = F.linear(xd, wd, layer.bias.detach().double())
    out.backward(grad.double())
    return out, xd.grad, wd.grad


def step(layer, x, grad):
    x = x.detach().clone().requires_grad_()
    layer.weight.grad = layer.bias.grad = None
    out = layer(x)
    out.backward(grad)
    return out, x.grad, layer.weight.grad


def batch(m=256, k=512, n=256, dtype=torch.bfloat16, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    grad = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)
    return x, grad


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_fp8_numerics(scaling, dtype):
    layer = converted_layer(dtype=dtype, scaling=scaling)
    x, grad = batch(dtype=dtype)
    out, dx, dw = step(layer, x, grad)
    ref_out, ref_dx, ref_dw = reference(layer, x, grad)
    assert sqnr_db(out, ref_out) >= 20
    assert sqnr_db(dx, ref_dx) >= 18
    assert sqnr_db(dw, ref_dw) >= 18
    assert sqnr_db(out, ref_out) <= 40  # FP8 really ran (bf16 or fp32 alone are well above 40 dB)


@pytest.mark.parametrize("override", [(True, False, False), (False, True, False), (False, False, True)])
def test_override_linear_precision_on_gpu(override):
    layer = converted_layer(override_linear_precision=override)
    x, grad = batch()
    results = step(layer, x, grad)
    refs = reference(layer, x, grad)
    for overridden, got, want in zip(override, results, refs):
        db = sqnr_db(got, want)
        assert (db >= 40) if overridden else (18 <= db <= 40), (override, db)


def test_e4m3_format_on_gpu():
    layer = converted_layer(fp8_format="E4M3")
    assert layer.config.cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    x, grad = batch()
    out, dx, dw = step(layer, x, grad)
    ref_out, ref_dx, ref_dw = reference(layer, x, grad)
    assert sqnr_db(out, ref_out) >= 20 and sqnr_db(dx, ref_dx) >= 18 and sqnr_db(dw, ref_dw) >= 18


@pytest.mark.parametrize("scaling", SCALINGS[:2])
def test_inductor_compile_matches_eager(scaling):
    layer = converted_layer(k=1024, n=1024, scaling=scaling)
    eager = copy.deepcopy(layer)
    compiled = torch.compile(nn.Sequential(layer), fullgraph=True)
    x, grad = batch(m=512, k=1024, n=1024)
    a = compiled(x)
    a.backward(grad)
    b = eager(x)
    b.backward(grad)
    ref_out, _, ref_dw = reference(eager, x, grad)
    assert sqnr_db(a, b) >= 30
    assert sqnr_db(layer.weight.grad, eager.weight.grad) >= 30
    assert sqnr_db(a, ref_out) >= 20 and sqnr_db(layer.weight.grad, ref_dw) >= 18


def test_eval_runs_high_precision_and_autocast_turns_fp8_on():
    layer = converted_layer()
    plain = nn.Linear(512, 256).cuda().bfloat16()
    plain.load_state_dict(layer.state_dict())
    x, _ = batch()
    with torch.no_grad():
        fp8 = layer(x)
        layer.eval()
        torch.testing.assert_close(layer(x), plain(x), rtol=0, atol=0)
        with get_backend("ao").autocast(None, enabled=True):
            torch.testing.assert_close(layer(x), fp8, rtol=0, atol=0)


def test_odd_token_count_runs_fp8_padded_by_fp8plug_or_torchao():
    x, grad = batch(m=21)  # an FP8 weight-gradient GEMM needs tokens % 16 == 0: padded to 32
    for layer in (converted_layer(), converted_layer(pad_inner_dim=True)):  # fp8plug pads; torchao pads
        out, dx, dw = step(layer, x, grad)
        ref_out, ref_dx, ref_dw = reference(layer, x, grad)
        assert 20 <= sqnr_db(out, ref_out) <= 40 and sqnr_db(dx, ref_dx) >= 18 and sqnr_db(dw, ref_dw) >= 18
        assert fp8plug.fp8_coverage(nn.Sequential(layer))["layers"]["0"] == (1, 0)


@pytest.mark.skipif(torch.cuda.get_device_capability() >= (10, 0) if torch.cuda.is_available() else True,
                    reason="Blackwell may run MXFP8 for real")
def test_mxfp8_is_refused_clearly_below_sm100():
    from fp8plug.integrations.float8 import AOMXLinearConfig, Float8Config

    model = nn.Sequential(nn.Linear(256, 256)).cuda()
    with pytest.raises(RuntimeError, match="MXFP8 training cannot run here"):
        Float8Config(ao_mx=AOMXLinearConfig()).apply_float8_linear(model)
    assert type(model[0]) is nn.Linear and type(model[0].weight) is nn.Parameter  # left untouched


def test_compiled_decoder_trains_close_to_bf16():
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, ffn_dim=1024, max_seq_len=128)
    base = TinyDecoder(cfg).cuda()
    batches = synthetic_batches(32, 16, 128, cfg.vocab_size, device="cuda")
    bf16 = adamw_tail_loss(torch.compile(copy.deepcopy(base)), batches, 150, autocast="cuda")
    model = copy.deepcopy(base)
    recipe = FP8RecipeKwargs(backend="ao", modules_to_ignore=["lm_head"])
    report = fp8plug.convert_model(model, recipe=recipe)
    assert len(report.converted) == 2 * 7
    fp8plug.apply_fp8_autowrap(model, recipe)
    fp8 = adamw_tail_loss(torch.compile(model), batches, 150, autocast="cuda")
    assert abs(fp8 - bf16) / bf16 <= 0.10, (fp8, bf16)


# --- the 4-layer d=4096 probe decoder: fp8plug's ao path against raw torchao --------------------------


def _probe_model():
    cfg = DecoderConfig(vocab_size=32000, dim=4096, n_layers=4, n_heads=32, ffn_dim=16384, max_seq_len=2048)
    torch.manual_seed(0)
    return TinyDecoder(cfg).cuda().bfloat16(), cfg


def _trainer(model, cfg):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    compiled = torch.compile(model)
    tokens = torch.randint(0, cfg.vocab_size, (4, 2048), device="cuda")

    def run(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            lm_loss(compiled(tokens), tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return steps * tokens.numel() / (time.perf_counter() - start)

    return run


@pytest.mark.slow
def test_probe_model_throughput_within_2_percent_of_raw_torchao():
    """4-layer d=4096 ffn=16384 decoder, B=4 T=2048, AdamW, compiled, lm_head in bf16: tokens/s
    of fp8plug (engine.convert + apply_fp8_autowrap) against torchao's convert_to_float8_training,
    measured in alternating rounds so drift hits both alike."""
    from torchao.float8 import convert_to_float8_training

    raw, cfg = _probe_model()
    convert_to_float8_training(raw, module_filter_fn=lambda m, fqn: fqn != "lm_head")
    ours, _ = _probe_model()
    recipe = FP8RecipeKwargs(backend="ao", modules_to_ignore=["lm_head"])
    assert len(get_backend("ao").convert(ours, recipe).converted) == 4 * 7
    fp8plug.apply_fp8_autowrap(ours, recipe)
    runs = {"raw": _trainer(raw, cfg), "ours": _trainer(ours, cfg)}
    for run in runs.values():
        run(5)  # compile and warm up
    rates = {name: [] for name in runs}
    for _ in range(5):
        for name, run in runs.items():
            rates[name].append(run(10))
    raw_rate, our_rate = statistics.median(rates["raw"]), statistics.median(rates["ours"])
    print(f"probe model tokens/s: raw torchao {raw_rate:,.0f}, fp8plug ao {our_rate:,.0f} ({our_rate / raw_rate:.3f}x)")
    assert our_rate >= 0.98 * raw_rate, rates
