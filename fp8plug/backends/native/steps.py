"""The native engine's end of step: delayed scaling's once-per-step update of every converted model
(NativeEngine.end_step, which fp8plug.backends.steps calls after each optimizer step) and the guard that
forgets what a skipped step recorded. Split from engine.py, which imports it; the layers
themselves (NativeFP8Linear) are recognised by the scaling state they carry."""

from __future__ import annotations

import weakref
from typing import Dict, List

import torch
from torch import nn

from fp8plug.backends.native.scaling import (
    NOT_RECORDED,
    DelayedSettings,
    encode_for_reduction,
    fold_delayed_scaling,
    forget_bad_step,
    reduce_across_ranks,
    write_back,
)
from fp8plug.backends.steps import track, tracked


def _is_delayed_layer(module: nn.Module) -> bool:
    """A NativeFP8Linear with at least one delayed slot, recognised by what it carries (its
    `delayed` flag and `materialise_fp8_state`): engine.py imports this module, so this one
    must not import engine.py (tests/cpu/test_import_graph.py)."""
    return getattr(module, "delayed", False) is True and callable(getattr(module, "materialise_fp8_state", None))

# Converted models (and directly built layers), in the order they were converted (a
# WeakKeyDictionary keeps insertion order), so every rank walks its layers in the same order and
# the one all-reduce lines them up; each with its skipped-step guard.
_TRACKED: "weakref.WeakKeyDictionary[nn.Module, _SkippedStepGuard]" = weakref.WeakKeyDictionary()


class _SkippedStepGuard:
    """A tracked model's forward pre-hook: in training, forget what a skipped step recorded
    (scaling.forget_bad_step) before this forward records anything. A picklable object; the
    model's delayed layers are looked up when it is (re)converted, and after unpickling at the
    first training forward."""

    def __init__(self):
        self.layers = None
        self.handle = None

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.layers = None
        self.handle = None

    def __call__(self, model: nn.Module, _args):
        if not model.training:
            return
        if self.layers is None:
            self.layers = _delayed_layers([model])
        if self.layers:
            with torch.no_grad():
                forget_bad_step([m.fp8_amax_recorded for m in self.layers])


def track_for_sync(model: nn.Module, engine) -> None:
    """Update `model`'s delayed scaling after every step of an optimizer that trains it, whatever
    runs the loop (fp8plug.backends.steps.track, under `engine`: the one that converted it, or for a
    directly built layer the native engine), and forget what a skipped step recorded at its next
    training forward (_SkippedStepGuard)."""
    guard = _TRACKED.get(model)
    if guard is None:
        _drop_copied_guards(model)
        guard = _TRACKED[model] = _SkippedStepGuard()
        guard.handle = model.register_forward_pre_hook(guard)
    # converted (again): the layers looked up now, not at the first forward, where a compiled
    # model would see the attribute change from None and compile the hook a second time
    guard.layers = _delayed_layers([model])
    for module in model.modules():  # one guard per model: its layers' own ones would only repeat it
        inner = _TRACKED.get(module) if module is not model else None
        if inner is not None and getattr(inner, "handle", None) is not None:
            inner.handle.remove()
            inner.handle = None
        elif module is not model:
            _drop_copied_guards(module)
    track(model, engine)


def _drop_copied_guards(module: nn.Module) -> None:
    """Remove the guards `module` got as a copy (deepcopy, pickle: they come without a handle)
    before it is tracked anew, so that its forward runs one guard, not one per copy."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if isinstance(hook, _SkippedStepGuard) and hook.handle is None:
            del module._forward_pre_hooks[key]


def untrack_for_sync(model: nn.Module) -> None:
    """Take the skipped-step guards of track_for_sync off `model` and the modules inside it (their
    FP8 layers are gone); converting it again puts a fresh one on. fp8plug.steps' tracking, shared
    by every engine, is left to the caller (fp8plug.steps.untrack)."""
    for module in model.modules():
        guard = _TRACKED.pop(module, None)
        if guard is not None and guard.handle is not None:
            guard.handle.remove()


def _delayed_layers(models) -> List[nn.Module]:
    seen: Dict[int, nn.Module] = {}
    for model in models:
        for module in model.modules():
            if _is_delayed_layer(module):
                module.materialise_fp8_state()
                seen.setdefault(id(module), module)
    return list(seen.values())


def sync_delayed_scaling(models, group=None) -> None:
    """End a step of delayed scaling for `models` (default: every converted model and its copies): reduce the
    recorded amaxes (max) across the ranks of `group` (default: all ranks) in one collective for
    all layers, push them into the histories and recompute the scales. NativeEngine.end_step;
    every rank must run it the same number of times, as with any collective."""
    layers = _delayed_layers(list(models) or list(_TRACKED) + tracked("native"))
    if not layers:
        return
    with torch.no_grad():
        recorded = encode_for_reduction(torch.stack([m.fp8_amax_recorded for m in layers]))
        shared = [i for i, m in enumerate(layers) if m.reduce_amax]
        if len(shared) == len(layers):
            reduce_across_ranks(recorded, group)
        elif shared:
            rows = [recorded[i] for i in shared]
            write_back(rows, reduce_across_ranks(torch.stack(rows), group))
        batches: Dict[tuple, List[int]] = {}
        for i, m in enumerate(layers):
            key = (m.delayed_settings(), m.fp8_amax_history.shape, m.fp8_scale.device)
            batches.setdefault(key, []).append(i)
        for (settings, _, _), members in batches.items():
            _fold_batch([layers[i] for i in members], _rows(recorded, members), settings)


def _rows(t: torch.Tensor, indices: List[int]) -> torch.Tensor:
    """Rows `indices` of `t`. Not `t[indices]`: indexing with a Python list copies the index to
    the GPU from pageable memory, which blocks the host until the GPU has drained, and this runs
    after every optimizer step."""
    return t if len(indices) == t.shape[0] else torch.stack([t[i] for i in indices])


def _fold_batch(layers: List[nn.Module], amax: torch.Tensor, settings: DelayedSettings) -> None:
    history, scale, step = fold_delayed_scaling(
        torch.stack([m.fp8_amax_history for m in layers]), torch.stack([m.fp8_scale for m in layers]),
        torch.stack([m.fp8_step for m in layers]), amax, settings,
    )
    write_back([m.fp8_amax_history for m in layers], history)
    write_back([m.fp8_scale for m in layers], scale)
    write_back([m.fp8_step for m in layers], step)
    write_back([m.fp8_amax_recorded for m in layers], torch.full_like(amax, NOT_RECORDED))
