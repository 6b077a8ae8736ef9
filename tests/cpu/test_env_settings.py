"""A bad FP8 setting in the environment (ACCELERATE_FP8_*, FP8PLUG_*) is named wherever a recipe
reads it: the error raised inside a script names the variable, its value and what is allowed, and
a value `accelerate launch` replaced in the processes it starts is still checked (the real launch:
tests/cpu/test_launch.py)."""

import warnings

import pytest

from fp8plug import FP8RecipeKwargs
from fp8plug.recipe import kwargs as recipe_kwargs
from fp8plug.recipe.environment import VARIABLES
from fp8plug.recipe.launched import is_launcher, replaced_by_launch

# the variables whose value is free text to the recipe: a scaling's name is the engine's to check
# (`fp8plug env` does, fp8plug.cli.fp8_settings_problem), and any text is a list of module names
FREE_TEXT = {"FP8PLUG_SCALING", "ACCELERATE_FP8_SCALING", "FP8PLUG_MODULES_TO_IGNORE",
             "ACCELERATE_FP8_MODULES_TO_IGNORE"}


@pytest.mark.parametrize("variable", sorted(VARIABLES))
def test_every_bad_variable_is_named_in_the_error(monkeypatch, variable):
    monkeypatch.setenv(variable, "bogus!")
    if variable in FREE_TEXT:
        FP8RecipeKwargs()
        return
    with pytest.raises(ValueError) as info:
        FP8RecipeKwargs()
    assert variable in str(info.value) and "'bogus!'" in str(info.value)


@pytest.mark.parametrize("variable", ["FP8PLUG_SCALING", "ACCELERATE_FP8_SCALING"])
def test_a_scaling_no_engine_has_is_named_with_its_variable_when_converting(monkeypatch, variable):
    """The scaling word is each engine's to check, so the refusal comes when an engine is chosen:
    it still names the variable the word came from."""
    import torch

    from fp8plug import convert_model
    from fp8plug.backends.base import BackendUnavailableError

    monkeypatch.setenv(variable, "weird")
    with pytest.raises(BackendUnavailableError) as info:
        convert_model(torch.nn.Sequential(torch.nn.Linear(32, 32)), recipe=FP8RecipeKwargs())
    assert f"has no 'weird' scaling (FP8RecipeKwargs.scaling (from {variable})" in str(info.value)


def test_bad_format_inside_a_script_names_variable_value_and_choices(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_FORMAT", "bogus")
    with pytest.raises(ValueError) as info:
        FP8RecipeKwargs()
    assert str(info.value) == ("FP8RecipeKwargs.fp8_format (from ACCELERATE_FP8_FORMAT): 'bogus' is not allowed; "
                               "use one of HYBRID, E4M3.")
    assert FP8RecipeKwargs(fp8_format="E4M3").fp8_format == "E4M3"  # the script's argument wins over it


def test_a_bad_value_launch_replaced_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_FORMAT", "HYBRID")  # what the launch set
    monkeypatch.setattr(recipe_kwargs, "replaced_by_launch",
                        lambda names: {"ACCELERATE_FP8_FORMAT": ("bogus", "HYBRID")} if "ACCELERATE_FP8_FORMAT"
                        in names else {})
    with pytest.raises(ValueError) as info:
        FP8RecipeKwargs()
    message = str(info.value)
    assert message.startswith("FP8RecipeKwargs.fp8_format (from ACCELERATE_FP8_FORMAT, in the environment "
                              "`accelerate launch` ran in): 'bogus' is not allowed; use one of HYBRID, E4M3.")
    assert "replaced it with 'HYBRID'" in message
    recipe = FP8RecipeKwargs(fp8_format="E4M3")  # given by the script: the environment is not read for it
    with pytest.raises(ValueError, match="ACCELERATE_FP8_FORMAT, in the environment `accelerate launch`"):
        recipe.fp8_format = None  # read again from the environment: checked again


def test_a_good_value_launch_replaced_is_a_warning(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_HISTORY_LEN", "1024")
    monkeypatch.setattr(recipe_kwargs, "replaced_by_launch",
                        lambda names: {"ACCELERATE_FP8_AMAX_HISTORY_LEN": ("16", "1024")})
    with pytest.warns(UserWarning, match="ACCELERATE_FP8_AMAX_HISTORY_LEN='16', exported where `accelerate launch` "
                                         "ran, was replaced by the launch with '1024'"):
        assert FP8RecipeKwargs().amax_history_len == 1024
    monkeypatch.setattr(recipe_kwargs, "replaced_by_launch",
                        lambda names: {"ACCELERATE_FP8_AMAX_HISTORY_LEN": (" 1024", "1024")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same setting spelled otherwise: nothing to say
        FP8RecipeKwargs()


@pytest.mark.parametrize("argv, launcher", [
    (["/usr/bin/python3", "/usr/local/bin/accelerate", "launch", "--config_file", "c.yaml", "train.py"], True),
    (["python3", "-m", "accelerate.commands.launch", "train.py"], True),
    (["/venv/bin/accelerate-launch", "train.py"], True),
    (["python3", "-m", "fp8plug", "launch", "--cpu", "train.py"], True),
    (["/venv/bin/fp8plug", "launch", "train.py"], True),
    (["python3", "train.py", "launch"], False),
    (["/venv/bin/accelerate", "env"], False),
    (["bash"], False),
])
def test_which_parents_are_accelerates_launcher(argv, launcher):
    assert is_launcher(argv) is launcher


def test_nothing_is_replaced_where_the_parent_is_no_launcher():
    # pytest's parent is a shell or CI's runner, never accelerate's launcher
    assert replaced_by_launch(VARIABLES, {"ACCELERATE_FP8_FORMAT": "HYBRID"}) == {}
