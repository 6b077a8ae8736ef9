"""Checkpoints of converted models: plain weights in and out, FP8 scaling state on the side.

A converted model's state dict must be the plain architecture's (the keys of the unconverted
model, none of an engine's extra entries such as TransformerEngine's `_extra_state`), so a
checkpoint written while training in FP8 loads strictly into the plain model and the other way
round. `install_plain_state_dict` puts two hooks on the model's root to make `state_dict()` and
`load_state_dict()` behave so, whatever wraps the model later (DDP, FSDP2, torch.compile).

The FP8 scaling state (amax histories, scales) is not weights; `FP8CheckpointState` carries it
through `Accelerator.save_state` / `load_state` as a registered checkpointing object, so a
resumed run continues exactly where it stopped.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Set, Union

import torch
from torch import nn

if TYPE_CHECKING:
    from .backends.base import Backend

_HOOKED = "_fp8plug_plain_state_dict"


def plain_state_dict(state_dict: Dict[str, torch.Tensor], engine: "Backend") -> "OrderedDict[str, torch.Tensor]":
    """`state_dict` without `engine`'s own entries: only the plain architecture's keys remain.

    The result is an OrderedDict in the input's key order, with its `_metadata`, as
    `nn.Module.state_dict()` returns: accelerate removes tied and other shared tensors before a
    safetensors save only from an OrderedDict (a plain dict reaches safetensors with both names of a
    tied weight, and it refuses to write: "Some tensors share memory")."""
    kept = engine.plain_state_dict(OrderedDict(state_dict))
    out = OrderedDict((key, kept[key]) for key in state_dict if key in kept)
    out.update((key, value) for key, value in kept.items() if key not in out)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out


def engine_keys(entries: Union[Mapping[str, Any], Iterable[str]], engine: "Backend") -> Set[str]:
    """Which entries are the engine's own (those `plain_state_dict` drops). Given only keys (a
    load's missing keys), each is asked about with an empty tensor as its value."""
    if not isinstance(entries, Mapping):
        entries = {key: torch.empty(0) for key in entries}
    kept = engine.plain_state_dict(dict(entries))
    return set(entries) - set(kept)


def install_plain_state_dict(model: nn.Module, engine: "Backend") -> nn.Module:
    """Make `model.state_dict()` give the plain keys, and `model.load_state_dict(plain, strict=True)`
    accept a plain checkpoint (the engine's own entries may be missing); once per model."""
    if getattr(model, _HOOKED, None) is engine:
        return model

    def drop_engine_entries(module, state_dict, prefix, local_metadata):
        ours = {key: value for key, value in state_dict.items() if key.startswith(prefix)}
        for key in engine_keys(ours, engine):
            del state_dict[key]

    def allow_missing_engine_entries(module, incompatible_keys):
        missing = incompatible_keys.missing_keys
        for key in engine_keys(missing, engine):
            missing.remove(key)

    model.register_state_dict_post_hook(drop_engine_entries)
    model.register_load_state_dict_post_hook(allow_missing_engine_entries)
    setattr(model, _HOOKED, engine)
    return model


class FP8CheckpointState:
    """The FP8 scaling state of every model an Accelerator converted, as one checkpointing object.

    `Accelerator.save_state` calls `state_dict()` and `load_state` calls `load_state_dict()`; the
    models are read when that happens, so the object can be registered before any is prepared.
    """

    def __init__(self, engine: "Backend", models: List[nn.Module]):
        self.engine = engine
        self.models = models  # the accelerator's own list, filled by prepare()

    def state_dict(self) -> dict:
        return {
            "backend": self.engine.name,
            "models": [self.engine.fp8_state(model) for model in self.models],
        }

    def load_state_dict(self, state: dict) -> None:
        saved_backend = state.get("backend")
        if saved_backend != self.engine.name:
            raise ValueError(
                f"FP8 checkpoint state was saved with backend {saved_backend!r} but this run uses "
                f"{self.engine.name!r}; resume with the same FP8RecipeKwargs.backend."
            )
        saved = state.get("models", [])
        if len(saved) != len(self.models):
            raise ValueError(
                f"FP8 checkpoint state holds {len(saved)} converted model(s) but {len(self.models)} were "
                "prepared here; call load_state after preparing the same models, in the same order."
            )
        with torch.no_grad():
            for model, model_state in zip(self.models, saved):
                self.engine.load_fp8_state(model, model_state)
