"""A conversion in three stages (fp8plug.conversion): the plan says, before anything changes, what
each module will be and why; applying it does exactly that and asks nothing of selection or
planning; and what the log and the report count is named (Linear layers, norms), the same for
convert_model and fp8plug.Accelerator. On the CPU, native engine, a tiny transformers Llama (its
RMSNorms are Llama-style, so the native engine takes them over too)."""

import logging

import torch
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs, api, get_backend
from fp8plug.conversion import plan as planning
from fp8plug.conversion.apply import apply_plan
from fp8plug.conversion.plan import CONVERTED_WITH, plan_model
from fp8plug.hf import experts
from fp8plug.layers import rules
from fp8plug.layers.rules import OUTPUT_HEAD
from fp8plug.recipe.plans import make_plan
from fp8plug.tuning.hardware import DeviceInfo
from tests.support.hf import tiny_llama

CPU = DeviceInfo("cpu", "cpu")
NATIVE = dict(backend="native", auto_filter=False)
NORMS = ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
         "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"]


def native_plan(**fields):
    engine = get_backend("native")
    return engine, make_plan(engine, FP8RecipeKwargs(**NATIVE, **fields), CPU)


def test_the_plan_decides_every_module_and_changes_nothing():
    model = tiny_llama()
    before = {fqn: (type(m), m) for fqn, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine, plan = native_plan(modules_to_ignore=["model.layers.1.mlp.down_proj"])
    conversion = plan_model(model, engine, plan)
    assert {fqn: (type(m), m) for fqn, m in model.named_modules()} == before
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert CONVERTED_WITH not in model.__dict__
    decisions = {d.fqn: d for d in conversion.modules.decisions}
    assert decisions["lm_head"].kind == OUTPUT_HEAD and not decisions["lm_head"].converts
    assert decisions["model.layers.1.mlp.down_proj"].reason == "listed in modules_to_ignore"
    assert [d.fqn for d in conversion.modules.targets if not d.linear] == NORMS
    assert sum(d.linear and d.converts for d in conversion.modules.decisions) == 13
    assert conversion.settings["backend"] == "native" and conversion.experts == ()


def test_applying_does_what_the_plan_says_and_asks_nothing_of_planning(monkeypatch):
    model = tiny_llama()
    engine, plan = native_plan()
    conversion = plan_model(model, engine, plan)

    def asked(*args, **kwargs):
        raise AssertionError("applying a plan decided something again")

    for owner, name in ((rules, "decide_modules"), (experts, "decide_experts"), (planning, "plan_model"),
                        (api, "select_for"), (api, "make_plan"), (type(engine), "eligible")):
        monkeypatch.setattr(owner, name, asked)
    report = apply_plan(model, conversion)
    assert report.converted == [d.fqn for d in conversion.modules.targets]
    assert all(engine.is_converted(model.get_submodule(fqn)) for fqn in report.converted)
    assert type(model.lm_head) is nn.Linear and report.kinds["lm_head"] == OUTPUT_HEAD
    assert model.__dict__[CONVERTED_WITH] == dict(conversion.settings)


def conversion_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "Linear layers" in r.getMessage()]


def test_the_report_and_the_log_name_what_they_count(caplog):
    """convert_model and the Accelerator say "14 Linear layers and 5 norms", never "19 module(s)"."""
    with caplog.at_level(logging.DEBUG, logger="fp8plug"):
        report = fp8plug.convert_model(tiny_llama(), recipe=FP8RecipeKwargs(**NATIVE))
    assert str(report).splitlines()[0] == "native: converted 14 Linear layers and 5 norms, skipped 1 Linear layer"
    assert report.norms == NORMS
    (line,) = conversion_lines(caplog)
    assert "14 of 15 Linear layers run in FP8" in line and "also converted 5 norms (" in line
    caplog.clear()
    accelerator = fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(**NATIVE)])
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        accelerator.prepare(tiny_llama())
    (prepared,) = accelerator.fp8_reports
    assert str(prepared) == str(report)
    (line,) = conversion_lines(caplog)
    assert "14 of 15 Linear layers run in FP8" in line and "also converted 5 norms (" in line
    assert "module(s)" not in line + str(prepared)
