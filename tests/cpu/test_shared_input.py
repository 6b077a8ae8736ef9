"""Eagerly, the native engine casts an input several layers read once (q/k/v, gate/up), as the
compiler does, and takes over Llama-style RMSNorms (fused kernels on CUDA; tests/gpu has those).
On the CPU: one cast per shared input, the same bytes as a cast per layer, and the norms'
conversion and its way back."""

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug.backends.native import cast as native_cast
from fp8plug.backends.native import engine as native
from fp8plug.backends.native.fused_norm import FusedRMSNorm
from tests.support.hf import tiny_llama


def three_projections(scaling="dynamic", seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(native.NativeFP8Linear(64, 48, bias=False, scaling=scaling) for _ in range(3))


def run(layers, x, shared=True):
    """Forward (each layer on x itself, or on its own copy of it) and backward; the outputs and
    gradients."""
    inputs = [x] * 3 if shared else [x.detach().clone().requires_grad_() for _ in range(3)]
    outs = [layer(inp) for layer, inp in zip(layers, inputs)]
    sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs)).backward()
    grads_x = [x.grad] if shared else [sum(inp.grad for inp in inputs)]
    return outs, grads_x + [layer.weight.grad for layer in layers]


def counting_casts(monkeypatch):
    calls = []
    real = native_cast.quantize

    def counted(t, scale, dtype):
        calls.append(tuple(t.shape))
        return real(t, scale, dtype)

    monkeypatch.setattr(native_cast, "quantize", counted)
    return calls


def test_layers_reading_one_input_share_one_cast_with_the_same_results(monkeypatch):
    x = torch.randn(2, 16, 64)
    separate = run(three_projections(), x.clone().requires_grad_(), shared=False)
    calls = counting_casts(monkeypatch)
    shared = run(three_projections(), x.clone().requires_grad_(), shared=True)
    # forward: the input once and three weights; backward: three grad_outputs
    assert calls.count((32, 64)) == 1
    assert len(calls) == 1 + 3 + 3
    (outs_a, (grad_x_a, *grad_w_a)), (outs_b, (grad_x_b, *grad_w_b)) = separate, shared
    for a, b in zip(outs_a + grad_w_a, outs_b + grad_w_b):
        assert torch.equal(a, b)
    # the input's gradient: the same three terms, summed by autograd in its own order
    assert torch.allclose(grad_x_a, grad_x_b, rtol=1e-6, atol=1e-6)


def test_an_input_changed_in_place_is_cast_again(monkeypatch):
    layers = three_projections()
    calls = counting_casts(monkeypatch)
    x = torch.randn(32, 64)
    with torch.no_grad():
        first = layers[0](x)
        x.mul_(2)  # the same tensor object, a new version
        second = layers[0](x)
    assert calls.count((32, 64)) == 2
    assert not torch.equal(first, second)


def test_a_view_of_the_same_memory_shares_the_cast_and_other_views_do_not(monkeypatch):
    layers = three_projections()
    calls = counting_casts(monkeypatch)
    x = torch.randn(4, 16, 64)
    with torch.no_grad():
        layers[0](x)
        layers[1](x[:, 0:])  # what transformers hands lm_head: a view laid out like x
        layers[2](x[2:])  # other rows: cast on its own
    assert calls.count((64, 64)) == 1 and calls.count((32, 64)) == 1


def test_delayed_scaling_never_shares_a_cast(monkeypatch):
    layers = three_projections(scaling="delayed")
    calls = counting_casts(monkeypatch)
    x = torch.randn(32, 64)
    for layer in layers:
        layer(x)
    assert calls.count((32, 64)) == 3  # each layer's own scale


def convert(model, **recipe):
    return fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native", scaling="dynamic", **recipe))


def test_llama_norms_are_taken_over_and_given_back_with_the_same_weights():
    model = tiny_llama()
    before = {name: p for name, p in model.named_parameters()}
    keys = set(model.state_dict())
    report = convert(model)
    norms = [fqn for fqn, m in model.named_modules() if isinstance(m, FusedRMSNorm)]
    assert len(norms) == 5 and set(norms) <= set(report.converted)
    assert "also converted 5 norms" in report.summary()
    assert set(model.state_dict()) == keys
    assert all(p is before[name] for name, p in model.named_parameters())
    fp8plug.convert_model(model, to_transformer_engine=False)
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    restored = model.model.layers[0].input_layernorm
    assert type(restored) is LlamaRMSNorm and restored.weight is before["model.layers.0.input_layernorm.weight"]
    assert restored.variance_epsilon == model.config.rms_norm_eps


def test_a_converted_norm_computes_what_the_original_did_off_cuda():
    model = tiny_llama()
    original = model.model.layers[1].post_attention_layernorm
    fused = FusedRMSNorm(original)
    x = torch.randn(3, 5, 64, requires_grad=True)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(fused(x.to(dtype)), original(x.to(dtype)))


def test_norms_honour_modules_to_ignore_and_are_not_handed_to_module_filter_fn():
    seen = []

    def linears_only(module, fqn):  # reads what only a Linear has, as torchao-style filters do
        seen.append(fqn)
        return module.in_features >= 16

    model = tiny_llama()
    report = convert(model, modules_to_ignore=["model.norm"], module_filter_fn=linears_only)
    assert not any("norm" in fqn for fqn in seen)
    assert isinstance(model.model.layers[0].input_layernorm, FusedRMSNorm)
    assert not isinstance(model.model.norm, FusedRMSNorm)
    assert report.skipped["model.norm"] == "listed in modules_to_ignore"


def test_a_norm_whose_forward_is_patched_on_the_instance_is_left_alone():
    model = tiny_llama()
    patched = model.model.norm
    patched.forward = lambda hidden_states: hidden_states  # as Liger's or accelerate's hooks do
    report = convert(model)
    assert model.model.norm is patched
    assert "patched on the instance" in report.skipped["model.norm"]


@pytest.mark.parametrize("name", ["GemmaRMSNorm", "nn.RMSNorm"])
def test_norms_with_other_arithmetic_are_not_taken(name):
    if name == "nn.RMSNorm":
        norm = nn.RMSNorm(64)
    else:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # 1 + weight

        norm = GemmaRMSNorm(64)
    model = nn.Sequential(nn.Linear(64, 64), norm)
    convert(model)
    assert model[1] is norm


def test_giving_a_norm_back_keeps_its_other_attributes():
    model = tiny_llama()
    norm = model.model.norm
    norm.hidden_size = 64  # an attribute its forward never reads
    convert(model)
    fp8plug.convert_model(model, to_transformer_engine=False)
    assert model.model.norm.hidden_size == 64 and model.model.norm.weight is norm.weight


def test_convert_model_without_norms_leaves_them_and_without_linears_fuses_only_them():
    model = tiny_llama()
    fp8plug.convert_model(model, _convert_ln=False, backend="native")
    assert not any(isinstance(m, FusedRMSNorm) for m in model.modules())
    model = tiny_llama()
    fp8plug.convert_model(model, _convert_linear=False, backend="native")
    assert isinstance(model.model.norm, FusedRMSNorm) and not isinstance(model.lm_head, native.NativeFP8Linear)


def test_norms_stay_torch_where_no_linear_runs_in_fp8():
    """A filter that keeps every Linear in bf16 (the speed filter at hidden 768) leaves the norms
    alone too: a fused norm serves only the FP8 Linears reading it, and was a cost without them."""
    model = tiny_llama()
    report = convert(model, module_filter_fn=lambda module, fqn: False)
    assert not any(isinstance(m, (FusedRMSNorm, native.NativeFP8Linear)) for m in model.modules())
    reason = report.skipped["model.layers.0.input_layernorm"]
    assert "no Linear of the model runs in FP8" in reason
