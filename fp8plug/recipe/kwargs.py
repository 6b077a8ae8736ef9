"""FP8RecipeKwargs: the one place where FP8 settings are named, read and checked.

Accelerate's own handler drops fields, and `accelerate launch` exports every FP8 variable with its
argparse default (and `accelerate config` writes other key names that Accelerate never reads).
This handler takes explicit arguments first, then the environment read with those quirks in
mind, then the defaults, and rejects a bad value with the field's name and the allowed values.
"""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass, field, fields
from typing import Callable, Dict, FrozenSet, Optional, Sequence, Tuple, Union

try:  # the base class accelerate wants of a kwargs handler; the recipe itself needs nothing of it
    from accelerate.utils import KwargsHandler
except ImportError:  # pragma: no cover - accelerate not installed: the recipe still works alone

    class KwargsHandler:  # type: ignore[no-redef]
        """Stand-in for accelerate.utils.KwargsHandler where accelerate is not installed."""

from fp8plug.recipe.environment import ENV_NAMES, MODULES_TO_IGNORE_ENV, env_override, env_value, parse_bool  # noqa: E402
from fp8plug.recipe.engines import BACKEND_ALIASES, BACKENDS  # noqa: E402  (one row per engine)

FP8_FORMATS = ("HYBRID", "E4M3")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
OPT_LEVELS = ("O1", "O2", "O3")  # MS-AMP's levels; which of them the msamp engine drives is its own rule
OPTIMIZER_STATES = ("fp8", "8bit", "4bit")  # fp8plug.integrations.optim: torchao low-bit Adam/AdamW states

DEFAULTS = {
    "backend": None,
    "use_autocast_during_eval": False,
    "opt_level": "O2",
    "margin": 0,
    "interval": 1,
    "fp8_format": "HYBRID",
    "amax_history_len": 1024,
    "amax_compute_algo": "most_recent",
    "override_linear_precision": (False, False, False),
    "enable_fsdp_float8_all_gather": False,
    "pad_inner_dim": False,
    "optimizer_states": None,
    "scaling": None,
    "auto_filter": None,
    "auto_filter_tokens": None,
    "reduce_amax": True,
    "skip_causal_mask": True,
    "fp8_dpa": False,
}
# What each field that only some engines read applies to: the reason in the warning an engine
# that ignores the field gives (fp8plug.recipe.plans; an engine may say more, Engine.why_ignored).
APPLIES_TO = {
    "opt_level": "MS-AMP (backend='msamp')",
    "margin": "delayed scaling (scaling='delayed')",
    "interval": "delayed scaling (scaling='delayed')",
    "amax_history_len": "delayed scaling (scaling='delayed')",
    "amax_compute_algo": "delayed scaling (scaling='delayed')",
    "reduce_amax": "delayed scaling (scaling='delayed')",
    "enable_fsdp_float8_all_gather": "torchao under FSDP2 (backend='ao')",
    "pad_inner_dim": "torchao (backend='ao')",
    "ao_config": "torchao (backend='ao')",
}
# Bounds of the numeric fields, with why (what FP8 and delayed scaling can use).
BOUNDS = {
    # the largest value still lands at or above 1.0 in E4M3 (max 448 = 2**8.8); a larger margin
    # pushes the small values below E4M3's smallest subnormal (2**-9) and zeroes them.
    "margin": (0, 8, "a larger margin maps the largest value below 1.0 in E4M3 and flushes small values to zero"),
    # a scale kept longer than this no longer follows the tensors it scales
    "interval": (1, 10_000, "a scale recomputed less often cannot follow the tensors it scales"),
    # 8192 entries x 3 tensors of float32 per Linear, read at every end-of-step update
    "amax_history_len": (1, 8192, "a longer history costs memory and time at every step and reacts no better"),
    # tokens per GPU per step: a GEMM dimension, so it must fit int32
    "auto_filter_tokens": (1, 2**31 - 1, "it is a GEMM dimension and must fit in int32"),
}

def normalize_backend(value) -> Optional[str]:
    """Canonical backend name (one of BACKENDS) from any spelling (BACKEND_ALIASES) and case."""
    if value is None:
        return None
    key = str(value).strip().lower()
    if key in ("", "none", "auto", "automatic"):
        return None
    if key not in BACKEND_ALIASES:
        raise ValueError(
            f"FP8RecipeKwargs.backend: unknown backend {value!r}; use one of {', '.join(BACKENDS)} "
            "(any case) or None to choose automatically."
        )
    return BACKEND_ALIASES[key]


class _NamesItsAccelerator(type):
    """FP8RecipeKwargs's metaclass, for one message: plain `accelerate.Accelerator` given an
    FP8RecipeKwargs looks its class up among its own handlers and raises a bare
    `KeyError: <class ...>`, with the class's repr as the whole message. The repr says the fix."""

    def __repr__(cls) -> str:
        return (f"<class '{cls.__module__}.{cls.__qualname__}': fp8plug's recipe, which plain "
                "accelerate.Accelerator does not know; use fp8plug.Accelerator>")


@dataclass
class FP8RecipeKwargs(KwargsHandler, metaclass=_NamesItsAccelerator):
    """How to train in FP8, whichever engine runs it.

    Fields left as None are read from the `ACCELERATE_FP8_*` environment that `accelerate launch`
    exports (and the key names `accelerate config` writes), then from the defaults.

    Args:
        backend: an engine's name, one of fp8plug.recipe.engines.BACKENDS or another spelling
            there (any case); None chooses automatically (fp8plug.backends.select_backend;
            `fp8plug env` says in which order, and what it chooses here).
        use_autocast_during_eval: run FP8 in eval mode too (default False: eval in high precision).
        opt_level: MS-AMP optimisation level, "O1" or "O2" ("O3" is MS-AMP's DeepSpeed-only level,
            which the msamp engine refuses).
        margin: delayed scaling: scale = fp8_max / amax / 2**margin.
        interval: delayed scaling: recompute the scale every `interval` steps.
        fp8_format: "HYBRID" (E4M3 forward, E5M2 gradients) or "E4M3" throughout.
        amax_history_len: delayed scaling: how many past amaxes are kept.
        amax_compute_algo: "max" over the history or "most_recent".
        override_linear_precision: (fprop, dgrad, wgrad); True runs that GEMM in high precision.
        scaling: the engine's scaling recipe; None takes its default ("delayed" for native and te,
            "tensorwise" for ao). native: "delayed" or "dynamic", or one of them per tensor as
            (input, weight, grad_output) (torchao's old per-tensor CastConfig, which
            fp8plug.integrations.float8 serves; three equal modes become one); te: "delayed", "current",
            "block", "mxfp8", "nvfp4"; ao: "tensorwise", "rowwise", "rowwise_with_gw_hp".
        modules_to_ignore: fully-qualified names of modules to leave in high precision.
        module_filter_fn: `fn(module, fqn) -> bool`; False leaves that module in high precision.
        enable_fsdp_float8_all_gather: ao: all-gather FSDP2-sharded weights in float8 (tensorwise
            weight scaling only); default False.
        pad_inner_dim: ao: zero-pad GEMM inner dimensions to multiples of 16; default False.
        ao_config: ao: a whole torchao `Float8LinearConfig` to start from instead of `scaling`;
            fields passed explicitly here (fp8_format, override_linear_precision, the two above)
            still apply on top. Or torchao's MXFP8 training config (`MXFP8TrainingOpConfig`,
            which fp8plug.integrations.float8's `ao_mx` builds), taken as it is. Implies backend="ao".
        optimizer_states: low-precision Adam/AdamW states through torchao (fp8plug.integrations.optim):
            "fp8", "8bit" or "4bit"; None (default) leaves the optimizer as given. Environment:
            FP8PLUG_OPTIMIZER_STATES. The msamp engine refuses it (its opt_level O2 does this).
        auto_filter: leave in bf16 the Linears where FP8 is predicted at least 15% slower than
            bf16 (fp8plug.tuning.roofline, calibrated on an H200). None (default): on for native, ao and te at
            their default scalings on a compute capability 9.0 GPU, off elsewhere; True: on (an
            error where no calibration exists); False: off. Environment: FP8PLUG_AUTO_FILTER.
        auto_filter_tokens: the tokens per GPU per step (batch x sequence length) the filter
            assumes; default 8192. Environment: FP8PLUG_AUTO_FILTER_TOKENS.
        reduce_amax: delayed scaling: reduce each step's amaxes (max) across all ranks, so every
            rank casts with one scale, as TransformerEngine does (default True); False keeps
            one scale per rank (e.g. pipeline stages holding different layers).
            Environment: FP8PLUG_REDUCE_AMAX.
        skip_causal_mask: a transformers model on "sdpa" attention gets SDPA's is_causal instead of
            a built causal mask wherever no padding mask is passed, under torch.compile too
            (fp8plug.hf.attention; default True); False leaves its attention alone.
            Environment: FP8PLUG_SKIP_CAUSAL_MASK.
        fp8_dpa: FP8 attention (TransformerEngine's name): a transformers model on "sdpa" attention
            runs causal attention through TransformerEngine's FP8 dot-product attention (cuDNN's
            FP8 fused attention, delayed scaling) while training on a compute capability 9.0+ GPU,
            and transformers' SDPA wherever that cannot run (fp8plug.hf.fp8_attention). Default False:
            on an H100 it was slower than bf16 SDPA, and 3% higher in loss after 200 steps
            (docs/attention.md). Environment: FP8PLUG_FP8_DPA.

    Accelerate's own field names are accepted too (`module_filter_func`, `config`,
    `use_mxfp8_block_scaling`, `amax_history_length`, ...; see ACCELERATE_NAMES). A recipe made by
    `dataclasses.replace` or copied equals, field for field, the one built directly.
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
    # What this recipe resolved to; dataclasses.replace passes it to the new recipe, which can so
    # tell a field the caller changed from one that only came along (see _forget_inherited).
    _resolved: Optional["_Resolved"] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self._forget_inherited()
        self._resolve(os.environ)
        self._checked()
        object.__setattr__(self, "_constructed", True)

    def __setattr__(self, name, value):
        """A field assigned after construction is checked as at construction (and becomes
        explicit): `recipe.amax_history_len = 0` or `recipe.margin = 40` fails here, naming the
        field, instead of at the first step or as a silent 98% error. A bad value leaves the
        recipe as it was. None resolves the field again from the environment and the defaults."""
        if name not in field_names() or not self.__dict__.get("_constructed") or self.__dict__.get("_checking"):
            object.__setattr__(self, name, value)
            return
        before = dict(self.__dict__)
        try:
            object.__setattr__(self, name, value)
            if value is None and name in ENV_NAMES:
                self._explicit_fields = self._explicit_fields - {name}
                self._sources.pop(name, None)
                resolved = env_value(name, os.environ, DEFAULTS[name])
                object.__setattr__(self, name, resolved if resolved is not None else DEFAULTS[name])
            else:
                self._explicit_fields = self._explicit_fields | {name}
                self._sources.pop(name, None)
            self._checked()
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise

    def _checked(self) -> None:
        """Validate every field (the values it canonicalises are written without coming back
        here) and remember what the recipe resolved to."""
        object.__setattr__(self, "_checking", True)
        try:
            self._validate()
        finally:
            object.__setattr__(self, "_checking", False)
        self._resolved = _Resolved({name: getattr(self, name) for name in field_names()}, self._explicit_fields)

    def _forget_inherited(self) -> None:
        """Under dataclasses.replace every field arrives filled in. A value that is the very object
        the source recipe resolved from the environment or the defaults (not one its caller gave)
        is set back to None, so it resolves again and stays non-explicit, as in a recipe built
        directly; fields the source's caller gave, or replace's caller changed, stay explicit."""
        source, self._resolved = self._resolved, None
        if source is None:
            return
        for name in field_names():
            if name not in source.explicit and getattr(self, name) is source.values.get(name):
                setattr(self, name, None)

    def _resolve(self, environ) -> None:
        explicit = {name for name in field_names() if getattr(self, name) is not None}
        self._explicit_fields = frozenset(explicit)
        self._sources: Dict[str, str] = {}
        for name in ENV_NAMES:
            if getattr(self, name) is None:
                value = env_value(name, environ, DEFAULTS[name])
                if value is not None:
                    self._sources[name] = next(n for n in ENV_NAMES[name] if n and environ.get(n) == value)
                setattr(self, name, value if value is not None else DEFAULTS[name])
        if self.modules_to_ignore is None:
            text = next((environ[n] for n in MODULES_TO_IGNORE_ENV if environ.get(n)), None)
            if text is not None:
                self.modules_to_ignore = _name_list(text)
        if self.override_linear_precision is None:
            env = env_override(environ)
            self.override_linear_precision = env if env is not None else DEFAULTS["override_linear_precision"]

    def _validate(self) -> None:
        self.backend = normalize_backend(self.backend)
        self.use_autocast_during_eval = parse_bool(
            self.use_autocast_during_eval, "FP8RecipeKwargs.use_autocast_during_eval"
        )
        self.fp8_format = _choice("fp8_format", self.fp8_format, FP8_FORMATS, str.upper)
        self.amax_compute_algo = _choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS, str.lower)
        self.opt_level = _choice("opt_level", self.opt_level, OPT_LEVELS, str.upper)
        for name in ("margin", "interval", "amax_history_len"):
            setattr(self, name, self._bounded(name))
        self.reduce_amax = parse_bool(self.reduce_amax, self._label("reduce_amax"))
        self.skip_causal_mask = parse_bool(self.skip_causal_mask, self._label("skip_causal_mask"))
        self.fp8_dpa = parse_bool(self.fp8_dpa, self._label("fp8_dpa"))
        self.override_linear_precision = _override(self.override_linear_precision)
        self.scaling = _scaling(self.scaling)
        if self.modules_to_ignore is not None:
            if isinstance(self.modules_to_ignore, str) or not all(
                isinstance(n, str) for n in self.modules_to_ignore
            ):
                raise ValueError(
                    "FP8RecipeKwargs.modules_to_ignore: give a list of fully-qualified module names, "
                    f"not {self.modules_to_ignore!r}."
                )
            self.modules_to_ignore = tuple(self.modules_to_ignore)
        if self.module_filter_fn is not None and not callable(self.module_filter_fn):
            raise ValueError("FP8RecipeKwargs.module_filter_fn: must be callable as fn(module, fqn) -> bool.")
        for name in ("enable_fsdp_float8_all_gather", "pad_inner_dim"):
            setattr(self, name, parse_bool(getattr(self, name), f"FP8RecipeKwargs.{name}"))
        if self.ao_config is not None:
            if self.backend not in (None, "ao") and self.is_explicit("backend"):
                raise ValueError(
                    f"FP8RecipeKwargs.ao_config: a torchao Float8LinearConfig runs only on backend='ao', "
                    f"not {self.backend!r}; drop ao_config or set backend='ao'."
                )
            self.backend = "ao"
        if self.auto_filter is not None:
            text = str(self.auto_filter).strip().lower()
            self.auto_filter = None if text in ("auto", "none") else parse_bool(self.auto_filter, "FP8RecipeKwargs.auto_filter")
        if self.auto_filter_tokens is not None:
            self.auto_filter_tokens = self._bounded("auto_filter_tokens")
        self.optimizer_states = _optimizer_states(self.optimizer_states)

    def _label(self, name: str) -> str:
        """The field's name for an error, with the environment variable it came from, if any."""
        source = self._sources.get(name)
        return f"FP8RecipeKwargs.{name}" + (f" (from {source})" if source else "")

    def _bounded(self, name: str) -> int:
        low, high, why = BOUNDS[name]
        return _integer(self._label(name), getattr(self, name), low, high, why)

    def is_explicit(self, name: str) -> bool:
        """Whether the user passed this field (rather than it coming from the environment or defaults)."""
        return name in self._explicit_fields

    def to_dict(self):
        """The resolved fields as a dict (without module_filter_fn, which is a function)."""
        return {name: getattr(self, name) for name in field_names() if name != "module_filter_fn"}


@dataclass(frozen=True)
class _Resolved:
    values: dict
    explicit: FrozenSet[str]


@functools.lru_cache(maxsize=None)
def field_names() -> Tuple[str, ...]:
    """The recipe's public fields (not the private `_resolved`)."""
    return tuple(f.name for f in fields(FP8RecipeKwargs) if not f.name.startswith("_"))


# Accelerate's names for fp8plug's fields (its TERecipeKwargs, AORecipeKwargs, MSAMPRecipeKwargs
# and the keys `accelerate config` writes), as (fp8plug field, how to translate the value).
ACCELERATE_NAMES = {
    "module_filter_func": ("module_filter_fn", None),
    "config": ("ao_config", None),
    "amax_history_length": ("amax_history_len", None),
    "amax_compute_algorithm": ("amax_compute_algo", None),
    "optimization_level": ("opt_level", None),
    "use_mxfp8_block_scaling": ("scaling", lambda on: "mxfp8" if parse_bool(on, "use_mxfp8_block_scaling") else None),
}


def _accept_accelerate_names(generated_init):
    """Wrap the dataclass __init__ so Accelerate's field names work, and a misspelt name gets a
    "did you mean" instead of a bare TypeError."""

    @functools.wraps(generated_init)
    def __init__(self, *args, **kwargs):
        for name in [n for n in kwargs if n not in field_names() and n != "_resolved"]:
            if name in ACCELERATE_NAMES:
                target, translate = ACCELERATE_NAMES[name]
                if target in kwargs:
                    raise TypeError(
                        f"FP8RecipeKwargs: {name!r} is Accelerate's name for {target!r}; pass only one of them."
                    )
                value = kwargs.pop(name)
                kwargs[target] = translate(value) if translate else value
                continue
            close = difflib.get_close_matches(name, list(field_names()) + list(ACCELERATE_NAMES), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(
                f"FP8RecipeKwargs got an unknown field {name!r}.{hint} Fields: {', '.join(field_names())}."
            )
        generated_init(self, *args, **kwargs)

    return __init__


FP8RecipeKwargs.__init__ = _accept_accelerate_names(FP8RecipeKwargs.__init__)


def _name_list(text: str) -> list:
    """Module names from the environment: "a,b" or a YAML/Python list as launch exports it."""
    cleaned = text.strip().strip("[]()")
    return [part.strip().strip("'\"") for part in cleaned.split(",") if part.strip().strip("'\"")]


def _choice(name, value, allowed, canon):
    text = canon(str(value).strip())
    if text not in allowed:
        raise ValueError(f"FP8RecipeKwargs.{name}: {value!r} is not allowed; use one of {', '.join(allowed)}.")
    return text


def _scaling(value):
    """The scaling as a lower-case name, or an (input, weight, grad_output) tuple of names where
    they differ; whether the engine has it is the engine's check (Engine.scaling_name)."""
    if value is None or isinstance(value, str):
        return None if value is None else value.strip().lower()
    if not isinstance(value, (tuple, list)) or len(value) != 3 or not all(isinstance(m, str) for m in value):
        raise ValueError(f"FP8RecipeKwargs.scaling: give a name, or three as (input, weight, grad_output), not {value!r}.")
    modes = tuple(mode.strip().lower() for mode in value)
    return modes[0] if len(set(modes)) == 1 else modes


_OPTIMIZER_STATE_ALIASES = {"float8": "fp8", "8-bit": "8bit", "4-bit": "4bit"}


def _optimizer_states(value) -> Optional[str]:
    """Canonical optimizer_states ("fp8", "8bit", "4bit") or None for "none"/"off"/""."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("", "none", "off", "false", "0"):
        return None
    text = _OPTIMIZER_STATE_ALIASES.get(text, text)
    if text not in OPTIMIZER_STATES:
        raise ValueError(
            f"FP8RecipeKwargs.optimizer_states: {value!r} is not allowed; use one of "
            f"{', '.join(OPTIMIZER_STATES)}, or None to keep the optimizer as given."
        )
    return text


def _integer(label, value, low, high, why):
    """An integer in [low, high], or a ValueError naming the field, the range and why."""
    allowed = f"use an integer from {low} to {high}"
    try:
        number = int(str(value).strip()) if not isinstance(value, int) or isinstance(value, bool) else value
    except ValueError:
        raise ValueError(f"{label}: {value!r} is not an integer; {allowed}.") from None
    if isinstance(value, bool) or not low <= number <= high:
        raise ValueError(f"{label}: {value!r} is out of range; {allowed} ({why}).")
    return number


def _override(value):
    if isinstance(value, str):
        value = [part for part in value.replace("(", "").replace(")", "").split(",")]
        try:
            value = tuple(parse_bool(part, "override_linear_precision") for part in value)
        except ValueError:
            value = None
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 3
        or not all(isinstance(v, bool) for v in value)
    ):
        raise ValueError(
            "FP8RecipeKwargs.override_linear_precision: give three booleans (fprop, dgrad, wgrad), "
            f"e.g. (False, False, True); got {value!r}."
        )
    return tuple(value)
