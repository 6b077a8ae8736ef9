"""The engines' rows (fp8plug.recipe.engines) and the protocol's two kinds of method
(fp8plug.backends.base): every row names an engine that answers to it, and an optional capability
is a method the base class leaves out, which an engine has exactly when it defines it."""

import pytest

from fp8plug.backends import get_backend
from fp8plug.backends.base import OPTIONAL, Engine, offers
from fp8plug.recipe.engines import BACKEND_ALIASES, BACKENDS, ENGINES
from fp8plug.recipe.kwargs import normalize_backend
from fp8plug.tuning.roofline import SM90


@pytest.mark.parametrize("name", BACKENDS)
def test_each_row_names_its_engine_and_its_spellings(name):
    row = ENGINES[name]
    assert get_backend(name).name == name
    for spelling in (name, *row.aliases):
        assert normalize_backend(spelling.upper()) == name
    assert {s for s, n in BACKEND_ALIASES.items() if n == name} == {name, *row.aliases}


@pytest.mark.parametrize("name", [n for n in BACKENDS if ENGINES[n].costs])
def test_roofline_costs_are_measured_at_the_engines_default_scaling(name):
    """The filter looks an engine up by name alone where the recipe sets no scaling: the costs must
    be those of the scaling the engine then runs."""
    row = ENGINES[name]
    assert row.costs_scaling == get_backend(name).scalings[0]
    assert SM90[name] is SM90[f"{name}:{row.costs_scaling}"] is row.costs[(9, 0)]


@pytest.mark.parametrize("name", [n for n in BACKENDS if ENGINES[n].costs])
def test_roofline_costs_cover_the_scaling_the_automatic_choice_runs(name):
    """Where the automatic choice tunes an engine to a measured scaling, the filter has its costs."""
    for speed in ENGINES[name].measured.values():
        if speed.scaling is not None:
            assert SM90[f"{name}:{speed.scaling}"] is ENGINES[name].costs[(9, 0)]


def test_the_base_class_defines_no_optional_capability():
    assert not [name for name in OPTIONAL if hasattr(Engine, name)]
    assert not offers(Engine(), "prepare")
    with pytest.raises(ValueError, match="not an optional engine capability"):
        offers(Engine(), "prepares")


@pytest.mark.parametrize("name, capabilities", [
    ("msamp", ["clip_grad_norm_", "deepspeed_problem", "plain_entries", "prepare"]),
    ("te", ["engine_recipe", "microbatch", "plain_entries", "runs_fp8"]),
    ("ao", ["has_storageless_weights", "runs_fp8"]),
    ("native", ["frozen_fp8_layer", "has_storageless_weights", "operand_scales", "rescale_layer", "runs_fp8"]),
])
def test_each_engine_offers_what_it_defines(name, capabilities):
    assert sorted(c for c in OPTIONAL if offers(get_backend(name), c)) == capabilities
