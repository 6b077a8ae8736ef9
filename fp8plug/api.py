"""Converting a model by hand, with any engine: `convert_model` and its helpers.

convert_model takes the three stages every conversion takes (fp8plug.conversion): select the
engine, plan the model's conversion, apply the plan.
"""

from __future__ import annotations

import sys
from typing import Optional

from torch import nn

from fp8plug.backends import get_backend, select_for
from fp8plug.backends.steps import end_step
from fp8plug.conversion.apply import apply_plan
from fp8plug.conversion.plan import CONVERTED_WITH, plan_model
from fp8plug.coverage import log_selection
from fp8plug.hf.attention import restore_sdpa
from fp8plug.hf.experts import restore_experts
from fp8plug.layers.rules import ConversionReport
from fp8plug.numerics.watch import watch_of
from fp8plug.recipe import BACKENDS, FP8RecipeKwargs
from fp8plug.recipe.plans import make_plan


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

    The engine is chosen by the rule fp8plug.Accelerator uses (fp8plug.backends.select_for):
    `backend` (or `recipe.backend`) names it; `backend="auto"`, or any `recipe` whose backend is
    None, takes the automatic choice: on an FP8 GPU by measured speed, in the mode `compiled`
    names (whether you will torch.compile the model) or, left None, for either; without FP8 GEMMs
    TransformerEngine where it runs, else torchao, else native. Accelerate's signature keeps
    Accelerate's meaning: called as Accelerate's API (no `recipe`, `backend` nor `compiled`, and no
    engine named by ACCELERATE_FP8_BACKEND), it converts to TransformerEngine where TE runs, so
    `has_transformer_engine_layers(model)` is then True; where TE does not run, the automatic
    choice converts instead, and why TE could not is logged once.

    Which modules convert follows the one rule too: the output head (`lm_head`) stays in high
    precision unless `fp8_output_head=True` (docs/recipe.md#fp8_output_head). As in Accelerate,
    every other eligible layer is converted: the automatic speed filter acts here only when the
    recipe asks for it (`auto_filter=True`), where the Accelerator applies it by default. Logs one
    line under the `fp8plug` logger (fp8plug.coverage). Returns the ConversionReport of what was
    converted and why anything was skipped (None when converting back). `_convert_ln` (default:
    convert norms where the engine can) given as True warns where the engine chosen left every
    norm alone.
    """
    if not to_transformer_engine:
        unconvert_model(model)
        return None
    accelerate_call = recipe is None and backend is None and compiled is None
    recipe = recipe or FP8RecipeKwargs(backend=backend)
    selection = select_for(recipe, compiled=compiled, accelerate_call=accelerate_call, backend=backend)  # 1. select
    recipe = selection.tune(recipe)
    log_selection(selection)
    plan = make_plan(selection.backend, recipe, selection.device, auto_filter=recipe.auto_filter is True)  # 2. plan
    conversion = plan_model(model, selection.backend, plan, linear=_convert_linear, norm=_convert_ln)
    return apply_plan(model, conversion)  # 3. apply


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
    model.__dict__.pop(CONVERTED_WITH, None)
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
