"""The plan of one model's conversion: every decision, made once, before anything changes.

Why: deciding while converting meant that selection, planning and converting each consulted the
others (the experts asked the engine mid-conversion, the log line asked the engine again, the
norm warning looked at what had happened). Here the decisions are made first, from the engine
and its frozen plan (fp8plug.recipe.plans.make_plan) and the model: which module converts and
under which scaling, which stays in high precision and why (fp8plug.layers.rules.decide_modules:
the filters, the output head, alignment, the speed filter, layer_scaling), which experts run
their grouped GEMMs in FP8 (fp8plug.hf.experts.decide_experts), what the model is marked as
converted with, and what the log says besides. fp8plug.conversion.apply then carries the plan out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional, Tuple

from torch import nn

from fp8plug.backends.base import Engine
from fp8plug.conversion.tensor_parallel import check_tensor_parallel
from fp8plug.hf.experts import decide_experts
from fp8plug.layers.rules import ConversionError, ModuleDecision, ModulePlan, decide_modules
from fp8plug.recipe.plans import Plan

CONVERTED_WITH = "_fp8plug_converted_with"  # the model's attribute: conversion_settings at its conversion
# Plan fields prepare() applies to every model itself, however it was converted.
_APPLIED_AT_PREPARE = frozenset({"use_autocast_during_eval", "optimizer_states"})


@dataclass(frozen=True)
class ConversionPlan:
    """Everything the conversion of one model will do, decided before anything changes.

    engine: the engine that converts (fp8plug.backends.select_for chose it);
    plan: its frozen plan (fp8plug.recipe.plans.Plan: scaling, filters, attention, the watch);
    modules: each candidate module's decision (fp8plug.layers.report.ModulePlan);
    experts: each mixture-of-experts experts module's decision (fp8plug.hf.experts);
    settings: what the model is marked as converted with (`conversion_settings`);
    warnings: what the log says besides the line (norms asked for by name that stay torch's).
    """

    engine: Engine
    plan: Plan
    modules: ModulePlan
    experts: Tuple[ModuleDecision, ...]
    settings: Mapping[str, Any]
    warnings: Tuple[str, ...] = ()


def plan_model(model: nn.Module, engine: Engine, plan: Plan, *, linear: bool = True,
               norm: Optional[bool] = None) -> ConversionPlan:
    """The ConversionPlan for `model` with `engine` under its `plan`: its Linear layers where
    `linear`, the norms the engine converts unless `norm` is False (True: and a warning where
    the engine converts none of the model's norms), its experts with the Linears. Nothing of
    `model` changes; a model that cannot be converted as asked is refused here."""
    check_tensor_parallel(None, model, engine, plan, "cannot convert to FP8: ")
    settings = MappingProxyType(conversion_settings(engine, plan))
    modules = decide_modules(model, engine, plan, linear, norm is not False)
    warnings = _norms_left(model, modules) if norm else ()
    experts = decide_experts(model, engine, plan) if linear else ()
    return ConversionPlan(engine, plan, modules, experts, settings, warnings)


def _norms_left(model: nn.Module, modules: ModulePlan) -> Tuple[str, ...]:
    """Norm conversion was asked for by name: say so where the engine converts no norm layer."""
    norms = [fqn for fqn, m in model.named_modules() if type(m).__name__.endswith(("LayerNorm", "RMSNorm"))]
    if not norms or any(not d.linear for d in modules.targets):
        return ()
    return (f"convert_model(_convert_ln=True): the {modules.engine} engine converted none of this model's norms, so "
            f"{len(norms)} norm layer(s) stay torch's ({', '.join(norms[:3]) + (', ...' if len(norms) > 3 else '')}); "
            "TransformerEngine converts nn.LayerNorm and nn.RMSNorm (the native engine only transformers' "
            "Llama-style RMSNorms): pass backend='te' where it runs (`fp8plug env`).",)


def conversion_settings(engine: Engine, plan: Plan) -> dict:
    """What a conversion decided, by name: the engine ("backend") and its plan's compared fields
    but those prepare() applies anyway. Plain values, so a model carrying them still pickles."""
    names = [f.name for f in dataclasses.fields(plan) if f.compare and f.name not in _APPLIED_AT_PREPARE]
    return {"backend": engine.name, **{name: getattr(plan, name) for name in names}}


def check_converted_like(model: nn.Module, engine: Engine, plan: Plan, where: str = "") -> None:
    """Refuse a model converted before (convert_model) with other settings than `engine` and
    `plan` would give: its FP8 layers would stay as they are, so that plan would not apply.
    The error names each differing field with both values."""
    had = model.__dict__.get(CONVERTED_WITH)
    if had is None:
        return
    wanted = conversion_settings(engine, plan)
    names = ["backend"] if had["backend"] != wanted["backend"] else [
        name for name in wanted if name in had and had[name] != wanted[name]]
    if not names:
        return

    def text(values):
        return ", ".join(f"{name}={values.get(name)!r}" for name in names)
    raise ConversionError(
        f"{where}{type(model).__name__} was already converted to FP8 with {text(had)}, but this Accelerator's "
        f"recipe gives {text(wanted)}, which would not apply to layers already converted; pass the plain model "
        "(fp8plug.unconvert_model(model) turns it back) so that prepare() converts it with this recipe, or "
        "build the Accelerator with the recipe the model was converted with."
    )


__all__ = ["CONVERTED_WITH", "ConversionPlan", "check_converted_like", "conversion_settings", "plan_model"]
