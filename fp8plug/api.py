"""Converting a model by hand, with any engine: `convert_model` and its helpers."""

from __future__ import annotations

import sys
from typing import Optional

from torch import nn

from fp8plug.hf.attention import restore_sdpa, skip_causal_mask
from fp8plug.backends import get_backend, select_backend
from fp8plug.backends.base import Engine
from fp8plug.layers.rules import ConversionReport
from fp8plug.coverage import describe_engine, log_conversion, logger
from fp8plug.hf.fp8_attention import use_fp8_attention
from fp8plug.recipe.plans import Plan, make_plan
from fp8plug.recipe.kwargs import BACKENDS, FP8RecipeKwargs
from fp8plug.backends.steps import end_step


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

    Accelerate's signature, for any engine: `backend` (or `recipe.backend`) picks it, None chooses
    automatically (fp8plug.backends.select_backend): on an FP8 GPU by measured speed, in the mode
    `compiled` names (whether you will torch.compile the model) or, left None, for either; without
    FP8 GEMMs TransformerEngine where it runs, else torchao, else native. As in Accelerate,
    every eligible layer is converted: the automatic speed filter acts here only when the recipe
    asks for it (`auto_filter=True`). Logs one line under the `fp8plug` logger (fp8plug.coverage).
    Returns the ConversionReport of what was converted and why anything was skipped (None when
    converting back). `_convert_ln` (default: convert norms where the engine can) given as True
    warns where the engine chosen left every norm alone.
    """
    if not to_transformer_engine:
        unconvert_model(model)
        return None
    recipe = recipe or FP8RecipeKwargs(backend=backend)
    selection = select_backend(backend or recipe.backend, compiled=compiled)
    recipe = selection.tune(recipe)
    plan = make_plan(selection.backend, recipe, selection.device, auto_filter=recipe.auto_filter is True)
    report = convert_with_plan(model, selection.backend, plan, linear=_convert_linear, norm=_convert_ln is not False)
    if _convert_ln:
        _warn_norms_left(model, report, selection.backend)
    return report


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
    log_conversion(report, describe_engine(engine, plan), type(model).__name__)
    if plan.skip_causal_mask:
        skip_causal_mask(model)
    if plan.fp8_dpa:
        use_fp8_attention(model, plan)
    return report


def loaded_engines():
    """The engines whose modules are already imported: only they can have converted a model."""
    return [get_backend(n) for n in BACKENDS if f"fp8plug.backends.{n}" in sys.modules]


def unconvert_model(model: nn.Module) -> nn.Module:
    """Swap every engine's FP8 modules back for torch modules with the same weights, in place
    (and a transformers model's attention back to "sdpa" where conversion changed it: the causal
    mask change and FP8 attention alike)."""
    for engine in loaded_engines():
        engine.unconvert(model)
    restore_sdpa(model)
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
