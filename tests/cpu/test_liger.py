"""Liger kernels and FP8 conversion on the CPU (fp8plug.layers.fused_heads, layers.rules.decide_modules).

Checked without liger-kernel (CI has no triton, so it cannot import it): a model whose forward is
a function of the `liger_kernel` package, bound on the instance or on the class, or under a
wrapper, gets its output head left unconverted and named in the report and the log line with
Liger's reason, every other Linear converted; a PEFT-wrapped one too; a model without such a
forward converts exactly as before.

Checked with the real liger-kernel where it imports (skipped otherwise): after
`apply_liger_kernel_to_llama` (instance or class patch) lm_head is reported and every Linear of
LigerSwiGLUMLP converted; and, with Liger's two triton kernels the CPU cannot run (SiLU-and-multiply,
the fused loss's cross-entropy) swapped for torch equivalents, Liger's own forwards train a step:
lm_head's forward never runs in training (its weight is read directly), the MLP's Linears run as
modules in FP8 (counted), and the loss is the same one a plain forward computes.

And TRL's fused LM head (trl's add_fused_lm_head, which its trainers add), the same direct reading
of lm_head.weight without Liger: lm_head reported, never called in a fused_lm_head=True step.
"""

import functools
import logging
import types

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug.layers.fused_heads import liger_forward, liger_fused_heads
from fp8plug.layers.rules import ADAPTER, LIGER
from tests.support.hf import tiny_llama

# the head asked for in FP8, so that what keeps it in high precision here is the fused loss alone
RECIPE = fp8plug.FP8RecipeKwargs(backend="native", auto_filter=False, fp8_output_head=True)
LIGER_MODULE = "liger_kernel.transformers.model.llama"
SPEC = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128, seq=32, batch=4)


def lookalike_forward(self, input_ids=None, labels=None, **kwargs):
    """Stands for Liger's lce_forward: only where it is defined matters to the detection."""
    raise AssertionError("never called: these tests convert only")


lookalike_forward.__module__ = LIGER_MODULE


def convert(model, caplog=None):
    if caplog is None:
        return fp8plug.convert_model(model, recipe=RECIPE)
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        report = fp8plug.convert_model(model, recipe=RECIPE)
    # the conversion's one line (the attention switch logs its own line once per model class and process)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "fp8plug" and r.levelno == logging.INFO
               and "Linear layers" in r.getMessage()]
    return report, line


def linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def assert_head_reported(report, names, head="lm_head", owner="LlamaForCausalLM"):
    assert report.kinds[head] == LIGER
    why = report.skipped[head]
    assert "read directly by Liger's fused linear cross-entropy" in why and "stays in high precision" in why
    assert f"{owner}'s forward is Liger's" in why
    assert report.high_precision_linears == {head: why}
    assert sorted(report.fp8_linears) == sorted(n for n in names if n != head)


# --- the signal, without liger-kernel ----------------------------------------------------------------


def test_a_liger_forward_on_the_instance_leaves_lm_head_in_high_precision_with_its_reason(caplog):
    model = tiny_llama()
    names = linears(model)
    model.forward = types.MethodType(lookalike_forward, model)  # what apply_liger_kernel_to_llama(model=m) does
    report, line = convert(model, caplog)
    assert_head_reported(report, names)
    assert f"14 of 15 Linear layers run in FP8; in high precision: 1 {LIGER} (lm_head)" in line
    assert isinstance(model.lm_head, nn.Linear) and type(model.model.layers[0].mlp.down_proj) is not nn.Linear


def test_a_liger_forward_on_the_class_or_under_a_wrapper_is_found():
    from transformers import LlamaForCausalLM

    model = tiny_llama()
    names = linears(model)
    # a class patch (apply_liger_kernel_to_llama() without model=), on a subclass so transformers is untouched
    model.__class__ = type("LlamaForCausalLM", (LlamaForCausalLM,), {"forward": lookalike_forward})
    assert_head_reported(convert(model), names)

    @functools.wraps(lookalike_forward)
    def wrapper(*args, **kwargs):  # e.g. a decorator that keeps __wrapped__ but not the module
        return lookalike_forward(*args, **kwargs)

    wrapper.__module__ = "somewhere.else"
    other = tiny_llama()
    other.forward = types.MethodType(wrapper, other)
    assert liger_forward(other) == "lookalike_forward"
    assert list(liger_fused_heads(other)) == ["lm_head"]


def test_the_head_is_found_through_get_output_embeddings_and_under_peft():
    peft = pytest.importorskip("peft")

    class Outer(nn.Module):  # like Liger's PaliGemma forward, which reads language_model.lm_head
        def __init__(self):
            super().__init__()
            self.language_model = tiny_llama()

        def get_output_embeddings(self):
            return self.language_model.lm_head

    Outer.forward = lookalike_forward
    assert list(liger_fused_heads(Outer())) == ["language_model.lm_head"]

    model = tiny_llama()
    model.forward = types.MethodType(lookalike_forward, model)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    report = convert(wrapped)
    assert report.kinds["base_model.model.lm_head"] == LIGER
    assert sum(kind == ADAPTER for kind in report.kinds.values()) == 28
    assert len(report.fp8_linears) == 14 and all(n.endswith("base_layer") for n in report.fp8_linears)


def test_without_liger_every_linear_converts_as_before():
    model = tiny_llama()
    model.forward = types.MethodType(type(model).forward, model)  # a bound forward that is transformers' own
    assert liger_forward(model) is None and liger_fused_heads(model) == {}
    report = convert(model)
    assert len(report.fp8_linears) == 15 and "lm_head" in report.fp8_linears and not report.skipped

    class LigerNormLike(nn.Module):  # a Liger module without a head (LigerRMSNorm, LigerSwiGLUMLP): nothing to skip
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

    LigerNormLike.forward = lookalike_forward
    assert liger_fused_heads(nn.Sequential(LigerNormLike())) == {}


# --- the real liger-kernel, where it imports ---------------------------------------------------------


@pytest.fixture
def liger():
    return pytest.importorskip("liger_kernel.transformers")


@pytest.mark.parametrize("how", ["instance", "class"])
def test_real_liger_patch_leaves_lm_head_and_converts_the_swiglu_linears(liger, monkeypatch, how):
    from tests.support.liger import apply_liger, small_llama

    if how == "class":
        apply_liger(monkeypatch)  # patches the classes: the model built after it is Liger's
        model = small_llama(SPEC)
    else:
        model = apply_liger(monkeypatch, small_llama(SPEC))
    mlp = model.model.layers[0].mlp
    assert "Liger" in mlp._get_name() and "Liger" in type(model.model.norm).__name__ + model.model.norm._get_name()
    names = linears(model)
    report = convert(model)
    assert_head_reported(report, names)
    mlp_linears = [f"model.layers.{i}.mlp.{p}" for i in range(SPEC["layers"])
                   for p in ("gate_proj", "up_proj", "down_proj")]
    assert set(mlp_linears) <= set(report.fp8_linears)
    assert model.model.layers[0].mlp is mlp and type(mlp.gate_proj) is not nn.Linear  # Liger's MLP, FP8 Linears


def test_real_liger_forwards_read_lm_head_weight_and_call_the_mlp_linears(liger, monkeypatch):
    """One FP8 training step through Liger's own lce_forward and LigerSwiGLUMLP.forward, with the
    triton kernels (the CPU has none) swapped for torch: what Liger calls and reads is Liger's."""
    import liger_kernel.transformers.functional as liger_functional
    import liger_kernel.transformers.swiglu as liger_swiglu

    from tests.support.liger import batches, train_with_liger

    def silu_mul(a, b, *args):
        return nn.functional.silu(a) * b

    def fused_linear_cross_entropy(input, weight, target, bias=None, ignore_index=-100, reduction="mean", **_):
        logits = input @ weight.t() + (bias if bias is not None else 0)
        return nn.functional.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction)

    monkeypatch.setattr(liger_swiglu, "_swiglu_dispatch", silu_mul)
    monkeypatch.setattr(liger_functional, "liger_fused_linear_cross_entropy", fused_linear_cross_entropy)
    options = dict(rope=False, rms_norm=False)  # triton only; not what this test is about
    out = train_with_liger(monkeypatch, SPEC, 2, fp8=True, device="cpu", recipe=RECIPE, liger_options=options)
    assert out["lm_head_training_calls"] == 0  # Liger's loss read lm_head.weight instead
    assert_head_reported(out["report"], out["linears"])
    layers = out["coverage"]["layers"]
    assert sorted(layers) == sorted(n for n in out["linears"] if n != "lm_head")
    assert all(layers[n] == (2, 0) for n in layers if ".mlp." in n)  # called as modules, in FP8, each step

    # the loss Liger's forward gives is the loss of the plain forward on the same model
    model, ids = out["model"], batches(SPEC, 1)[0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        liger_loss = model(input_ids=ids, labels=ids).loss
        model.eval()  # eval: Liger's forward materialises logits through lm_head (a plain Linear)
        logits = model(input_ids=ids).logits
    plain = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    assert liger_loss.item() == pytest.approx(plain.item(), rel=2e-2)


# --- TRL's fused LM head: the same reading of lm_head.weight, without Liger --------------------------


def test_trl_fused_lm_head_is_reported_and_never_calls_lm_head():
    """TRL's trainers (SFT, DPO, GRPO, KTO, RLOO) add `add_fused_lm_head` and call the model with
    fused_lm_head=True: the head's weight goes to TRL's chunked log-prob op, never through lm_head."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(trl_utils, "add_fused_lm_head"):
        pytest.skip("this trl has no fused LM head")
    from fp8plug.layers.rules import TRL_FUSED

    model = tiny_llama()
    names = linears(model)
    trl_utils.add_fused_lm_head(model)
    report = convert(model)
    assert report.kinds["lm_head"] == TRL_FUSED
    assert "read directly by TRL's fused LM head" in report.skipped["lm_head"]
    assert sorted(report.fp8_linears) == sorted(n for n in names if n != "lm_head")
    calls = []
    model.lm_head.register_forward_hook(lambda *args: calls.append(1))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids, fused_lm_head=True).loss
    loss.backward()
    assert torch.isfinite(loss) and not calls and model.lm_head.weight.grad is not None
    assert fp8plug.fp8_coverage(model)["high_precision_gemms"] == 0
