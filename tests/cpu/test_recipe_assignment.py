"""A recipe's fields can be assigned after construction, and an assigned field is checked as at
construction (`amax_history_len = 0` used to fail with IndexError at the first step, `margin = 40`
to give a 98% output error silently): a bad value leaves the recipe as it was, a good one counts as
explicit, and None reads the field again from the environment."""

import copy
import pickle

import pytest
import torch

import fp8plug
from fp8plug import FP8RecipeKwargs


@pytest.mark.parametrize("name, value, words", [
    ("amax_history_len", 0, "amax_history_len: 0 is out of range"),
    ("margin", 40, "margin: 40 is out of range"),
    ("interval", "often", "interval: 'often' is not an integer"),
    ("fp8_format", "E5M2", "fp8_format: 'E5M2' is not allowed"),
    ("amax_compute_algo", "mean", "amax_compute_algo: 'mean' is not allowed"),
    ("backend", "cuda", "backend: unknown backend 'cuda'"),
    ("override_linear_precision", (True,), "override_linear_precision: give three booleans"),
    ("modules_to_ignore", "lm_head", "modules_to_ignore: give a list"),
])
def test_assigning_a_bad_value_fails_and_keeps_the_recipe(name, value, words):
    for recipe in (FP8RecipeKwargs(backend="native"), copy.copy(FP8RecipeKwargs(backend="native")),
                   pickle.loads(pickle.dumps(FP8RecipeKwargs(backend="native")))):
        before = recipe.to_dict()
        with pytest.raises(ValueError, match=f"^FP8RecipeKwargs.{words}"):
            setattr(recipe, name, value)
        assert recipe.to_dict() == before


def test_assigning_a_good_value_is_canonical_and_explicit(monkeypatch):
    recipe = FP8RecipeKwargs(backend="native")
    recipe.margin = "2"
    recipe.fp8_format = "e4m3"
    assert recipe.margin == 2 and recipe.fp8_format == "E4M3" and recipe.is_explicit("margin")
    monkeypatch.setenv("ACCELERATE_FP8_MARGIN", "3")
    recipe.margin = None  # resolved again, as at construction
    assert recipe.margin == 3 and not recipe.is_explicit("margin")


def test_assigned_history_length_reaches_the_layers():
    recipe = FP8RecipeKwargs(backend="native")
    recipe.amax_history_len = 4
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    fp8plug.convert_model(model, recipe=recipe)
    assert model[0].fp8_amax_history.shape == (4, 3)
