"""The end of an optimizer step: one path from every way of training to each engine's work.

Some engines have work due once per applied optimizer step, after the update: the native
engine's delayed scaling (amaxes reduced across ranks, histories and scales updated), torchao's
float8 all-gather scales under FSDP2. Run twice, a delayed-scaling history advances twice; run
never, the scales stay those of the first step. So the work is one protocol method,
`Engine.end_step`, reached only through `end_step` below, and each way of training calls that
function exactly once per step:

- a torch optimizer's `step()` (a hand-written loop, fp8plug.Accelerator, a Trainer): one global
  torch step post hook ends the step for the tracked models whose parameters that optimizer holds
  (a model with frozen FP8 layers and trainable adapters counts);
- DeepSpeed: its engine's `step()`, wrapped by fp8plug.integrations.deepspeed_zero, since ZeRO steps the torch
  optimizer per flat partition, whose parameters are no model's (the hook above finds none);
- by hand, for a loop without a torch optimizer: `fp8plug.sync_fp8_scaling`.

An engine with such work `track`s each model it converts. A tracked model carries a mark
(`_EndStepMark`) that comes along when it is copied (`copy.deepcopy`, `torch.save`/`torch.load`
of the whole model), so a copy is tracked too, under the same engine, wherever it is trained.
Kept apart from the engines so that the rule "which models did this optimizer step train" is
written once for all of them.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Tuple

from torch import nn

if TYPE_CHECKING:
    from fp8plug.backends.base import Engine

# Tracked models and their engine, in the order they were tracked (a WeakKeyDictionary keeps
# insertion order), so every rank ends its steps for the same models in the same order and the
# engines' collectives line up.
_TRACKED: "weakref.WeakKeyDictionary[nn.Module, Engine]" = weakref.WeakKeyDictionary()
_HOOK: list = []  # the handle of the global optimizer step post hook, once installed
# Copies of tracked models made since the last optimizer step, not tracked yet: (weak reference to
# the copy, engine name), in the order they were made. Tracked at the next step (`_track_copies`),
# since a copy is still an empty shell when its mark is copied.
_COPIES: List[Tuple["weakref.ref", str]] = []
_MARK = "_fp8plug_end_step"  # the attribute of a tracked model holding its _EndStepMark


def track(model: nn.Module, engine: "Engine") -> None:
    """End `engine`'s steps for `model` after every optimizer step that trains it. A model tracked
    again takes the latest engine; modules inside it stop being tracked on their own (the model's
    step covers them)."""
    for module in model.modules():
        if module is not model:
            _TRACKED.pop(module, None)
    _TRACKED[model] = engine
    setattr(model, _MARK, _EndStepMark(model, engine.name))
    _install_hook()


def untrack(model: nn.Module) -> None:
    """Stop ending steps for `model` and the modules inside it (an exported or unconverted model)."""
    for module in model.modules():
        _TRACKED.pop(module, None)
        if _MARK in module.__dict__:
            delattr(module, _MARK)


def _install_hook() -> None:
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_after_optimizer_step))


def end_step(models: Iterable[nn.Module], engines: Iterable["Engine"], group=None) -> None:
    """End an optimizer step now: each of `engines` does its end-of-step work for `models` (every
    model it converted when none are given), collectives over the ranks of `group` (all ranks by
    default). The one caller of Engine.end_step."""
    models = list(models)
    for engine in engines:
        engine.end_step(models, group=group)


def _after_optimizer_step(optimizer, *_args, **_kwargs) -> None:
    """The tracked models `optimizer` trains, in one end_step call per engine (by name: a layer
    built directly and a model converted through the registry may hold different objects of one
    engine, and their step is still one, e.g. one all-reduce for all their delayed layers)."""
    _track_copies()
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trained: Dict[str, Tuple["Engine", List[nn.Module]]] = {}
    for model, engine in list(_TRACKED.items()):
        if any(id(p) in stepped for p in model.parameters()):
            trained.setdefault(engine.name, (engine, []))[1].append(model)
    for engine, models in trained.values():
        end_step(models, [engine])
    for model, callbacks in list(_AFTER.items()):
        if callbacks and any(id(p) in stepped for p in model.parameters()):
            for callback in list(callbacks):
                callback()


# Work that is not an engine's but is due after each optimizer step that trains a model, once
# its engine's end of step ran (the numerics watch, fp8plug.numerics.watch): model -> callbacks.
_AFTER: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


def after_step(model: nn.Module, callback) -> None:
    """Call `callback()` after every optimizer step that trains `model` (a torch optimizer's step:
    a hand-written loop, fp8plug.Accelerator, a Trainer), after the engines' end of step."""
    _AFTER.setdefault(model, []).append(callback)
    _install_hook()


def remove_after_step(model: nn.Module, callback) -> None:
    """Stop calling `callback` after `model`'s steps."""
    callbacks = _AFTER.get(model, [])
    if callback in callbacks:
        callbacks.remove(callback)


def tracked(engine_name: str) -> List[nn.Module]:
    """The models tracked under the engine named `engine_name` (copies included), in order."""
    _track_copies()
    return [model for model, engine in list(_TRACKED.items()) if engine.name == engine_name]


class _EndStepMark:
    """What a tracked model carries (attribute `_MARK`) so that its copies are tracked too: copied
    with the model (deepcopy, pickle), it queues the copy for tracking under the same engine.
    Holds the model weakly, so tracking never keeps a model alive."""

    def __init__(self, model: Optional[nn.Module], engine_name: str):
        self.ref = weakref.ref(model) if model is not None else None
        self.engine_name = engine_name

    def model(self) -> Optional[nn.Module]:
        return self.ref() if self.ref is not None else None

    def __deepcopy__(self, memo):
        # copy.deepcopy makes the (empty) copy of the model before copying its attributes
        model = self.model()
        copied = memo.get(id(model)) if model is not None else None
        return _copied_mark(self.engine_name, copied if isinstance(copied, nn.Module) else None)

    def __reduce__(self):
        # pickled with its model, which unpickling makes (empty) before its attributes
        return _copied_mark, (self.engine_name, self.model())


def _copied_mark(engine_name: str, model: Optional[nn.Module]) -> _EndStepMark:
    """The mark of a copy of a tracked model (deepcopy, or a load of a pickled model); the copy is
    queued for tracking (`_track_copies`)."""
    if model is not None:
        _COPIES.append((weakref.ref(model), engine_name))
        _install_hook()
    return _EndStepMark(model, engine_name)


def _track_copies() -> None:
    """Track the copies made since the last call, in the order they were made (a model's layers
    before the model, which then stops tracking them on their own)."""
    if not _COPIES:  # after every optimizer step: nothing to import or do, almost always
        return
    from fp8plug.backends import get_backend

    while _COPIES:
        ref, engine_name = _COPIES.pop(0)
        model = ref()
        if model is not None and model not in _TRACKED:
            track(model, get_backend(engine_name))
