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
- DeepSpeed: its engine's `step()`, wrapped by fp8plug.deepspeed, since ZeRO steps the torch
  optimizer per flat partition, whose parameters are no model's (the hook above finds none);
- by hand, for a loop without a torch optimizer: `fp8plug.sync_fp8_scaling`.

An engine with such work `track`s each model it converts. Kept apart from the engines so that the
rule "which models did this optimizer step train" is written once for all of them.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Dict, Iterable, List, Tuple

from torch import nn

if TYPE_CHECKING:
    from .backends.base import Engine

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


def untrack(model: nn.Module) -> None:
    """Stop ending steps for `model` and the modules inside it (an exported or unconverted model)."""
    for module in model.modules():
        _TRACKED.pop(module, None)


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
