"""The output head (lm_head) and FP8RecipeKwargs.fp8_output_head, on the CPU with tiny models.

Checked: the default keeps a transformers model's head in high precision (report kind and reason,
summary, GEMM coverage) whichever way the model is converted: fp8plug.Accelerator and
fp8plug.convert_model, with or without a recipe, decide it alike, with the same engine;
fp8_output_head=True / False decide on every path, from an argument or the environment; the head
is found through get_output_embeddings() in a PeftModel wrapper and in a model held inside another
module, by the name `lm_head` in a plain module, and a model with no head is left as it was.
"""

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs
from fp8plug.backends.native.engine import NativeFP8Linear
from fp8plug.layers.output_head import output_head_fqns
from fp8plug.layers.rules import IGNORED, OUTPUT_HEAD, OUTPUT_HEAD_REASON
from fp8plug.recipe.plans import make_plan
from fp8plug.tuning.hardware import DeviceInfo
from tests.support.hf import VOCAB, tiny_llama

CPU = DeviceInfo("cpu", "cpu")
NATIVE = dict(backend="native", auto_filter=False)


def accelerated(model, recipe):
    """`model` prepared by fp8plug.Accelerator on the CPU with `recipe`: (model, optimizer, accelerator)."""
    accelerator = fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[recipe])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, accelerator


def is_fp8(module) -> bool:
    return isinstance(module, NativeFP8Linear)


def test_the_accelerator_keeps_lm_head_in_high_precision_by_default():
    model, optimizer, accelerator = accelerated(tiny_llama(), FP8RecipeKwargs(**NATIVE))
    (report,) = accelerator.fp8_reports
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    assert report.kinds["lm_head"] == OUTPUT_HEAD and report.skipped["lm_head"] == OUTPUT_HEAD_REASON
    assert OUTPUT_HEAD_REASON.startswith("the output head stays in high precision (FP8RecipeKwargs.fp8_output_head)")
    assert len(report.fp8_linears) == 14 and "lm_head" not in report.fp8_linears
    assert ("14 of 15 Linear layers run in FP8; in high precision: 1 output head "
            "(lm_head: fp8_output_head=True runs it in FP8)") in report.summary()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    coverage = accelerator.fp8_coverage()
    assert "lm_head" not in coverage["layers"] and len(coverage["layers"]) == 14
    assert coverage["fp8_gemms"] == 14 and coverage["high_precision_gemms"] == 0


@pytest.mark.parametrize("recipe", [None, FP8RecipeKwargs(backend="native")], ids=["no recipe", "native recipe"])
def test_convert_model_keeps_lm_head_in_high_precision_too(recipe):
    model = tiny_llama()
    report = fp8plug.convert_model(model, recipe=recipe) if recipe else fp8plug.convert_model(model)
    assert report.kinds["lm_head"] == OUTPUT_HEAD and "lm_head" not in report.converted
    assert type(model.lm_head) is nn.Linear
    assert len(report.fp8_linears) == 14


def test_both_ways_in_decide_the_head_and_the_engine_alike():
    """The same model and the same default recipe through convert_model and through the
    Accelerator: the same engine (the automatic choice), the same modules converted, the head kept
    in high precision by both."""
    by_hand = tiny_llama()
    report = fp8plug.convert_model(by_hand, recipe=FP8RecipeKwargs())
    _, _, accelerator = accelerated(tiny_llama(), FP8RecipeKwargs())
    (prepared,) = accelerator.fp8_reports
    assert report.backend == prepared.backend == accelerator.fp8_engine.name
    assert report.converted == prepared.converted and report.kinds == prepared.kinds
    assert report.kinds["lm_head"] == OUTPUT_HEAD and type(by_hand.lm_head) is nn.Linear


@pytest.mark.parametrize("fp8_output_head", [True, False])
def test_fp8_output_head_decides_on_both_paths(fp8_output_head):
    model, _, accelerator = accelerated(tiny_llama(), FP8RecipeKwargs(fp8_output_head=fp8_output_head, **NATIVE))
    assert is_fp8(model.lm_head) is fp8_output_head
    assert ("lm_head" in accelerator.fp8_reports[0].converted) is fp8_output_head
    model = tiny_llama()
    report = fp8plug.convert_model(model, recipe=FP8RecipeKwargs(fp8_output_head=fp8_output_head, **NATIVE))
    assert is_fp8(model.lm_head) is fp8_output_head
    assert (report.kinds.get("lm_head") == OUTPUT_HEAD) is not fp8_output_head
    assert is_fp8(model.model.layers[0].self_attn.q_proj)  # the rest converts either way


@pytest.mark.parametrize("variable", ["FP8PLUG_FP8_OUTPUT_HEAD", "ACCELERATE_FP8_OUTPUT_HEAD"])
def test_fp8_output_head_from_the_environment(monkeypatch, variable):
    monkeypatch.setenv(variable, "true")
    recipe = FP8RecipeKwargs(**NATIVE)
    assert recipe.fp8_output_head is True and not recipe.is_explicit("fp8_output_head")
    engine = fp8plug.get_backend("native")
    assert make_plan(engine, recipe, CPU).keep_output_head is False
    assert FP8RecipeKwargs(fp8_output_head=False).fp8_output_head is False  # an argument beats the environment
    monkeypatch.setenv(variable, "auto")
    assert FP8RecipeKwargs().fp8_output_head is None
    monkeypatch.setenv(variable, "sometimes")
    with pytest.raises(ValueError, match=rf"FP8RecipeKwargs\.fp8_output_head \(from {variable}\): 'sometimes'"):
        FP8RecipeKwargs()


def test_the_plan_keeps_the_head_unless_asked_and_no_engine_calls_it_ignored(recwarn):
    for name in ("native", "ao", "te", "msamp"):
        engine = fp8plug.get_backend(name)
        try:
            default_plan = make_plan(engine, FP8RecipeKwargs(backend=name), CPU)
        except (ValueError, fp8plug.BackendUnavailableError):  # an engine that cannot plan on this machine
            continue
        assert default_plan.keep_output_head is True
        assert make_plan(engine, FP8RecipeKwargs(backend=name, fp8_output_head=True), CPU).keep_output_head is False
        assert make_plan(engine, FP8RecipeKwargs(backend=name, fp8_output_head=False), CPU).keep_output_head is True
    assert not [w for w in recwarn if "fp8_output_head" in str(w.message)]


def test_modules_to_ignore_naming_the_head_too_is_no_error():
    model, _, accelerator = accelerated(tiny_llama(), FP8RecipeKwargs(modules_to_ignore=["lm_head"], **NATIVE))
    assert accelerator.fp8_reports[0].kinds["lm_head"] == IGNORED and type(model.lm_head) is nn.Linear


def test_a_model_converted_by_hand_then_prepared_keeps_its_fp8_head():
    """Converted by hand with the head in FP8 (fp8_output_head=True), then prepared with the default:
    still the same conversion (Plan.keep_output_head is not compared), so prepare() takes the model
    as converted instead of refusing it."""
    model = tiny_llama()
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(fp8_output_head=True, **NATIVE))
    model, _, accelerator = accelerated(model, FP8RecipeKwargs(**NATIVE))
    report = accelerator.fp8_reports[0]
    assert is_fp8(model.lm_head) and report.kinds["lm_head"] == "already converted"
    assert len(report.fp8_linears) == 15


def test_a_peft_wrapped_model_keeps_its_head():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    assert output_head_fqns(model) == {"base_model.model.lm_head"}
    model, _, accelerator = accelerated(model, FP8RecipeKwargs(**NATIVE))
    report = accelerator.fp8_reports[0]
    assert report.kinds["base_model.model.lm_head"] == OUTPUT_HEAD
    assert type(model.base_model.model.lm_head) is nn.Linear
    assert is_fp8(model.base_model.model.model.layers[0].mlp.up_proj.base_layer)


def test_a_lora_wrapped_head_keeps_its_base_layer():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=8, target_modules=["q_proj", "lm_head"]))
    assert output_head_fqns(model) == {"base_model.model.lm_head.base_layer"}


class Holder(nn.Module):
    """A transformers model held inside a module of the user's (a reward model, a distillation pair)."""

    def __init__(self):
        super().__init__()
        self.llm = tiny_llama()
        self.score = nn.Linear(64, 16)


class PlainLM(nn.Module):
    """No transformers: a head found by its name."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.lm_head = nn.Linear(32, 64)

    def forward(self, x):
        return self.lm_head(self.body(x))


class NoHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def get_output_embeddings(self):  # as a transformers base model without a head answers
        return None

    def forward(self, x):
        return self.down(self.up(x))


class Raises(NoHead):
    def get_output_embeddings(self):
        raise NotImplementedError("no head")


def test_the_head_is_found_inside_another_module_and_by_name():
    assert output_head_fqns(Holder()) == {"llm.lm_head"}
    assert output_head_fqns(PlainLM()) == {"lm_head"}
    model, _, accelerator = accelerated(PlainLM(), FP8RecipeKwargs(**NATIVE))
    assert accelerator.fp8_reports[0].kinds["lm_head"] == OUTPUT_HEAD and type(model.lm_head) is nn.Linear
    assert is_fp8(model.body[0]) and is_fp8(model.body[2])
    assert fp8plug.convert_model(PlainLM(), recipe=FP8RecipeKwargs(**NATIVE)).kinds["lm_head"] == OUTPUT_HEAD
    asked = FP8RecipeKwargs(fp8_output_head=True, **NATIVE)
    assert "lm_head" in fp8plug.convert_model(PlainLM(), recipe=asked).converted


@pytest.mark.parametrize("cls", [NoHead, Raises])
def test_a_model_with_no_head_converts_every_linear(cls):
    assert output_head_fqns(cls()) == frozenset()
    model, _, accelerator = accelerated(cls(), FP8RecipeKwargs(**NATIVE))
    assert sorted(accelerator.fp8_reports[0].converted) == ["down", "up"] and not accelerator.fp8_reports[0].skipped


def test_an_already_converted_head_is_still_the_head():
    model = tiny_llama()
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(fp8_output_head=True, **NATIVE))
    assert output_head_fqns(model) == {"lm_head"}
