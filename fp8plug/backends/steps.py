"""The end of an optimizer step: one path from every way of training to each engine's work.

Some engines have work due once per applied optimizer step (native delayed scaling's amax
reduction and scale update; torchao's float8 all-gather scales under FSDP2). Run twice, a history
advances twice; never, the scales stay the first step's. So it is one method, `Engine.end_step`,
reached only through `end_step` below, called once per step: by a global torch optimizer step
hook for the tracked models whose parameters that optimizer holds, by the wrapped DeepSpeed engine
step (fp8plug.integrations.deepspeed_zero), or by hand (`fp8plug.sync_fp8_scaling`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Dict, Iterable, List, Tuple

from torch import nn

if TYPE_CHECKING:
    from fp8plug.backends.base import Engine

# Tracked models and their engine, in the order they were tracked (a WeakKeyDictionary keeps
# insertion order), so every rank ends its steps for the same models in the same order and the
# engines' collectives line up.
_TRACKED: "weakref.WeakKeyDictionary[nn.Module, Engine]" = weakref.WeakKeyDictionary()
_HOOK: list = []  # the handle of the global optimizer step post hook, once installed


def track(model: nn.Module, engine: "Engine") -> None:
    """End `engine`'s steps for `model` after every optimizer step that trains it. A model tracked
    again takes the latest engine; modules inside it stop being tracked on their own (the model's
    step covers them)."""
    for module in model.modules():
        if module is not model:
            _TRACKED.pop(module, None)
    _TRACKED[model] = engine
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
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trained: Dict[str, Tuple["Engine", List[nn.Module]]] = {}
    for model, engine in list(_TRACKED.items()):
        if any(id(p) in stepped for p in model.parameters()):
            trained.setdefault(engine.name, (engine, []))[1].append(model)
    for engine, models in trained.values():
        end_step(models, [engine])
