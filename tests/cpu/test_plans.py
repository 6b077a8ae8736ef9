"""The recipe -> plan contract (fp8plug.recipe.plans): each engine declares the recipe fields it honours and
turns a recipe into its own frozen plan once; the field it ignores is warned about once, in one
wording, whatever the engine; no engine reads the recipe's explicitness or the environment."""

import ast
import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs
from fp8plug.backends import get_backend
from fp8plug.backends.base import Engine
from fp8plug.recipe.kwargs import BACKENDS, DEFAULTS, field_names
from fp8plug.recipe.plans import SHARED, Plan, Settings, make_plan
from fp8plug.tuning.hardware import DeviceInfo

CPU = DeviceInfo("cpu", "cpu")
BACKENDS_DIR = Path(fp8plug.__file__).resolve().parent / "backends"
# Two valid values per field an engine may ignore: the test passes the one that changes something.
VALUES = {
    "use_autocast_during_eval": (True, False),
    "opt_level": ("O1", "O2"),
    "margin": (1, 0),
    "interval": (2, 1),
    "fp8_format": ("E4M3", "HYBRID"),
    "amax_history_len": (16, 1024),
    "amax_compute_algo": ("max", "most_recent"),
    "override_linear_precision": ((False, False, True), (False, False, False)),
    "enable_fsdp_float8_all_gather": (True, False),
    "pad_inner_dim": (True, False),
    "reduce_amax": (False, True),
}
ONE_WORDING = r"^FP8RecipeKwargs\.{name}=.+ is ignored by backend '{engine}'( with scaling='\w+')?: .+\.$"


def plan_for(name, **fields):
    return make_plan(get_backend(name), FP8RecipeKwargs(backend=name, **fields), CPU)


@pytest.mark.parametrize("name", BACKENDS)
def test_every_engine_makes_its_own_frozen_typed_plan(name):
    engine = get_backend(name)
    plan = plan_for(name)
    assert type(plan) is engine.plan_class and issubclass(engine.plan_class, Plan)
    assert plan.scaling == engine.scalings[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.scaling = "other"
    assert engine.plan_of(plan) is plan  # a plan passes through; a recipe would be made into one


@pytest.mark.parametrize("name", BACKENDS)
def test_declared_fields_are_recipe_fields_and_scalings_the_engines(name):
    engine = get_backend(name)
    assert set(engine.honours_by_scaling) <= set(engine.scalings)
    for scaling in engine.scalings:
        assert engine.honoured(scaling) <= set(field_names()) - SHARED, scaling


def _ignored_fields(engine, scaling):
    return [f for f in VALUES if f not in engine.honoured(scaling) | SHARED]


@pytest.mark.parametrize("name", BACKENDS)
def test_an_ignored_field_passed_warns_once_in_one_wording(name):
    engine = get_backend(name)
    scaling = engine.scalings[0]
    ignored = _ignored_fields(engine, scaling)
    assert ignored, name
    for field in ignored:
        value = next(v for v in VALUES[field] if v != engine.acts_as(field, scaling))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan_for(name, **{field: value})
        messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        assert len(messages) == 1, (field, messages)
        assert re.match(ONE_WORDING.format(name=field, engine=name), messages[0]), messages[0]


@pytest.mark.parametrize("name", BACKENDS)
def test_ignored_fields_at_what_the_engine_does_anyway_or_from_the_environment_say_nothing(name, monkeypatch):
    engine = get_backend(name)
    scaling = engine.scalings[0]
    quiet = {f: engine.acts_as(f, scaling) for f in _ignored_fields(engine, scaling)}
    monkeypatch.setenv("ACCELERATE_FP8_MARGIN", "3")  # `accelerate launch` exports these whatever the backend
    monkeypatch.setenv("ACCELERATE_FP8_OPT_LEVEL", "O1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_for(name, **quiet)


def test_the_plan_is_made_once_and_conversion_and_autocast_take_only_it():
    with pytest.warns(UserWarning, match="opt_level='O1' is ignored by backend 'native'") as caught:
        plan = plan_for("native", opt_level="O1", margin=2, scaling="delayed")
    assert len(caught) == 1
    engine = get_backend("native")
    model = nn.Sequential(nn.Linear(32, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing read again, nothing warned again
        report = engine.convert(model, plan)
        with engine.autocast(plan, enabled=True):
            model(torch.randn(16, 32)).sum().backward()
    assert report.converted == ["0"] and model[0].margin == 2


def test_settings_give_an_engine_only_the_fields_it_declares():
    class Declares(Engine):
        name, title, scalings = "native", "declaring", ("delayed",)
        honours = frozenset({"margin"})
        seen = {}

        def make_plan(self, settings: Settings) -> Plan:
            self.seen["margin"] = settings.margin
            self.seen["argument"] = settings.argument("margin")
            with pytest.raises(AttributeError, match="does not declare 'interval'"):
                settings.interval  # noqa: B018 - undeclared: refused
            return Plan()

    with pytest.warns(UserWarning, match=r"interval=4 is ignored by backend 'native': it only applies to delayed"):
        plan = make_plan(Declares(), FP8RecipeKwargs(margin=3, interval=4), CPU, auto_filter=False)
    assert Declares.seen == {"margin": 3, "argument": 3} and plan.scaling == "delayed"


def test_the_shared_part_of_a_plan_comes_from_the_recipe():
    keep = lambda module, fqn: fqn != "b"  # noqa: E731
    plan = plan_for("native", modules_to_ignore=["a"], module_filter_fn=keep, use_autocast_during_eval=True)
    assert (plan.modules_to_ignore, plan.module_filter_fn, plan.use_autocast_during_eval) == (("a",), keep, True)
    assert plan_for("native").optimizer_states is None


def test_the_accelerator_keeps_one_plan_and_hands_it_on(monkeypatch):
    engine = get_backend("native")
    seen = []
    original = engine.convert_listed
    monkeypatch.setattr(engine, "convert_listed",
                        lambda model, plan, *args: seen.append(plan) or original(model, plan, *args))
    accelerator = fp8plug.Accelerator(mixed_precision="fp8", cpu=True,
                                      kwargs_handlers=[FP8RecipeKwargs(backend="native", margin=2)])
    assert type(accelerator.fp8_plan).__name__ == "NativePlan" and accelerator.fp8_plan.margin == 2
    model = accelerator.prepare(nn.Sequential(nn.Linear(32, 32)))
    assert seen == [accelerator.fp8_plan]
    assert accelerator.unwrap_model(model)[0].margin == 2


def test_no_engine_reads_explicitness_private_recipe_fields_or_the_environment():
    """A source scan of fp8plug/backends: the recipe is read for an engine in fp8plug.recipe.plans only.
    te/imports.py alone touches os.environ, for CUDNN_PATH (which cuDNN TransformerEngine loads:
    the process's libraries, not a recipe setting)."""
    found = []
    for path in sorted(BACKENDS_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in ("is_explicit", "_explicit_fields", "_sources", "_resolved"):
                found.append(f"{path.name}: {name}")
            if name in ("environ", "getenv") and path.relative_to(BACKENDS_DIR).as_posix() != "te/imports.py":
                found.append(f"{path.name}: os.{name}")
    assert found == []


def test_the_defaults_a_plan_falls_back_to_are_the_recipes():
    native = plan_for("native", scaling="dynamic")
    assert (native.margin, native.amax_history_len) == (DEFAULTS["margin"], DEFAULTS["amax_history_len"])
