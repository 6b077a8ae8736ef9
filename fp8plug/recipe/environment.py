"""Where an FP8RecipeKwargs field is read from the environment: the variable names `accelerate
launch` exports and those named after `accelerate config`'s keys, and which of them wins
(fp8plug.recipe.kwargs resolves a recipe with these). A scaling family's settings bring their own
names (fp8plug.recipe.scalings)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from fp8plug.recipe.checks import parse_bool
from fp8plug.recipe.scalings import DELAYED_ENV_NAMES

# field -> (variable `accelerate launch` exports, variable named after `accelerate config`'s key).
# launch exports its argparse default for every field even when nobody set it, so a launch value
# equal to that default is only trusted when the wizard's name is absent.
ENV_NAMES = {
    "backend": ("ACCELERATE_FP8_BACKEND", "ACCELERATE_FP8_ENGINE"),  # `engine:`: a key accelerate ignores
    "use_autocast_during_eval": ("ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL", None),
    "opt_level": ("ACCELERATE_FP8_OPT_LEVEL", "ACCELERATE_FP8_OPTIMIZATION_LEVEL"),
    "fp8_format": ("ACCELERATE_FP8_FORMAT", None),
    "enable_fsdp_float8_all_gather": ("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", None),
    "pad_inner_dim": ("ACCELERATE_FP8_PAD_INNER_DIM", None),
    # fp8plug's own fields: `accelerate launch` still exports them from a config file's
    # `fp8_config:` section as ACCELERATE_FP8_<KEY>; FP8PLUG_* is for setting them by hand.
    "optimizer_states": ("FP8PLUG_OPTIMIZER_STATES", "ACCELERATE_FP8_OPTIMIZER_STATES"),
    "scaling": ("FP8PLUG_SCALING", "ACCELERATE_FP8_SCALING"),
    "auto_filter": ("FP8PLUG_AUTO_FILTER", "ACCELERATE_FP8_AUTO_FILTER"),
    "auto_filter_tokens": ("FP8PLUG_AUTO_FILTER_TOKENS", "ACCELERATE_FP8_AUTO_FILTER_TOKENS"),
    "skip_causal_mask": ("FP8PLUG_SKIP_CAUSAL_MASK", "ACCELERATE_FP8_SKIP_CAUSAL_MASK"),
    "fp8_dpa": ("FP8PLUG_FP8_DPA", "ACCELERATE_FP8_DPA"),  # accelerate adds no second "fp8_" to `fp8_dpa:`
    "fp8_output_head": ("FP8PLUG_FP8_OUTPUT_HEAD", "ACCELERATE_FP8_OUTPUT_HEAD"),
    **{name: (f"FP8PLUG_{name.upper()}", f"ACCELERATE_FP8_{name.upper()}") for name in (
        "numerics_watch_interval", "numerics_guard", "guard_min_sqnr_db", "guard_max_saturation", "guard_patience")},
    **DELAYED_ENV_NAMES,
}
MODULES_TO_IGNORE_ENV = ("FP8PLUG_MODULES_TO_IGNORE", "ACCELERATE_FP8_MODULES_TO_IGNORE")
OVERRIDE_ENV_NAMES = (
    "ACCELERATE_FP8_OVERRIDE_FPROP",
    "ACCELERATE_FP8_OVERRIDE_DGRAD",
    "ACCELERATE_FP8_OVERRIDE_WGRAD",
)
# every variable a recipe reads -> the field it gives (`fp8plug env` lists them; an error names them)
VARIABLES = {
    **{name: field for field, pair in ENV_NAMES.items() for name in pair if name},
    **dict.fromkeys(MODULES_TO_IGNORE_ENV, "modules_to_ignore"),
    **dict.fromkeys(OVERRIDE_ENV_NAMES, "override_linear_precision"),
}


def from_environment(name: str, environ, default) -> Tuple[Any, Optional[str]]:
    """Field `name`'s value as the environment gives it, with the variable it was read from; where
    the environment does not set it, (`default`, None)."""
    if name in ENV_NAMES:
        value = env_value(name, environ, default)
        if value is None:
            return default, None
        return value, next(n for n in ENV_NAMES[name] if n and environ.get(n) == value)
    if name == "modules_to_ignore":
        variable = next((n for n in MODULES_TO_IGNORE_ENV if environ.get(n)), None)
        return (_name_list(environ[variable]), variable) if variable else (default, None)
    if name == "override_linear_precision":
        value = env_override(environ)
        return (default, None) if value is None else (value, None)
    return default, None


def env_value(name: str, environ, default) -> Optional[str]:
    """The value the environment gives field `name` (None: none): the launch variable unless it
    only spells launch's default (`default`), then the wizard's, then the launch value anyway."""
    launch_name, wizard_name = ENV_NAMES[name]
    launch_value = environ.get(launch_name)
    wizard_value = environ.get(wizard_name) if wizard_name else None
    if launch_value is not None and not _same(launch_value, default):
        return launch_value
    if wizard_value is not None:
        return wizard_value
    return launch_value


def _same(text: str, default) -> bool:
    """Whether an environment string spells the launch default (so may not be the user's choice)."""
    return default is not None and text.strip().lower() == str(default).lower()


def env_override(environ) -> Optional[Tuple[bool, bool, bool]]:
    """override_linear_precision from ACCELERATE_FP8_OVERRIDE_{FPROP,DGRAD,WGRAD}, or None."""
    values = [environ.get(n) for n in OVERRIDE_ENV_NAMES]
    if all(v is None for v in values):
        return None
    return tuple(parse_bool(v or "false", n) for v, n in zip(values, OVERRIDE_ENV_NAMES))


def _name_list(text: str) -> list:
    """Module names from the environment: "a,b" or a YAML/Python list as launch exports it."""
    cleaned = text.strip().strip("[]()")
    return [part.strip().strip("'\"") for part in cleaned.split(",") if part.strip().strip("'\"")]
