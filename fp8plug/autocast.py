"""Context-aware FP8 autocast around a model's forward, for any engine.

FP8 runs in training mode and high precision in eval mode (better metrics), unless asked
otherwise. The wrapper keeps the original forward as `__wrapped__`, so it can be undone, and
wrapping twice replaces the first wrapper instead of nesting.
"""

from __future__ import annotations

import functools
import inspect
from types import MethodType
from typing import Optional

from torch import nn

from fp8plug.api import loaded_engines
from fp8plug.backends import get_backend, select_backend
from fp8plug.backends.base import Engine, offers
from fp8plug.recipe.kwargs import FP8RecipeKwargs
from fp8plug.recipe.plans import Plan, make_plan

_MARK = "_fp8plug_autocast"


def _resolve(fp8_recipe, backend, model=None):
    """(engine, its plan), made once when the forward is wrapped, from an engine's plan (the
    Accelerator's), an FP8RecipeKwargs, or an engine's own recipe object, and an optional engine
    (name or object). Where neither names an engine, the engine whose FP8 layers `model` holds
    (_engine_holding), else the automatic choice."""
    if isinstance(fp8_recipe, Plan) and isinstance(backend, Engine):
        return backend, backend.plan_of(fp8_recipe)
    recipe = fp8_recipe if isinstance(fp8_recipe, FP8RecipeKwargs) else None
    if isinstance(backend, Engine):
        return backend, make_plan(backend, recipe or FP8RecipeKwargs(backend=backend.name))
    if recipe is None and fp8_recipe is not None:
        # an engine's own recipe object; as in Accelerate, a TransformerEngine one unless `backend` says
        engine = get_backend(backend or "te")
        if not offers(engine, "engine_recipe"):
            raise TypeError(
                f"fp8_recipe: give an fp8plug.FP8RecipeKwargs; the {engine.title} engine has no recipe objects "
                f"of its own, so {type(fp8_recipe).__name__} cannot be used."
            )
        return engine, engine.engine_recipe(fp8_recipe)
    recipe = recipe or FP8RecipeKwargs()
    holding = _engine_holding(model) if backend is None and recipe.backend is None else None
    if holding is not None:
        return holding, make_plan(holding, recipe)
    selection = select_backend(backend or recipe.backend, scaling=recipe.scaling)
    return selection.backend, make_plan(selection.backend, recipe, selection.device)


def _engine_holding(model) -> Optional[Engine]:
    """The one engine whose FP8 layers `model` holds (None: no module, no FP8 layers, or several
    engines'). An autocast with no engine named is that engine's: after `convert_model(model)`
    converted to TransformerEngine, `apply_fp8_autowrap(model, FP8RecipeKwargs())` must wrap the
    forward in TE's autocast, without which TE layers run in high precision."""
    if not isinstance(model, nn.Module):
        return None
    holding = [e for e in loaded_engines() if any(e.is_converted(m) for m in model.modules())]
    return holding[0] if len(holding) == 1 else None


def contextual_fp8_autocast(model_forward, fp8_recipe=None, use_during_eval: bool = False, backend=None):
    """Wrap `model.forward` so it runs inside the engine's FP8 autocast in training mode, and in
    high precision in eval mode unless `use_during_eval`.

    As in Accelerate, the result takes the module as its first argument: bind it with
    `model.forward = types.MethodType(wrapped, model)` (apply_fp8_autowrap does this). `fp8_recipe`
    is an FP8RecipeKwargs (or a TransformerEngine recipe object, or the plan of the engine
    `backend` names); `backend` picks the engine (default: the recipe's, else the engine whose FP8
    layers the forward's module holds, else automatic).
    `__wrapped__` is the original forward.
    """
    original = model_forward.__wrapped__ if getattr(model_forward, _MARK, False) else model_forward
    bound_to = getattr(original, "__self__", None)
    engine, plan = _resolve(fp8_recipe, backend, bound_to)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        with engine.autocast(plan, enabled=self.training or use_during_eval):
            if bound_to is not None and self is not bound_to and isinstance(self, type(bound_to)):
                # a deep copy of the model: run the copy's forward, not the original's
                return original.__func__(self, *args, **kwargs)
            return original(*args, **kwargs)

    forward.__wrapped__ = original
    forward.__signature__ = _unbound_signature(original)
    setattr(forward, _MARK, True)
    return forward


def _unbound_signature(original) -> Optional[inspect.Signature]:
    """The wrapper's own signature: a leading module parameter, then the original forward's.

    Bound to the module, the wrapper then shows exactly the original bound forward's signature
    (`(input_ids, labels=None, ...)`); without it `inspect` follows `__wrapped__` to the already
    bound original and drops its first parameter a second time. Trainer picks dataset columns from
    that signature, so a lost `input_ids` breaks training. None where the original has no readable
    signature (then inspect falls back to following `__wrapped__`)."""
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        return None
    names = set(signature.parameters)
    name = "self"
    while name in names:  # a forward with a parameter called `self` of its own
        name = "_" + name
    module = inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY)
    return signature.replace(parameters=[module, *signature.parameters.values()])


def apply_fp8_autowrap(model: nn.Module, fp8_recipe_handler: Optional[FP8RecipeKwargs] = None,
                       backend=None) -> nn.Module:
    """Make `model.forward` context-aware FP8 (see contextual_fp8_autocast), in place; applying it
    twice leaves one wrapper. Eval runs in FP8 only if the handler's use_autocast_during_eval.
    The handler may also be the plan of the engine `backend` is (the Accelerator passes its own)."""
    recipe = fp8_recipe_handler or FP8RecipeKwargs()
    use_during_eval = getattr(recipe, "use_autocast_during_eval", False)
    wrapped = contextual_fp8_autocast(model.forward, recipe, use_during_eval, backend=backend)
    model.forward = MethodType(wrapped, model)  # a bound method: copy.deepcopy rebinds it to the copy
    return model


def is_autowrapped(model: nn.Module) -> bool:
    return getattr(model.forward, _MARK, False)


def remove_fp8_autowrap(model: nn.Module) -> nn.Module:
    """Undo apply_fp8_autowrap: the model's own forward again."""
    if is_autowrapped(model):
        original = model.forward.__wrapped__
        if getattr(original, "__func__", None) is type(model).forward and original.__self__ is model:
            del model.forward  # back to the class's forward, as before wrapping
        else:
            model.forward = original
    return model
