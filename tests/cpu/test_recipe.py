"""FP8RecipeKwargs: defaults, the environment `accelerate launch` / `accelerate config` produce,
precedence, and a clear error for every bad value."""

import dataclasses
from pathlib import Path

import pytest
from accelerate.utils import KwargsHandler

from fp8plug import FP8RecipeKwargs
from fp8plug.recipe.checks import Integer
from fp8plug.recipe.scalings import DelayedScaling

ENV_PREFIX = "ACCELERATE_FP8_"


def test_defaults_match_the_seed():
    r = FP8RecipeKwargs()
    assert isinstance(r, KwargsHandler)
    assert r.backend is None
    assert r.use_autocast_during_eval is False
    assert r.opt_level == "O2"
    assert r.margin == 0 and r.interval == 1
    assert r.fp8_format == "HYBRID"
    assert r.amax_history_len == 1024
    assert r.amax_compute_algo == "most_recent"
    assert r.override_linear_precision == (False, False, False)
    assert r.to_kwargs() == {}


@pytest.mark.parametrize("spelling,canonical", [
    ("MSAMP", "msamp"), ("TE", "te"), ("te", "te"), ("AO", "ao"), ("torchao", "ao"), ("Native", "native"),
    ("NATIVE", "native"), ("transformer_engine", "te"),
])
def test_backend_any_case(spelling, canonical):
    assert FP8RecipeKwargs(backend=spelling).backend == canonical


def test_values_any_case():
    r = FP8RecipeKwargs(fp8_format="e4m3", amax_compute_algo="MAX", opt_level="o1")
    assert (r.fp8_format, r.amax_compute_algo, r.opt_level) == ("E4M3", "max", "O1")


def test_environment_from_accelerate_launch(monkeypatch):
    env = {
        "BACKEND": "ao", "MARGIN": "2", "INTERVAL": "3", "FORMAT": "e4m3", "AMAX_HISTORY_LEN": "16",
        "AMAX_COMPUTE_ALGO": "MAX", "OVERRIDE_FPROP": "False", "OVERRIDE_DGRAD": "true",
        "OVERRIDE_WGRAD": "1", "USE_AUTOCAST_DURING_EVAL": "True", "OPT_LEVEL": "o1",
    }
    for key, value in env.items():
        monkeypatch.setenv(ENV_PREFIX + key, value)
    r = FP8RecipeKwargs()
    assert r.backend == "ao" and r.margin == 2 and r.interval == 3 and r.fp8_format == "E4M3"
    assert r.amax_history_len == 16 and r.amax_compute_algo == "max" and r.opt_level == "O1"
    assert r.override_linear_precision == (False, True, True)
    assert r.use_autocast_during_eval is True


def test_wizard_key_names(monkeypatch):
    # `accelerate config` writes these names; launch ALSO exports its own defaults beside them.
    monkeypatch.setenv(ENV_PREFIX + "AMAX_HISTORY_LENGTH", "16")
    monkeypatch.setenv(ENV_PREFIX + "AMAX_HISTORY_LEN", "1024")
    monkeypatch.setenv(ENV_PREFIX + "AMAX_COMPUTE_ALGORITHM", "max")
    monkeypatch.setenv(ENV_PREFIX + "AMAX_COMPUTE_ALGO", "most_recent")
    monkeypatch.setenv(ENV_PREFIX + "OPTIMIZATION_LEVEL", "O1")
    monkeypatch.setenv(ENV_PREFIX + "OPT_LEVEL", "O2")
    r = FP8RecipeKwargs()
    assert r.amax_history_len == 16
    assert r.amax_compute_algo == "max"
    assert r.opt_level == "O1"


def test_launch_flag_that_differs_from_its_default_beats_wizard_key(monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "AMAX_HISTORY_LENGTH", "16")
    monkeypatch.setenv(ENV_PREFIX + "AMAX_HISTORY_LEN", "32")
    assert FP8RecipeKwargs().amax_history_len == 32


def test_explicit_arguments_beat_environment(monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "MARGIN", "5")
    monkeypatch.setenv(ENV_PREFIX + "BACKEND", "te")
    monkeypatch.setenv(ENV_PREFIX + "OVERRIDE_WGRAD", "true")
    r = FP8RecipeKwargs(margin=1, backend="native", override_linear_precision=(False, False, False))
    assert r.margin == 1 and r.backend == "native"
    assert r.override_linear_precision == (False, False, False)
    assert r.is_explicit("margin") and not r.is_explicit("interval")


@pytest.mark.parametrize("kwargs,field", [
    ({"fp8_format": "E5M2"}, "fp8_format"),
    ({"fp8_format": "fp8"}, "fp8_format"),
    ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
    ({"backend": "cuda"}, "backend"),
    ({"opt_level": "O4"}, "opt_level"),
    ({"margin": -1}, "margin"),
    ({"interval": 0}, "interval"),
    ({"amax_history_len": 0}, "amax_history_len"),
    ({"amax_history_len": "many"}, "amax_history_len"),
    ({"override_linear_precision": (True, False)}, "override_linear_precision"),
    ({"override_linear_precision": (1, 0, 0)}, "override_linear_precision"),
    ({"override_linear_precision": "yes"}, "override_linear_precision"),
    ({"use_autocast_during_eval": "maybe"}, "use_autocast_during_eval"),
    ({"modules_to_ignore": "lm_head"}, "modules_to_ignore"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FP8RecipeKwargs(**kwargs)


def test_bad_value_lists_allowed_values():
    with pytest.raises(ValueError, match="HYBRID, E4M3"):
        FP8RecipeKwargs(fp8_format="E5M2")
    with pytest.raises(ValueError, match="msamp, te, ao, native"):
        FP8RecipeKwargs(backend="tpu")


def test_bad_environment_value_is_reported(monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "AMAX_COMPUTE_ALGO", "median")
    with pytest.raises(ValueError, match="amax_compute_algo"):
        FP8RecipeKwargs()


def test_fp8plug_fields_from_a_launch_config(monkeypatch):
    """`fp8_config:` keys fp8plug adds reach it through what accelerate launch exports."""
    monkeypatch.setenv(ENV_PREFIX + "SCALING", "Dynamic")
    monkeypatch.setenv(ENV_PREFIX + "MODULES_TO_IGNORE", "['lm_head', 'layers.0.q']")
    monkeypatch.setenv(ENV_PREFIX + "OPTIMIZER_STATES", "8bit")
    r = FP8RecipeKwargs()
    assert r.scaling == "dynamic"
    assert r.modules_to_ignore == ("lm_head", "layers.0.q")
    assert r.optimizer_states == "8bit"
    assert FP8RecipeKwargs(scaling="delayed", modules_to_ignore=[]).scaling == "delayed"


def test_fp8plug_variables_set_by_hand(monkeypatch):
    monkeypatch.setenv("FP8PLUG_MODULES_TO_IGNORE", "lm_head, head2")
    monkeypatch.setenv("FP8PLUG_SCALING", "dynamic")
    r = FP8RecipeKwargs()
    assert r.modules_to_ignore == ("lm_head", "head2") and r.scaling == "dynamic"


def test_delayed_scaling_settings_are_documented_as_declared():
    """docs/recipe.md's tables give each of DelayedScaling's settings with its default, its
    environment variables and its bounds, as fp8plug.recipe.scalings declares them."""
    rows = [line for line in (Path(__file__).resolve().parents[2] / "docs" / "recipe.md").read_text().splitlines()
            if line.startswith("| `")]
    for setting in dataclasses.fields(DelayedScaling):
        row = next((r for r in rows if r.startswith(f"| `{setting.name}` | `")), "")
        default = repr(setting.default).replace("'", '"')
        assert row.startswith(f"| `{setting.name}` | `{default}` |"), (setting.name, row)
        assert all(name in row for name in setting.metadata["env"] if name), (setting.name, row)
        check = setting.metadata["check"]
        if isinstance(check, Integer):
            assert any(r.startswith(f"| `{setting.name}` | {check.low:,} to {check.high:,} |") for r in rows), \
                setting.name


def test_accelerates_field_names_are_taken_once():
    filter_fn = lambda module, fqn: True  # noqa: E731
    r = FP8RecipeKwargs(module_filter_func=filter_fn, amax_history_length=16, amax_compute_algorithm="MAX",
                        optimization_level="o1", use_mxfp8_block_scaling=True)
    assert (r.module_filter_fn, r.amax_history_len, r.amax_compute_algo, r.opt_level, r.scaling) == (
        filter_fn, 16, "max", "O1", "mxfp8")
    assert r.is_explicit("amax_history_len") and not r.is_explicit("margin")
    assert FP8RecipeKwargs(use_mxfp8_block_scaling="false").scaling is None
    with pytest.raises(TypeError, match=r"^FP8RecipeKwargs: 'amax_history_length' is Accelerate's name for "
                                        r"'amax_history_len'; pass only one of them\.$"):
        FP8RecipeKwargs(amax_history_length=16, amax_history_len=16)
    with pytest.raises(TypeError, match="'margn'"):
        FP8RecipeKwargs(margn=1)
    assert dataclasses.replace(r, margin=1) == FP8RecipeKwargs(
        module_filter_fn=filter_fn, amax_history_len=16, amax_compute_algo="max", opt_level="O1", scaling="mxfp8",
        margin=1)
