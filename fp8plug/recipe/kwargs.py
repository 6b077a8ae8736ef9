"""FP8RecipeKwargs: the one place where FP8 settings are named, read and checked.

Accelerate's own handler drops fields, and `accelerate launch` exports every FP8 variable with its
argparse default (and `accelerate config` writes other key names that Accelerate never reads).
This handler takes explicit arguments first, then the environment read with those quirks in
mind (fp8plug.recipe.environment), then the defaults, and rejects a bad value, when the recipe is
built or a field assigned, with the field's name and the allowed values. docs/recipe.md says
what each field does.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import InitVar, dataclass, field, fields
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

try:  # the base class accelerate wants of a kwargs handler; the recipe itself needs nothing of it
    from accelerate.utils import KwargsHandler
except ImportError:  # pragma: no cover - accelerate not installed: the recipe still works alone

    class KwargsHandler:  # type: ignore[no-redef]
        """Stand-in for accelerate.utils.KwargsHandler where accelerate is not installed."""

from fp8plug.recipe.checks import Integer, OneOf, parse_bool  # noqa: E402
from fp8plug.recipe.engines import BACKEND_ALIASES, BACKENDS  # noqa: E402,F401  (one row per engine)
from fp8plug.recipe.environment import VARIABLES, from_environment  # noqa: E402
from fp8plug.recipe.launched import replaced_by_launch  # noqa: E402
from fp8plug.recipe.layer_scaling import check_layer_scaling  # noqa: E402
from fp8plug.recipe.numerics import NUMERICS_CHECKS, NUMERICS_DEFAULTS  # noqa: E402
from fp8plug.recipe.scalings import (  # noqa: E402,F401  (AMAX_COMPUTE_ALGOS: for importers of this module)
    AMAX_COMPUTE_ALGOS,
    DELAYED_CHECKS,
    DELAYED_DEFAULTS,
    DELAYED_FIELDS,
    DelayedScaling,
)

FP8_FORMATS = ("HYBRID", "E4M3")
OPT_LEVELS = ("O1", "O2", "O3")  # MS-AMP's levels; which of them the msamp engine drives is its own rule
OPTIMIZER_STATES = ("fp8", "8bit", "4bit")  # fp8plug.integrations.optim: torchao low-bit Adam/AdamW states

DEFAULTS = {
    "backend": None,
    "use_autocast_during_eval": False,
    "opt_level": "O2",
    "fp8_format": "HYBRID",
    "override_linear_precision": (False, False, False),
    "enable_fsdp_float8_all_gather": False,
    "pad_inner_dim": False,
    "optimizer_states": None,
    "scaling": None,
    "auto_filter": None,
    "auto_filter_tokens": None,
    "skip_causal_mask": True,
    "fp8_dpa": False,
    "fp8_output_head": None,
    "layer_scaling": None,
    **NUMERICS_DEFAULTS,
    **DELAYED_DEFAULTS,
}
# What each field that only some engines read applies to: the reason in the warning an engine
# that ignores the field gives (fp8plug.recipe.plans; an engine may say more, Engine.why_ignored).
APPLIES_TO = {
    "opt_level": "MS-AMP (backend='msamp')",
    **dict.fromkeys(DELAYED_FIELDS, DelayedScaling.applies_to),
    "enable_fsdp_float8_all_gather": "FSDP2 (backend='ao' or 'native')",
    "pad_inner_dim": "torchao (backend='ao')",
    "ao_config": "torchao (backend='ao')",
    "layer_scaling": "per-layer scaling, which the native engine runs (backend='native')",
}

def normalize_backend(value, label: str = "FP8RecipeKwargs.backend") -> Optional[str]:
    """Canonical backend name (one of BACKENDS) from any spelling (BACKEND_ALIASES) and case."""
    if value is None:
        return None
    key = str(value).strip().lower()
    if key in ("", "none", "auto", "automatic"):
        return None
    if key not in BACKEND_ALIASES:
        raise ValueError(
            f"{label}: unknown backend {value!r}; use one of {', '.join(BACKENDS)} "
            "(any case) or None to choose automatically."
        )
    return BACKEND_ALIASES[key]


@dataclass
class FP8RecipeKwargs(KwargsHandler):
    """How to train in FP8, whichever engine runs it (docs/recipe.md: every field in full).

    A field left as None is read from the `ACCELERATE_FP8_*` environment that `accelerate launch`
    exports (and the key names `accelerate config` writes), else takes its default. Every value is
    checked when the recipe is built and when a field is assigned; assigning None reads the field
    again from the environment and the defaults.

    Args:
        backend: an engine's name, one of fp8plug.recipe.engines.BACKENDS or another spelling
            there (any case); None chooses automatically (fp8plug.backends.select_backend;
            `fp8plug env` says in which order, and what it chooses here).
        use_autocast_during_eval: FP8 in eval mode too (default False).
        opt_level: MS-AMP's optimisation level, "O1" or "O2" (default).
        margin, interval, amax_history_len, amax_compute_algo, reduce_amax: delayed scaling's
            settings (fp8plug.recipe.scalings.DelayedScaling: each, its default and bounds).
        fp8_format: "HYBRID" (E4M3 forward, E5M2 gradients; default) or "E4M3".
        override_linear_precision: (fprop, dgrad, wgrad); True runs that GEMM in high precision.
        scaling: the engine's scaling, or (native) one mode per tensor as (input, weight,
            grad_output); None takes the engine's default.
        modules_to_ignore: fully-qualified names of modules left in high precision.
        module_filter_fn: fn(module, fqn) -> bool; False leaves that module in high precision.
        enable_fsdp_float8_all_gather: ao, native: all-gather FSDP2-sharded weights in float8
            (native: only where passed as an argument; docs/distributed.md).
        pad_inner_dim: ao: zero-pad GEMM inner dimensions to multiples of 16.
        ao_config: ao: a whole torchao Float8LinearConfig, or its MXFP8 training config, to
            start from; implies backend="ao".
        optimizer_states: "fp8", "8bit" or "4bit" Adam/AdamW states (fp8plug.integrations.optim).
        auto_filter: leave in bf16 the Linears predicted slower in FP8 (fp8plug.tuning.roofline);
            None: where a calibration exists.
        auto_filter_tokens: the tokens per GPU per step the filter assumes (default 8192).
        skip_causal_mask: SDPA's is_causal instead of a built causal mask (default True).
        fp8_dpa: FP8 attention through TransformerEngine (default False).
        fp8_output_head: the model's output head (lm_head) in FP8. None (default) or False: high
            precision, through the Accelerator and convert_model alike (an FP8 head cost 1.4% final
            loss on real text, docs/numerics.md); True: FP8. The torchao-shaped entry points
            (fp8plug.integrations.float8) convert it, as torchao's do.
        layer_scaling: per-layer scaling (native): {module-name fnmatch pattern: scaling word or
            "bf16"}, the first matching pattern deciding (fp8plug.recipe.layer_scaling).
        numerics_watch_interval: every how many optimizer steps the numerics watch checks every
            FP8 layer (fp8plug.numerics.watch); 0, the default, never.
        numerics_guard: move a layer whose checks stay bad to a finer scaling or high precision
            (fp8plug.numerics.guard; default False); guard_min_sqnr_db, guard_max_saturation and
            guard_patience say when (fp8plug.recipe.numerics: each, its default and bounds).

    Accelerate's own names are accepted too (ACCELERATE_NAMES): module_filter_func, config,
    amax_history_length, amax_compute_algorithm, optimization_level, use_mxfp8_block_scaling.
    """

    backend: Optional[str] = None
    use_autocast_during_eval: Optional[bool] = None
    opt_level: Optional[str] = None
    margin: Optional[int] = None
    interval: Optional[int] = None
    fp8_format: Optional[str] = None
    amax_history_len: Optional[int] = None
    amax_compute_algo: Optional[str] = None
    override_linear_precision: Optional[Tuple[bool, bool, bool]] = None
    scaling: Optional[Union[str, Tuple[str, str, str]]] = None
    modules_to_ignore: Optional[Sequence[str]] = None
    module_filter_fn: Optional[Callable] = field(default=None, repr=False, compare=False)
    enable_fsdp_float8_all_gather: Optional[bool] = None
    pad_inner_dim: Optional[bool] = None
    ao_config: Optional[object] = None
    optimizer_states: Optional[str] = None
    auto_filter: Optional[bool] = None
    auto_filter_tokens: Optional[int] = None
    reduce_amax: Optional[bool] = None
    skip_causal_mask: Optional[bool] = None
    fp8_dpa: Optional[bool] = None
    fp8_output_head: Optional[bool] = None
    layer_scaling: Optional[Any] = None
    numerics_watch_interval: Optional[int] = None
    numerics_guard: Optional[bool] = None
    guard_min_sqnr_db: Optional[float] = None
    guard_max_saturation: Optional[float] = None
    guard_patience: Optional[int] = None
    # Accelerate's names for fields above, in ACCELERATE_NAMES's order; taken in __post_init__.
    module_filter_func: InitVar[Optional[Callable]] = None
    config: InitVar[Optional[object]] = None
    amax_history_length: InitVar[Optional[int]] = None
    amax_compute_algorithm: InitVar[Optional[str]] = None
    optimization_level: InitVar[Optional[str]] = None
    use_mxfp8_block_scaling: InitVar[Optional[bool]] = None
    # The fields that came from the environment or the defaults, with their values.
    # dataclasses.replace hands it to the new recipe along with every field's value; there a
    # value that is the very object listed here only came along, so it is read again rather than
    # taken as given, and is_explicit stays true to what the caller passed.
    _resolved: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self, *accelerate_values):
        """Take Accelerate's names (`accelerate_values`: the InitVars above), read each field not
        given from the environment, else its default, and check them all."""
        for (name, target), value in zip(ACCELERATE_NAMES.items(), accelerate_values):
            if value is None:
                continue
            if getattr(self, target) is not None:
                raise TypeError(f"FP8RecipeKwargs: {name!r} is Accelerate's name for {target!r}; "
                                "pass only one of them.")
            if name == "use_mxfp8_block_scaling":
                value = "mxfp8" if parse_bool(value, name) else None
            setattr(self, target, value)
        values = {name: getattr(self, name) for name in _FIELD_NAMES}
        given = {name for name, value in values.items()
                 if value is not None and not (name in self._resolved and value is self._resolved[name])}
        sources = {}
        for name in [n for n in _FIELD_NAMES if n not in given]:
            values[name], sources[name] = from_environment(name, os.environ, DEFAULTS.get(name))
        self._settle(values, given, sources)
        check_replaced_by_launch(sources)

    def __setattr__(self, name, value):
        """A field assigned after construction is checked as at construction, before it is stored,
        and counts as given: `recipe.amax_history_len = 0` or `recipe.margin = 40` fails here,
        naming the field, and leaves the recipe as it was. None reads the field again from the
        environment and the defaults."""
        if name not in _FIELD_NAMES or "_explicit_fields" not in self.__dict__:  # the dataclass filling it in
            object.__setattr__(self, name, value)
            return
        values = {n: getattr(self, n) for n in _FIELD_NAMES}
        given = self._explicit_fields - {name}
        sources = {n: source for n, source in self._sources.items() if n != name}
        if value is None:
            value, sources[name] = from_environment(name, os.environ, DEFAULTS.get(name))
        else:
            given = given | {name}
        values[name] = value
        self._settle(values, given, sources)
        if name not in given:
            check_replaced_by_launch([name])

    def _settle(self, values: Dict[str, Any], given, sources: Dict[str, Optional[str]]) -> None:
        """Check every field of `values` (raising before anything is stored), then store them
        with what was given (`given`) and which variable each other field came from (`sources`)."""
        checked = {name: _CHECKS[name](values[name], _label(name, sources.get(name))) for name in _FIELD_NAMES}
        checked["backend"] = _backend_for(checked["ao_config"], checked["backend"], "backend" in given)
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_sources", {name: source for name, source in sources.items() if source})
        object.__setattr__(self, "_resolved", {name: checked[name] for name in _FIELD_NAMES if name not in given})
        object.__setattr__(self, "_explicit_fields", frozenset(given))  # from now on assignments are checked

    def label(self, name: str) -> str:
        """How a message names field `name`: the field, and the variable it came from where the
        environment gave it (so a bad value set outside the script is found)."""
        return _label(name, self._sources.get(name))

    def is_explicit(self, name: str) -> bool:
        """Whether the user passed this field (rather than it coming from the environment or defaults)."""
        return name in self._explicit_fields

    def to_dict(self):
        """The resolved fields as a dict (without module_filter_fn, which is a function)."""
        return {name: getattr(self, name) for name in _FIELD_NAMES if name != "module_filter_fn"}


_FIELD_NAMES: Tuple[str, ...] = tuple(f.name for f in fields(FP8RecipeKwargs) if not f.name.startswith("_"))


def field_names() -> Tuple[str, ...]:
    """The recipe's public fields (not the private `_resolved`)."""
    return _FIELD_NAMES


# Accelerate's names for fp8plug's fields (its TERecipeKwargs, AORecipeKwargs, MSAMPRecipeKwargs
# and the keys `accelerate config` writes): Accelerate's name -> fp8plug's field.
ACCELERATE_NAMES = {
    "module_filter_func": "module_filter_fn",
    "config": "ao_config",
    "amax_history_length": "amax_history_len",
    "amax_compute_algorithm": "amax_compute_algo",
    "optimization_level": "opt_level",
    "use_mxfp8_block_scaling": "scaling",  # True: scaling="mxfp8"
}


def _backend_for(ao_config, backend: Optional[str], backend_given: bool) -> Optional[str]:
    """The backend, which an ao_config makes "ao": a torchao config runs nowhere else, so another
    backend passed as an argument is an error."""
    if ao_config is None:
        return backend
    if backend not in (None, "ao") and backend_given:
        raise ValueError(
            f"FP8RecipeKwargs.ao_config: a torchao Float8LinearConfig runs only on backend='ao', "
            f"not {backend!r}; drop ao_config or set backend='ao'."
        )
    return "ao"


def _scaling(value, label: str):
    """The scaling as a lower-case name, or an (input, weight, grad_output) tuple of names where
    they differ; whether the engine has it is the engine's check (Engine.scaling_name)."""
    if value is None or isinstance(value, str):
        return None if value is None else value.strip().lower()
    if not isinstance(value, (tuple, list)) or len(value) != 3 or not all(isinstance(m, str) for m in value):
        raise ValueError(f"{label}: give a name, or three as (input, weight, grad_output), not {value!r}.")
    modes = tuple(mode.strip().lower() for mode in value)
    return modes[0] if len(set(modes)) == 1 else modes


def module_name_list(value, label: str = "FP8RecipeKwargs.modules_to_ignore") -> Optional[Tuple[str, ...]]:
    """`value` as a tuple of module names, or ValueError naming `label`: a list of strings, never one
    bare string (iterating "lm_head" would give its letters). fp8plug.checkpoints.export checks its
    own `modules_to_ignore` with it too."""
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"{label}: give a list of fully-qualified module names, not {value!r}.")
    return tuple(value)


def _module_filter(value, label: str) -> Optional[Callable]:
    if value is not None and not callable(value):
        raise ValueError(f"{label}: must be callable as fn(module, fqn) -> bool.")
    return value


def _bool_or_auto(value, label: str) -> Optional[bool]:
    """True, False, or None ("auto", "none"): the default (auto_filter: on where a calibration
    exists, through the Accelerator; fp8_output_head: the head in high precision)."""
    if value is None or str(value).strip().lower() in ("auto", "none"):
        return None
    return parse_bool(value, label)


def _optional(check):
    """`check`, letting None through."""
    return lambda value, label: None if value is None else check(value, label)


_OPTIMIZER_STATE_ALIASES = {"float8": "fp8", "8-bit": "8bit", "4-bit": "4bit"}


def _optimizer_states(value, label: str) -> Optional[str]:
    """Canonical optimizer_states ("fp8", "8bit", "4bit") or None for "none"/"off"/""."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("", "none", "off", "false", "0"):
        return None
    text = _OPTIMIZER_STATE_ALIASES.get(text, text)
    if text not in OPTIMIZER_STATES:
        raise ValueError(
            f"{label}: {value!r} is not allowed; use one of "
            f"{', '.join(OPTIMIZER_STATES)}, or None to keep the optimizer as given."
        )
    return text


def _override(value, label: str) -> Tuple[bool, bool, bool]:
    """(fprop, dgrad, wgrad) booleans, from a sequence or text such as "false,false,true"."""
    if isinstance(value, str):
        value = [part for part in value.replace("(", "").replace(")", "").split(",")]
        try:
            value = tuple(parse_bool(part, "override_linear_precision") for part in value)
        except ValueError:
            value = None
    if not isinstance(value, (tuple, list)) or len(value) != 3 or not all(isinstance(v, bool) for v in value):
        raise ValueError(
            f"{label}: give three booleans (fprop, dgrad, wgrad), e.g. (False, False, True); got {value!r}."
        )
    return tuple(value)


def _label(name: str, source: Optional[str]) -> str:
    """How an error names field `name`, read from variable `source` (None: an argument or the
    default): the field, and the variable where the value came from the environment."""
    return f"FP8RecipeKwargs.{name}" if source is None else f"FP8RecipeKwargs.{name} (from {source})"


def check_replaced_by_launch(names) -> None:
    """Check the settings of fields `names` (those read from the environment) that `accelerate
    launch` replaced in this process (fp8plug.recipe.launched) as if they had reached it: a bad one
    is a ValueError naming the variable, as the recipe would have raised; a good one that differs
    from what the launch set is a warning, since the run goes on with the launch's."""
    fields = set(names)
    variables = [name for name, field_name in VARIABLES.items() if field_name in fields]
    for variable, (exported, used) in replaced_by_launch(variables).items():
        name = VARIABLES[variable]
        check = _CHECKS[name]
        label = _label(name, f"{variable}, in the environment `accelerate launch` ran in")
        try:
            wanted = check(from_environment(name, {variable: exported}, DEFAULTS.get(name))[0], label)
        except ValueError as exc:
            raise ValueError(f"{exc} The launch replaced it with {used!r} (from its flags, its config file's "
                             "fp8_config, or its defaults); unset it, or give the setting to the launch.") from None
        launched = from_environment(name, {variable: used}, DEFAULTS.get(name))[0]
        if wanted != check(launched, _label(name, variable)):
            warnings.warn(f"{variable}={exported!r}, exported where `accelerate launch` ran, was replaced by the "
                          f"launch with {used!r} (from its flags, its config file's fp8_config, or its defaults), "
                          f"which FP8RecipeKwargs.{name} reads; give the setting to the launch instead.",
                          stacklevel=4)


# Each field's check: (value, label) -> its canonical value, or a ValueError starting with the label.
_CHECKS: Dict[str, Callable[[Any, str], Any]] = {
    "backend": normalize_backend,
    "use_autocast_during_eval": parse_bool,
    "opt_level": OneOf(OPT_LEVELS, str.upper),
    "fp8_format": OneOf(FP8_FORMATS, str.upper),
    "override_linear_precision": _override,
    "scaling": _scaling,
    "modules_to_ignore": module_name_list,
    "module_filter_fn": _module_filter,
    "enable_fsdp_float8_all_gather": parse_bool,
    "pad_inner_dim": parse_bool,
    "ao_config": lambda value, label: value,  # what it is, the ao engine checks; its backend, _backend_for
    "optimizer_states": _optimizer_states,
    "auto_filter": _bool_or_auto,
    "auto_filter_tokens": _optional(Integer(1, 2**31 - 1, "it is a GEMM dimension and must fit in int32")),
    "skip_causal_mask": parse_bool,
    "fp8_dpa": parse_bool,
    "fp8_output_head": _bool_or_auto,
    "layer_scaling": check_layer_scaling,
    **NUMERICS_CHECKS,
    **DELAYED_CHECKS,
}


def TERecipeKwargs(**fields) -> FP8RecipeKwargs:  # noqa: N802 - Accelerate's class name, kept
    """Accelerate's `TERecipeKwargs(...)` under fp8plug: the FP8RecipeKwargs for TransformerEngine
    (backend="te") with the same fields (`use_mxfp8_block_scaling` included), so a script that
    imports it from fp8plug instead of accelerate.utils runs unchanged. Keyword arguments only."""
    if "backend" in fields:
        raise TypeError("TERecipeKwargs names TransformerEngine itself; for another engine use "
                        "FP8RecipeKwargs(backend=...).")
    return FP8RecipeKwargs(backend="te", **fields)
