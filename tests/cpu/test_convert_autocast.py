"""The shared conversion rules and the context-aware autocast, on the native engine."""

import copy
from types import MethodType

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug import ConversionError, FP8RecipeKwargs
from fp8plug.backends.native.engine import NativeFP8Linear
from fp8plug.bench.toy_model import DecoderConfig, TinyDecoder


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = nn.Linear(64, 10)  # unaligned: skipped
        self.after = nn.Linear(64, 64)  # a sibling after an unaligned layer still converts
        self.head = nn.Linear(64, 32)
        self.attn = nn.MultiheadAttention(64, 4)  # its out_proj is a Linear subclass it calls directly
        self.inner = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))

    def forward(self, x):
        return self.head(self.inner(self.after(x))) + self.small(x).sum()


def native(**kwargs):
    return FP8RecipeKwargs(backend="native", **kwargs)


def test_report_says_what_and_why():
    model = Net()
    report = fp8plug.convert_model(model, recipe=native())
    assert report.converted == ["after", "head", "inner.0"]
    assert "in_features" not in report.skipped["small"] and "out_features=10" in report.skipped["small"]
    assert "out_proj of nn.MultiheadAttention 'attn'" in report.skipped["attn.out_proj"]
    assert isinstance(model.after, NativeFP8Linear) and type(model.small) is nn.Linear
    text = str(report)
    assert "converted 3" in text and "small" in text


def test_modules_to_ignore_and_filter():
    model = Net()
    report = fp8plug.convert_model(
        model, recipe=native(modules_to_ignore=["head"], module_filter_fn=lambda m, fqn: fqn != "inner.0")
    )
    assert report.converted == ["after"]
    assert report.skipped["head"] == "listed in modules_to_ignore"
    assert report.skipped["inner.0"] == "module_filter_fn returned False"


def test_unknown_module_name_is_an_error():
    with pytest.raises(ConversionError, match=r"\['haed'\]"):
        fp8plug.convert_model(Net(), recipe=native(modules_to_ignore=["haed"]))


def test_converting_twice_is_harmless():
    model = Net()
    fp8plug.convert_model(model, recipe=native())
    report = fp8plug.convert_model(model, recipe=native())
    assert report.converted == [] and report.skipped["after"] == "already converted"


def test_compiled_or_wrapped_model_is_refused():
    with pytest.raises(ConversionError, match="compiled"):
        fp8plug.convert_model(torch.compile(Net()), recipe=native())


def test_has_fp8_layers_and_unconvert():
    model = Net()
    assert not fp8plug.has_fp8_layers(model)
    fp8plug.convert_model(model, recipe=native())
    assert fp8plug.has_fp8_layers(model)
    assert not fp8plug.has_transformer_engine_layers(model)


# --- autocast ------------------------------------------------------------------------------------


def decoder():
    torch.manual_seed(0)
    return TinyDecoder(DecoderConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, ffn_dim=128, max_seq_len=32))


def test_autowrap_fp8_in_train_high_precision_in_eval():
    plain = decoder()
    model = copy.deepcopy(plain)
    fp8plug.convert_model(model, recipe=native())
    fp8plug.apply_fp8_autowrap(model, native())
    tokens = torch.randint(0, 64, (2, 16))
    model.eval(), plain.eval()
    torch.testing.assert_close(model(tokens), plain(tokens))  # eval: exactly the plain model
    model.train(), plain.train()
    assert not torch.allclose(model(tokens), plain(tokens), atol=1e-6)  # train: FP8


def test_use_autocast_during_eval():
    plain = decoder()
    model = copy.deepcopy(plain)
    fp8plug.convert_model(model, recipe=native())
    fp8plug.apply_fp8_autowrap(model, native(use_autocast_during_eval=True))
    model.eval(), plain.eval()
    tokens = torch.randint(0, 64, (2, 16))
    assert not torch.allclose(model(tokens), plain(tokens), atol=1e-6)


def test_autowrap_is_idempotent_and_unwrappable():
    model = decoder()
    original = model.forward
    fp8plug.apply_fp8_autowrap(model, native())
    first = model.forward
    fp8plug.apply_fp8_autowrap(model, native())
    assert model.forward.__wrapped__ == original  # one layer of wrapping, not two
    assert first.__wrapped__ == original
    fp8plug.remove_fp8_autowrap(model)
    assert model.forward == original and "forward" not in vars(model)


def test_contextual_fp8_autocast_on_a_bound_forward():
    model = decoder()
    fp8plug.convert_model(model, recipe=native())
    wrapped = fp8plug.contextual_fp8_autocast(model.forward, native(), use_during_eval=False)
    model.forward = MethodType(wrapped, model)
    tokens = torch.randint(0, 64, (2, 16))
    model.eval()
    out = model(tokens)
    assert model.layers[0].q.fp8_amax_recorded.tolist() == [-1, -1, -1]  # eval: no FP8 ran
    model.train()
    model(tokens)
    assert (model.layers[0].q.fp8_amax_recorded > 0).tolist() == [True, True, False]
    assert out.shape == (2, 16, 64)


def test_deep_copy_of_a_wrapped_model_runs_its_own_forward():
    model = decoder()
    fp8plug.convert_model(model, recipe=native())
    fp8plug.apply_fp8_autowrap(model, native())
    clone = copy.deepcopy(model)
    clone(torch.randint(0, 64, (2, 16)))
    assert (clone.layers[0].q.fp8_amax_recorded > 0).tolist() == [True, True, False]
    assert model.layers[0].q.fp8_amax_recorded.tolist() == [-1, -1, -1]


@pytest.mark.slow  # torch.compile with fullgraph: about 25 s on 2 cores
def test_autowrapped_model_compiles_fullgraph():
    model = decoder()
    fp8plug.convert_model(model, recipe=native())
    fp8plug.apply_fp8_autowrap(model, native())
    compiled = torch.compile(model, fullgraph=True)
    tokens = torch.randint(0, 64, (2, 16))
    compiled(tokens).float().logsumexp(-1).mean().backward()
    assert (model.layers[0].q.fp8_amax_recorded > 0).all()  # forward and backward recorded
    fp8plug.sync_fp8_scaling(model)
    assert model.layers[0].q.fp8_step.tolist() == [1, 1, 1]


def test_convert_model_passes_the_linear_and_norm_choice_to_the_engine(monkeypatch):
    """convert_model(_convert_linear, _convert_ln) reaches every engine through its convert: an
    engine of Linears only converts nothing without _convert_linear; TransformerEngine, which
    converts norms too, is told both choices."""
    model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32))
    report = fp8plug.convert_model(model, _convert_linear=False, backend="native")
    assert report.backend == "native" and report.converted == []
    assert type(model[0]) is nn.Linear
    report = fp8plug.convert_model(model, _convert_ln=False, backend="native")
    assert report.converted == ["0"] and isinstance(model[0], NativeFP8Linear)

    from fp8plug.api import convert_with_plan
    from fp8plug.backends.te.engine import TEEngine
    from fp8plug.layers.rules import ConversionReport
    from fp8plug.recipe.plans import Plan

    calls = []
    monkeypatch.setattr(TEEngine, "convert", lambda self, model, plan, linear=True, norm=True:
                        calls.append((linear, norm)) or ConversionReport("te"))
    convert_with_plan(model, TEEngine(), Plan(skip_causal_mask=False), linear=True, norm=False)
    convert_with_plan(model, TEEngine(), Plan(skip_causal_mask=False), linear=False, norm=True)
    assert calls == [(True, False), (False, True)]
