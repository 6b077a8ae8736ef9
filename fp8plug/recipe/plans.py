"""From a recipe to an engine's plan: the one place an FP8RecipeKwargs is read on an engine's behalf.

Why: the recipe is one mutable object of some twenty fields, most of which mean something to one
engine only. Read by each engine on its own, every engine grew its own idea of which fields the
user set, its own way of saying "this field does nothing here", and its own reads of the
environment. So the recipe is read here, once, when an engine is selected:

1. FP8RecipeKwargs has already resolved every field (argument > environment > default, recipe.py);
2. the engine resolves the scaling it will run (`Engine.scaling_name`);
3. the engine gets a frozen `Settings`: only the fields it declares it honours under that scaling
   (`Engine.honours`, `Engine.honours_by_scaling`) and the shared ones (`SHARED`), the device, and
   which of them were passed as arguments; reading any other field is an error;
4. the engine turns that into its own frozen, typed plan (`Engine.make_plan`), refusing what it
   cannot do;
5. each field the user passed that the engine does not honour there, and whose value would
   change something, is warned about once, in one wording (`ignored_message`);
6. the plan's shared part (`Plan`) is filled in: the scaling, which modules convert (with the
   automatic speed filter where asked, fp8plug.tuning.roofline), the eval policy, the optimizer states.

Conversion, autocast and the optimizer adaptation then take only that plan. Adding a recipe
field means adding it to FP8RecipeKwargs and to the engines that honour it; this module does not
change (docs/architecture.md walks through an example).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, FrozenSet, Iterator, Mapping, Optional, Tuple

from fp8plug.recipe.kwargs import APPLIES_TO, DEFAULTS, FP8RecipeKwargs, field_names
from fp8plug.recipe.numerics import NUMERICS_DEFAULTS, NUMERICS_FIELDS
from fp8plug.recipe.scalings import DelayedScaling
from fp8plug.tuning.hardware import DeviceInfo, device_info
from fp8plug.tuning.roofline import auto_filter as speed_filter

# `engine` below is a fp8plug.backends.base.Engine; not imported, not even for typing: base.py
# imports this module (tests/cpu/test_import_graph.py counts every import).
Engine = Any

# Fields every engine honours, read by the shared code (registry, conversion rules, speed filter,
# optimizer states) rather than by an engine: never "ignored", always in an engine's Settings.
SHARED: FrozenSet[str] = frozenset({
    "backend", "scaling", "modules_to_ignore", "module_filter_fn", "auto_filter", "auto_filter_tokens",
    "optimizer_states", "skip_causal_mask", "fp8_dpa", "fp8_output_head", *NUMERICS_FIELDS,
})


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What shared code reads of every engine's plan. An engine's plan subclasses it (frozen,
    keyword-only) with its own typed fields; `make_plan` fills these in after the engine made
    its own part, so an engine never copies them.

    scaling: the scaling the engine runs ("" where a finished engine configuration was given
        instead of a recipe, as fp8plug.integrations.float8 does).
    modules_to_ignore, module_filter_fn: which eligible modules stay in high precision
        (fp8plug.layers.rules.decide_modules); the filter includes the automatic speed filter where
        it applies.
    keep_output_head: the model's output head (fp8plug.layers.output_head) stays in high
        precision (FP8RecipeKwargs.fp8_output_head, resolved by `make_plan`). Not compared: a
        model converted by hand and then prepared keeps its head as converted (reported as
        already converted), rather than being refused as converted with other settings.
    use_autocast_during_eval: FP8 in eval mode too (fp8plug.autocast).
    optimizer_states: low-precision optimizer states (fp8plug.integrations.optim).
    skip_causal_mask: transformers' SDPA attention without a built causal mask (fp8plug.hf.attention).
    fp8_dpa: a transformers model's causal attention in FP8 through TransformerEngine
        (fp8plug.hf.fp8_attention); its delayed scaling takes the engine's settings where the plan
        is a DelayedScalingPlan, else the recipe's defaults.
    numerics_watch_interval, numerics_guard, guard_min_sqnr_db, guard_max_saturation,
        guard_patience: the numerics watch and its guard (fp8plug.numerics); not compared, so a
        model converted with another watch is still the same conversion.
    """

    scaling: str = ""
    modules_to_ignore: Optional[Tuple[str, ...]] = None
    module_filter_fn: Optional[Callable] = field(default=None, compare=False, repr=False)
    keep_output_head: bool = field(default=True, compare=False)
    use_autocast_during_eval: bool = False
    optimizer_states: Optional[str] = None
    skip_causal_mask: bool = True
    fp8_dpa: bool = False
    numerics_watch_interval: int = field(default=NUMERICS_DEFAULTS["numerics_watch_interval"], compare=False)
    numerics_guard: bool = field(default=NUMERICS_DEFAULTS["numerics_guard"], compare=False)
    guard_min_sqnr_db: float = field(default=NUMERICS_DEFAULTS["guard_min_sqnr_db"], compare=False)
    guard_max_saturation: float = field(default=NUMERICS_DEFAULTS["guard_max_saturation"], compare=False)
    guard_patience: int = field(default=NUMERICS_DEFAULTS["guard_patience"], compare=False)

    def describe_scaling(self) -> str:
        """The scaling as the conversion's log line names it (an engine's plan may say more)."""
        return self.scaling


@dataclass(frozen=True, kw_only=True)
class DelayedScalingPlan(Plan, DelayedScaling):
    """The plan of an engine that runs TransformerEngine-style delayed scaling (native, te): the
    shared Plan, delayed scaling's settings (fp8plug.recipe.scalings.DelayedScaling, with its
    defaults) and which GEMMs stay in high precision."""

    override_linear_precision: Tuple[bool, bool, bool] = DEFAULTS["override_linear_precision"]


@dataclass(frozen=True)
class Settings:
    """The recipe as one engine may read it while making its plan: the fields it declares it
    honours under `scaling`, and the SHARED ones, resolved (argument > environment > default);
    reading an undeclared field raises AttributeError, so a field an engine uses is a field it
    declares. `device` is where it will run (hardware checks read it, not torch.cuda)."""

    engine: str
    scaling: str
    device: DeviceInfo
    values: Mapping[str, Any]
    arguments: FrozenSet[str]  # the readable fields the user passed as arguments

    def __getattr__(self, name: str):
        values = self.__dict__.get("values")
        if values is not None and name in values:
            return values[name]
        if values is not None and name in field_names():
            raise AttributeError(
                f"Settings.{name}: the {self.__dict__.get('engine')} engine does not declare {name!r} among the "
                "recipe fields it honours (Engine.honours or honours_by_scaling); declare it to read it."
            )
        raise AttributeError(name)

    def argument(self, name: str):
        """`name`'s value where the user passed it as an argument, else None (from the environment
        or the defaults). For settings where an engine keeps its own default unless asked:
        `accelerate launch` exports every FP8 field with its default, so only an argument shows a
        choice (DESIGN.md)."""
        value = getattr(self, name)
        return value if name in self.arguments else None


def make_plan(engine: Engine, recipe: Optional[FP8RecipeKwargs] = None, device=None, *,
              auto_filter: bool = False) -> Plan:
    """`engine`'s frozen plan for `recipe` (None: one from the environment and the defaults) on
    `device` (a DeviceInfo, a torch device, or None for the current one). `auto_filter`: add the
    automatic speed filter as FP8RecipeKwargs.auto_filter says (fp8plug.tuning.roofline.auto_filter;
    the Accelerator asks for it, convert_model only where auto_filter=True). Raises ValueError
    for a recipe the engine refuses; warns once per field passed that the engine ignores."""
    if recipe is None:
        recipe = FP8RecipeKwargs(backend=engine.name)
    info = device if isinstance(device, DeviceInfo) else device_info(device)
    scaling = engine.scaling_name(recipe.scaling)
    honoured = engine.honoured(scaling)
    unknown = sorted(honoured - set(field_names()))
    if unknown:
        raise TypeError(f"{type(engine).__name__} honours {unknown}, which FP8RecipeKwargs does not have.")
    readable = honoured | SHARED
    settings = Settings(engine.name, scaling, info,
                        MappingProxyType({name: getattr(recipe, name) for name in readable}),
                        frozenset(name for name in readable if recipe.is_explicit(name)))
    plan = engine.make_plan(settings)
    for message in _ignored(engine, scaling, recipe):
        warnings.warn(message, UserWarning, stacklevel=3)
    if recipe.numerics_guard and not recipe.numerics_watch_interval:
        raise ValueError("FP8RecipeKwargs.numerics_guard=True acts on the numerics watch's checks, which "
                         "numerics_watch_interval=0 turns off; set numerics_watch_interval (e.g. 100).")
    module_filter_fn = recipe.module_filter_fn
    if auto_filter:
        module_filter_fn = speed_filter(recipe, engine.name, info) or module_filter_fn
    return dataclasses.replace(  # an engine that named its scaling itself (a whole ao_config) keeps that name
        plan, scaling=plan.scaling or scaling, modules_to_ignore=recipe.modules_to_ignore,
        module_filter_fn=module_filter_fn, keep_output_head=not _output_head_fp8(recipe),
        use_autocast_during_eval=recipe.use_autocast_during_eval, optimizer_states=recipe.optimizer_states,
        skip_causal_mask=recipe.skip_causal_mask, fp8_dpa=recipe.fp8_dpa,
        **{name: getattr(recipe, name) for name in NUMERICS_FIELDS},
    )


def _output_head_fp8(recipe: FP8RecipeKwargs) -> bool:
    """Whether the output head converts: only where fp8_output_head=True; None (the default) keeps
    it in high precision, whichever way the model is converted (the one rule;
    docs/recipe.md#fp8_output_head)."""
    return recipe.fp8_output_head is True


def _ignored(engine: Engine, scaling: str, recipe: FP8RecipeKwargs) -> Iterator[str]:
    """The warning for each field the user passed that `engine` does not honour under `scaling`,
    where its value differs from what the engine does anyway (Engine.acts_as)."""
    honoured = engine.honoured(scaling) | SHARED
    for name in field_names():
        if name in honoured or not recipe.is_explicit(name):
            continue
        value = getattr(recipe, name)
        if value == engine.acts_as(name, scaling):
            continue
        yield ignored_message(engine, name, value, scaling, engine.why_ignored(name, scaling))


def ignored_message(engine: Engine, name: str, value, scaling: str, why: str) -> str:
    """The one wording of "this field does nothing here", for every engine and every reason."""
    elsewhere = any(name in fields for fields in engine.honours_by_scaling.values())
    where = f" with scaling={scaling!r}" if elsewhere else ""
    return f"FP8RecipeKwargs.{name}={value!r} is ignored by backend {engine.name!r}{where}: {why}."


def default_why(engine: Engine, name: str) -> str:
    """Why a field is ignored, from what the field applies to (recipe.APPLIES_TO)."""
    scope = APPLIES_TO.get(name)
    return f"it only applies to {scope}" if scope else f"the {engine.title} engine has no such setting"


def default_acts_as(name: str):
    """What an engine that ignores `name` does: as if given the recipe's default."""
    return DEFAULTS.get(name)


__all__ = ["Plan", "SHARED", "Settings", "ignored_message", "make_plan"]
