"""fp8plug.integrations.float8's entry points take convert_model's one path.

Why: they used to hand torchao or native configs straight to the engines, so a Float8Config or a
convert_to_float8_training call skipped the recipe check and the speed filter that every other
way in gets. Now each builds an FP8RecipeKwargs and calls fp8plug.convert_model: these tests
watch that path's stops (make_plan, the speed filter, the engine's convert, the log line) and
pin what the recipe says for each config. Also: no fp8plug class answers to torchao's names any
more, except as a deprecated alias.
"""

import logging
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

import torchao.float8  # noqa: E402

import fp8plug  # noqa: E402
import fp8plug.api  # noqa: E402
import fp8plug.integrations.float8 as float8
import fp8plug.recipe.plans
from fp8plug import FP8RecipeKwargs  # noqa: E402
from fp8plug.backends import get_backend  # noqa: E402
from fp8plug.backends.base import Engine  # noqa: E402
from fp8plug.integrations.float8 import (
    AOFloat8LinearConfig,
    DelayedScalingConfig,
    Float8CastConfig,
    Float8Config,
    Float8ScalingType,
    Float8TrainingConfig,
    convert_to_float8_training,
)

DELAYED = Float8TrainingConfig(
    cast_config_input=Float8CastConfig(Float8ScalingType.DYNAMIC),
    cast_config_weight=Float8CastConfig(Float8ScalingType.DELAYED),
    cast_config_grad_output=Float8CastConfig(Float8ScalingType.DELAYED),
    delayed_scaling_config=DelayedScalingConfig(history_len=4),
)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Linear(64, 128)
        self.w2 = nn.Linear(128, 64)
        self.output = nn.Linear(64, 16)

    def forward(self, x):
        return self.output(self.w2(torch.relu(self.w1(x))))


# (name, how to convert a model, the engine, the scaling the recipe resolves to)
ENTRY_POINTS = [
    ("Float8Config()", lambda m: Float8Config().apply_float8_linear(m), "ao", "tensorwise"),
    ("Float8Config(ao_recipe)", lambda m: Float8Config(ao_recipe="rowwise").apply_float8_linear(m), "ao", "rowwise"),
    ("Float8Config(ao)", lambda m: Float8Config(ao=AOFloat8LinearConfig(round_scales_to_power_of_2=True))
     .apply_float8_linear(m), "ao", "tensorwise"),
    ("seed dynamic", lambda m: convert_to_float8_training(m), "ao", "tensorwise"),
    ("seed torchao config", lambda m: convert_to_float8_training(
        m, config=torchao.float8.Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")),
     "ao", "rowwise_with_gw_hp"),
    ("seed delayed", lambda m: convert_to_float8_training(m, config=DELAYED),
     "native", ("dynamic", "delayed", "delayed")),
]
IDS = [entry[0] for entry in ENTRY_POINTS]


@pytest.mark.parametrize("name, convert, engine_name, scaling", ENTRY_POINTS, ids=IDS)
def test_each_entry_point_checks_the_recipe_filters_converts_and_logs(name, convert, engine_name, scaling,
                                                                     monkeypatch, caplog):
    """The engine makes its plan from the recipe (and refuses what it cannot do), the speed filter
    is asked, the engine converts with what it left, and one INFO line names the engine and the
    scaling: convert_model's stops, in order (fp8plug.recipe.plans.make_plan, fp8plug.conversion.apply)."""
    engine = get_backend(engine_name)
    stops = []
    make = engine.make_plan
    monkeypatch.setattr(engine, "make_plan", lambda settings: (stops.append(("plan", settings)), make(settings))[1])

    def speed_filter(recipe, backend, device):  # as if the cost model left w2 in bf16
        stops.append(("filter", recipe))
        return lambda m, fqn: fqn != "w2"

    monkeypatch.setattr(fp8plug.recipe.plans, "speed_filter", speed_filter)
    monkeypatch.setenv("FP8PLUG_AUTO_FILTER", "true")  # the recipe asks for the filter, as convert_model reads it
    model = Model()
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        convert(model)
    assert [stop for stop, _ in stops] == ["plan", "filter"]
    settings, recipe = stops[0][1], stops[1][1]
    assert settings.engine == recipe.backend == engine_name
    assert (recipe.scaling or engine.scaling_name(None)) == scaling or recipe.ao_config is not None
    assert engine.is_converted(model.w1) and type(model.w2) is nn.Linear  # the filter's choice was applied
    (line,) = [r.getMessage() for r in caplog.records if r.name == "fp8plug" and r.levelno == logging.INFO]
    scaling_text = "/".join(scaling) if isinstance(scaling, tuple) else scaling
    assert line.startswith(f"fp8plug: FP8 with {engine_name} (") and f"{scaling_text} scaling" in line, line


@pytest.mark.parametrize("name, convert, engine_name, scaling", ENTRY_POINTS, ids=IDS)
def test_auto_filter_true_is_honoured_as_by_convert_model(name, convert, engine_name, scaling, monkeypatch):
    """FP8PLUG_AUTO_FILTER=true reaches the float8 entry points: on this CPU there is no cost model,
    so they refuse exactly as convert_model does, instead of converting without the filter."""
    monkeypatch.setenv("FP8PLUG_AUTO_FILTER", "true")
    with pytest.raises(ValueError, match="FP8RecipeKwargs.auto_filter: no calibrated cost model"):
        fp8plug.convert_model(Model(), backend=engine_name)
    model = Model()
    with pytest.raises(ValueError, match="FP8RecipeKwargs.auto_filter: no calibrated cost model"):
        convert(model)
    assert all(type(m) is nn.Linear for m in model.children())  # refused before anything converted


def test_the_recipes_say_what_the_configs_say():
    rowwise = Float8Config(ao_recipe="rowwise", modules_to_ignore=["output"]).to_recipe(modules_to_ignore=["w2"])
    assert (rowwise.backend, rowwise.scaling, rowwise.ao_config) == ("ao", "rowwise", None)
    assert rowwise.modules_to_ignore == ("output", "w2")
    whole = Float8Config(ao=AOFloat8LinearConfig(pad_inner_dim=True)).to_recipe()
    assert whole.backend == "ao" and whole.ao_config.pad_inner_dim and whole.scaling is None
    delayed = DELAYED.to_recipe()
    assert (delayed.backend, delayed.scaling, delayed.amax_history_len, delayed.amax_compute_algo) == (
        "native", ("dynamic", "delayed", "delayed"), 4, "max")
    uniform = Float8TrainingConfig(cast_config_input=Float8CastConfig(Float8ScalingType.DELAYED),
                                   cast_config_weight=Float8CastConfig(Float8ScalingType.DELAYED),
                                   cast_config_grad_output=Float8CastConfig(Float8ScalingType.DELAYED))
    assert uniform.to_recipe().scaling == "delayed"
    assert Float8TrainingConfig().to_recipe().ao_config is not None  # all dynamic: torchao's own config


def test_the_same_recipe_through_convert_model_gives_the_same_layers():
    ours, theirs = Model(), Model()
    Float8Config(ao_recipe="rowwise").apply_float8_linear(ours)
    fp8plug.convert_model(theirs, recipe=Float8Config(ao_recipe="rowwise").to_recipe())
    assert ours.w1.config == theirs.w1.config
    ours, theirs = convert_to_float8_training(Model(), config=DELAYED), Model()
    fp8plug.convert_model(theirs, recipe=DELAYED.to_recipe())
    assert ours.w1.scaling_modes == theirs.w1.scaling_modes == ("dynamic", "delayed", "delayed")


def test_launch_variables_do_not_change_what_a_float8_config_says(monkeypatch):
    """`accelerate launch` exports every FP8 variable; a float8 config sets every field it speaks
    for, so none of them changes its conversion (only the speed filter's is read, as above)."""
    for name, value in (("ACCELERATE_FP8_FORMAT", "E4M3"), ("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "true"),
                        ("ACCELERATE_FP8_AMAX_HISTORY_LEN", "8"), ("ACCELERATE_FP8_OVERRIDE_WGRAD", "true"),
                        ("FP8PLUG_MODULES_TO_IGNORE", "w1"), ("ACCELERATE_FP8_MARGIN", "2")):
        monkeypatch.setenv(name, value)
    tensorwise = Model()
    Float8Config(ao_recipe="tensorwise").apply_float8_linear(tensorwise)
    default = Float8Config().apply_float8_linear(Model())
    assert default.converted == ["w1", "w2", "output"]  # FP8PLUG_MODULES_TO_IGNORE=w1 not read
    assert get_backend("ao").is_converted(tensorwise.w1)
    config = tensorwise.w1.config
    assert config.cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert not config.enable_fsdp_float8_all_gather
    assert config.cast_config_grad_output_for_grad_weight.scaling_type.value == "dynamic"
    delayed = convert_to_float8_training(Model(), config=DELAYED)
    assert delayed.w1.fp8_amax_history.shape == (4, 3) and delayed.w1.margin == 0 and delayed.w1.fp8_format == "HYBRID"


def test_mxfp8_goes_through_the_recipe_too():
    from fp8plug.backends.ao.config import mx_support_problem, mx_training_config

    if mx_support_problem(emulated=True):
        pytest.skip(mx_support_problem(emulated=True))
    recipe = FP8RecipeKwargs(ao_config=mx_training_config(kernel_preference="emulated"), fp8_format="E4M3")
    with pytest.raises(ValueError, match="FP8RecipeKwargs.fp8_format: applies to torchao float8, not to an MXFP8"):
        fp8plug.convert_model(Model(), recipe=recipe)
    recipe = FP8RecipeKwargs(ao_config=mx_training_config(kernel_preference="emulated"))
    assert recipe.backend == "ao" and get_backend("ao").plan_of(recipe).describe_scaling() == "mxfp8"


def test_a_scaling_per_tensor_is_a_recipe_value_native_alone_takes():
    assert FP8RecipeKwargs(scaling=["Dynamic", "delayed", "DELAYED"]).scaling == ("dynamic", "delayed", "delayed")
    assert FP8RecipeKwargs(scaling=("dynamic",) * 3).scaling == "dynamic"
    with pytest.raises(ValueError,
                       match=r"FP8RecipeKwargs.scaling: give a name, or three as \(input, weight, grad_output\)"):
        FP8RecipeKwargs(scaling=("dynamic", "delayed"))
    model = Model()
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native", scaling=("delayed", "dynamic", "delayed")))
    assert model.w1.scaling_modes == ("delayed", "dynamic", "delayed")
    with pytest.raises(ValueError, match="is not a torchao float8 recipe"):
        fp8plug.convert_model(Model(), recipe=FP8RecipeKwargs(backend="ao", scaling=("delayed", "dynamic", "delayed")))
    with pytest.raises(ValueError, match="is not a fp8plug native"):
        fp8plug.convert_model(Model(),
                              recipe=FP8RecipeKwargs(backend="native", scaling=("delayed", "rowwise", "delayed")))


def test_no_engine_takes_a_config_of_its_own_beside_the_recipe():
    assert not any(hasattr(get_backend(name), "convert_with_config") for name in ("ao", "native"))
    assert not hasattr(Engine, "convert_with_config")


def test_no_fp8plug_class_answers_to_a_torchao_name():
    """What fp8plug.integrations.float8 shares with torchao.float8 is the two functions it stands in for, which
    take the same arguments; its classes have names of their own. The old class names still
    import, as the renamed classes, with a DeprecationWarning naming the new one."""
    shared = set(float8.__all__) & set(dir(torchao.float8))
    assert shared == {"convert_to_float8_training", "precompute_float8_dynamic_scale_for_fsdp"}
    for old, new in (("ScalingType", Float8ScalingType), ("CastConfig", Float8CastConfig),
                     ("Float8LinearConfig", Float8TrainingConfig)):
        with pytest.warns(DeprecationWarning, match=f"fp8plug.integrations.float8.{old} is deprecated"
                                                    f".*fp8plug.integrations.float8.{new.__name__}"):
            assert getattr(float8, old) is new
        assert getattr(torchao.float8, old) is not new
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from fp8plug.integrations.float8 import Float8TrainingConfig as current  # noqa: F401  (no warning for the new names)
    with pytest.raises(AttributeError):
        float8.NoSuchName  # noqa: B018
