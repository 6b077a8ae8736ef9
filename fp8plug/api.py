"""Converting a model by hand, with any engine: `convert_model` and its helpers."""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

from torch import nn

from fp8plug.backends import Selection, get_backend, judge, select_backend
from fp8plug.backends.base import Engine
from fp8plug.backends.steps import end_step
from fp8plug.coverage import describe_engine, is_main_process, log_conversion, logger
from fp8plug.hf.attention import restore_sdpa, skip_causal_mask
from fp8plug.hf.experts import convert_experts, restore_experts
from fp8plug.hf.fp8_attention import use_fp8_attention
from fp8plug.layers.rules import ConversionError, ConversionReport
from fp8plug.numerics.watch import watch_model, watch_of
from fp8plug.recipe import BACKENDS, FP8RecipeKwargs
from fp8plug.recipe.plans import Plan, make_plan
from fp8plug.tuning.hardware import DeviceInfo, device_info


def convert_model(
    model: nn.Module,
    to_transformer_engine: bool = True,
    _convert_linear: bool = True,
    _convert_ln: Optional[bool] = None,
    *,
    recipe: Optional[FP8RecipeKwargs] = None,
    backend: Optional[str] = None,
    compiled: Optional[bool] = None,
) -> Optional[ConversionReport]:
    """Convert `model`'s Linear layers to FP8 modules in place (and norms: TransformerEngine's
    LayerNorm/RMSNorm, the native engine's fused Llama-style RMSNorms), or back to torch modules
    with `to_transformer_engine=False`.

    Accelerate's signature, with Accelerate's meaning: called as Accelerate's API (no `recipe`,
    `backend` nor `compiled`, and no engine named by ACCELERATE_FP8_BACKEND), it converts to
    TransformerEngine where TE runs, so `has_transformer_engine_layers(model)` is then True; where
    TE does not run, the automatic choice below converts instead, and why TE could not is logged
    once. For any engine: `backend` (or `recipe.backend`) picks it; `backend="auto"`, or any
    `recipe` whose backend is None, takes the automatic choice (fp8plug.backends.select_backend,
    the Accelerator's default): on an FP8 GPU by measured speed, in the mode `compiled` names
    (whether you will torch.compile the model) or, left None, for either; without FP8 GEMMs
    TransformerEngine where it runs, else torchao, else native. As in Accelerate,
    every eligible layer is converted: the automatic speed filter acts here only when the recipe
    asks for it (`auto_filter=True`). Logs one line under the `fp8plug` logger (fp8plug.coverage).
    Returns the ConversionReport of what was converted and why anything was skipped (None when
    converting back). `_convert_ln` (default: convert norms where the engine can) given as True
    warns where the engine chosen left every norm alone.
    """
    if not to_transformer_engine:
        unconvert_model(model)
        return None
    accelerate_call = recipe is None and backend is None and compiled is None
    recipe = recipe or FP8RecipeKwargs(backend=backend)
    if accelerate_call and recipe.backend is None:
        selection = transformer_engine_first()
    else:
        selection = select_backend(backend or recipe.backend, compiled=compiled, scaling=recipe.scaling)
    recipe = selection.tune(recipe)
    plan = make_plan(selection.backend, recipe, selection.device, auto_filter=recipe.auto_filter is True)
    report = convert_with_plan(model, selection.backend, plan, linear=_convert_linear, norm=_convert_ln is not False)
    if _convert_ln:
        _warn_norms_left(model, report, selection.backend)
    return report


_TE_PASSED_OVER = set()  # the reasons already logged, once per process each


def transformer_engine_first(device=None) -> Selection:
    """convert_model's engine when it is called as Accelerate's API: TransformerEngine where it
    runs, as Accelerate's convert_model documents ("converts ... to their transformers_engine
    counterpart"); else the automatic choice (select_backend), after logging once why TE could not
    run. The speed-ranked automatic choice stays the Accelerator's default and `backend="auto"`
    away for convert_model."""
    info = device if isinstance(device, DeviceInfo) else device_info(device)
    verdict = judge("te", info)
    if verdict.usable:
        return select_backend("te", info)
    selection = select_backend(None, info)
    if verdict.reason not in _TE_PASSED_OVER and is_main_process():
        _TE_PASSED_OVER.add(verdict.reason)
        logger.warning(
            "fp8plug: convert_model(model) converts to TransformerEngine where it runs, as Accelerate's does; "
            "TransformerEngine cannot run here (%s), so it converts with %s, the automatic choice "
            "(has_transformer_engine_layers(model) stays False). Pass backend='auto' for the automatic choice "
            "without this note, or name an engine (`fp8plug env` lists what runs here).",
            verdict.reason, selection.name)
    return selection


def _warn_norms_left(model: nn.Module, report: ConversionReport, engine: Engine) -> None:
    """Norm conversion was asked for by name: say so where the engine converted no norm layer."""
    norms = [fqn for fqn, m in model.named_modules() if type(m).__name__.endswith(("LayerNorm", "RMSNorm"))]
    converted_others = set(report.converted) - set(report.linears)
    if norms and not converted_others:
        logger.warning(
            "convert_model(_convert_ln=True): the %s engine converted none of this model's norms, so %d norm layer(s) "
            "stay torch's (%s); TransformerEngine converts nn.LayerNorm and nn.RMSNorm (the native engine only "
            "transformers' Llama-style RMSNorms): pass backend='te' where it runs (`fp8plug env`).",
            engine.name, len(norms), ", ".join(norms[:3]) + (", ..." if len(norms) > 3 else ""))


def convert_with_plan(model: nn.Module, engine: Engine, plan: Plan, *, linear: bool = True,
                      norm: bool = True) -> ConversionReport:
    """The one conversion path (convert_model and fp8plug.Accelerator both take it): the engine
    converts as its plan says (made once, at selection, by fp8plug.recipe.plans.make_plan: the recipe
    checked, the automatic speed filter added where it applies), then one line is logged under
    the `fp8plug` logger (fp8plug.coverage). A transformers model on "sdpa" attention also gets
    attention without a built causal mask where the plan says so (fp8plug.hf.attention), and FP8
    attention where it asks for it (`fp8_dpa`, fp8plug.hf.fp8_attention)."""
    report = engine.convert(model, plan, linear=linear, norm=norm)
    if linear:  # a transformers MoE model's experts: grouped GEMMs (fp8plug.hf.experts)
        convert_experts(model, engine, plan, report)
    setattr(model, _CONVERTED_WITH, conversion_settings(engine, plan))
    log_conversion(report, describe_engine(engine, plan), type(model).__name__)
    if plan.skip_causal_mask:
        skip_causal_mask(model)
    if plan.fp8_dpa:
        use_fp8_attention(model, plan)
    if plan.numerics_watch_interval:
        watch_model(model, engine, plan, report)
    return report


_CONVERTED_WITH = "_fp8plug_converted_with"  # the model's attribute: conversion_settings at its conversion
# Plan fields prepare() applies to every model itself, however it was converted.
_APPLIED_AT_PREPARE = frozenset({"use_autocast_during_eval", "optimizer_states"})


def conversion_settings(engine: Engine, plan: Plan) -> dict:
    """What a conversion decided, by name: the engine ("backend") and its plan's compared fields
    but those prepare() applies anyway. Plain values, so a model carrying them still pickles."""
    names = [f.name for f in dataclasses.fields(plan) if f.compare and f.name not in _APPLIED_AT_PREPARE]
    return {"backend": engine.name, **{name: getattr(plan, name) for name in names}}


def check_converted_like(model: nn.Module, engine: Engine, plan: Plan, where: str = "") -> None:
    """Refuse a model converted before (convert_model) with other settings than `engine` and
    `plan` would give: its FP8 layers would stay as they are, so that plan would not apply.
    The error names each differing field with both values."""
    had = model.__dict__.get(_CONVERTED_WITH)
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


def loaded_engines():
    """The engines whose modules are already imported: only they can have converted a model."""
    return [get_backend(n) for n in BACKENDS if f"fp8plug.backends.{n}" in sys.modules]


def unconvert_model(model: nn.Module) -> nn.Module:
    """Swap every engine's FP8 modules back for torch modules with the same weights, in place
    (and a transformers model's attention back to "sdpa" where conversion changed it: the causal
    mask change and FP8 attention alike)."""
    watch = watch_of(model)
    if watch is not None:  # no FP8 layer left to watch
        watch.close()
    for engine in loaded_engines():
        engine.unconvert(model)
    model.__dict__.pop(_CONVERTED_WITH, None)
    restore_sdpa(model)
    restore_experts(model)
    return model


def has_transformer_engine_layers(model: nn.Module) -> bool:
    """Whether `model` holds any TransformerEngine module (False when it is not even imported)."""
    if "transformer_engine.pytorch" not in sys.modules:
        return False
    return any(get_backend("te").is_converted(m) for m in model.modules())


def sync_fp8_scaling(*models: nn.Module, group=None) -> None:
    """End a step of delayed scaling now: amaxes reduced across the ranks of `group` (all ranks by
    default) and scales updated, for `models` (every converted model when none is given).

    fp8plug does this after every torch optimizer step by itself (fp8plug.Accelerator, Trainer
    and hand-written loops alike); call it only in a loop that has no torch optimizer, on every
    rank alike (fp8plug.backends.steps.end_step, the path every way of training takes)."""
    end_step(models, loaded_engines(), group=group)


def has_fp8_layers(model: nn.Module) -> bool:
    """Whether `model` holds FP8 modules of any engine."""
    return any(engine.is_converted(m) for engine in loaded_engines() for m in model.modules())
