"""Checkpoints of converted models: plain weights in and out, FP8 scaling state on the side.

A converted model's state dict must be the plain architecture's (the keys of the unconverted
model, none of an engine's extra entries such as TransformerEngine's `_extra_state`), so a
checkpoint written while training in FP8 loads strictly into the plain model and the other way
round. `install_plain_state_dict` puts two hooks on the model's root to make `state_dict()` and
`load_state_dict()` behave so, whatever wraps the model later (DDP, FSDP2, torch.compile).

The FP8 scaling state (amax histories, scales) is not weights; `FP8CheckpointState` carries it
through `Accelerator.save_state` / `load_state` and Trainer checkpoints, so a resumed run
continues exactly where it stopped; the numerics guard's moves of layers come along and are made
again before the layers' state is loaded, and the numerics watch's state (its step count, checks
and the guard's streaks of bad checks) comes along too, so the checks, the tracker steps and the
guard's moves land where they would have without the stop. The state is saved with the recipe fields it depends on
(`RECIPE_FIELDS`), and a run whose recipe differs in one of them is refused: scales worked out
for one format or margin are wrong under another (E5M2 gradient scales saturate E4M3 gradients),
and with a long interval they would stay wrong for that many steps.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Mapping, Set, Union

import torch
from torch import nn

from fp8plug.backends.base import Engine, offers
from fp8plug.numerics.guard import apply_moves, moves_of
from fp8plug.numerics.watch import load_watch_state, watch_state, what_starts_afresh
from fp8plug.recipe.scalings import DELAYED_STATE_FIELDS

_HOOKED = "_fp8plug_plain_state_dict"
logger = logging.getLogger("fp8plug")


def engine_keys(entries: Union[Mapping[str, Any], Iterable[str]], engine: "Engine") -> Set[str]:
    """Which entries are the engine's own (those `Engine.plain_state_dict` drops: none for an
    engine without `plain_entries`). Given only keys (a load's missing keys), each is asked about
    with an empty tensor as its value."""
    if not offers(engine, "plain_entries"):
        return set()
    if not isinstance(entries, Mapping):
        entries = {key: torch.empty(0) for key in entries}
    kept = engine.plain_entries(dict(entries))
    return set(entries) - set(kept)


def install_plain_state_dict(model: nn.Module, engine: "Engine") -> nn.Module:
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


# The recipe fields that the saved FP8 state depends on: the engine and its scaling (what the
# tensors are), the format a scale was worked out for, and those of delayed scaling's settings
# its arithmetic depends on (fp8plug.recipe.scalings: the margin, the history's length, how an
# amax is read from it, how often the scale is updated); and which layer runs which scaling
# (layer_scaling: fp8plug.recipe.layer_scaling).
RECIPE_FIELDS = ("backend", "scaling", "fp8_format", *DELAYED_STATE_FIELDS, "layer_scaling")
WHERE_GIVEN = ("layer_scaling",)  # recorded only where set: a record without it means none


def recipe_record(engine: "Engine", recipe) -> Dict[str, Any]:
    """The recipe fields of RECIPE_FIELDS as plain values (what a checkpoint stores with the FP8
    state): the engine's name and the scaling it resolves the recipe to."""
    record = {name: getattr(recipe, name, None) for name in RECIPE_FIELDS}
    record["backend"] = engine.name
    given = recipe.scaling  # a mode per tensor is kept as such: it is what the FP8 state was made under
    record["scaling"] = "/".join(given) if isinstance(given, tuple) else engine.scaling_name(given)
    rules = record.pop("layer_scaling", None)  # recorded only where given: every layer's scaling is the recipe's
    if rules:
        record["layer_scaling"] = [list(rule) for rule in rules]  # plain lists: weights_only loads them
    return record


class FP8CheckpointState:
    """The FP8 scaling state of every model an Accelerator converted, with the recipe it belongs to.

    `state_dict()` is what a checkpoint stores (tensors, strings and numbers only, so it loads with
    weights_only=True); `check(state)` refuses one that does not fit this run without changing
    anything; `load_state_dict(state)` checks and puts it back, all or nothing. The models are read
    when that happens, so the object can be made before any is prepared.
    """

    def __init__(self, engine: "Engine", models: List[nn.Module], recipe=None):
        self.engine = engine
        self.models = models  # the accelerator's own list, filled by prepare()
        self.recipe = recipe

    def state_dict(self) -> dict:
        state = {
            "backend": self.engine.name,
            "models": [self.engine.fp8_state(model) for model in self.models],
        }
        moves = [dict(moves_of(model)) for model in self.models]
        if any(moves):  # the numerics guard's moves, made again on resume before the state is loaded
            state["guard"] = moves
        numerics = [watch_state(model) for model in self.models]
        if any(numerics):  # the watch's step count and checks, the guard's streaks
            state["numerics"] = numerics
        if self.recipe is not None:
            state["recipe"] = recipe_record(self.engine, self.recipe)
        return state

    def check(self, state: dict, where: str = "FP8 checkpoint state", warn: bool = True) -> None:
        """Refuse (ValueError naming what differs, with both values) a saved state that this run
        cannot take: another engine, another number of models, or another recipe in a field the
        state depends on. Changes nothing. `warn`: say what cannot be resumed exactly (a state
        without its recipe, numerics watch state that is not there); once per load."""
        saved_backend = state.get("backend")
        if saved_backend != self.engine.name:
            raise ValueError(
                f"{where} was saved with backend {saved_backend!r} but this run uses "
                f"{self.engine.name!r}; resume with the same FP8RecipeKwargs.backend."
            )
        saved = state.get("models", [])
        if len(saved) != len(self.models):
            raise ValueError(
                f"{where} holds {len(saved)} converted model(s) but {len(self.models)} were "
                "prepared here; call load_state after preparing the same models, in the same order."
            )
        if warn:
            self._tell_what_starts_afresh(state, where)
        saved_recipe = state.get("recipe")
        if self.recipe is None or not any(saved):
            return  # no state that could be wrong
        if saved_recipe is None:
            if not warn:
                return
            logger.warning(
                "fp8plug: %s does not record its recipe (written before fp8plug recorded it); it is "
                "loaded as it is: resume with the recipe it was trained with, or its scales are wrong.", where,
            )
            return
        ours = recipe_record(self.engine, self.recipe)
        differ = [name for name in RECIPE_FIELDS if (name in saved_recipe or name in WHERE_GIVEN)
                  and saved_recipe.get(name) != ours.get(name)]
        if differ:
            fields = ", ".join(f"{name}={saved_recipe.get(name)!r} (this run: {ours.get(name)!r})" for name in differ)
            raise ValueError(
                f"{where} was saved under FP8RecipeKwargs {fields}; its scaling state would be wrong "
                "under this run's recipe. Resume with the saved value(s), or pass "
                "load_state(..., fp8_state='fresh') to keep the weights and optimizer and start the "
                "FP8 scaling state afresh, as a new run's."
            )

    def _tell_what_starts_afresh(self, state: dict, where: str) -> None:
        """One warning where a numerics watch of this run cannot continue from `state`'s."""
        numerics = state.get("numerics") or [{} for _ in self.models]
        said = {what_starts_afresh(model, saved) for model, saved in zip(self.models, numerics)} - {None}
        if said:
            logger.warning("fp8plug: %s holds no numerics watch state to continue from (saved without the watch or "
                           "the guard, or by an fp8plug that did not keep it): %s.", where, "; ".join(sorted(said)))

    def load_state_dict(self, state: dict, warn: bool = True) -> None:
        """Check `state`, then put it into the models; if an engine refuses a model's part (another
        set of converted layers, another history length), the models already loaded get their
        state back, so a refused load leaves every model as it was. The numerics watches' state
        goes in last, once the engine took its part. `warn=False`: `check` has said it already."""
        self.check(state, warn=warn)
        for model, moves in zip(self.models, state.get("guard", [])):
            apply_moves(model, self.engine, moves)
        before = self.snapshot()
        try:
            self._load(state["models"])
        except BaseException:
            self.restore(before)
            raise
        for model, saved in zip(self.models, state.get("numerics", [])):
            load_watch_state(model, saved)

    def snapshot(self) -> dict:
        """Every model's current FP8 state and numerics watch state (copies), for `restore`."""
        return {"models": [self.engine.fp8_state(model) for model in self.models],
                "numerics": [watch_state(model) for model in self.models]}

    def restore(self, snapshot: dict) -> None:
        """Put back what `snapshot` returned."""
        self._load(snapshot["models"])
        for model, saved in zip(self.models, snapshot["numerics"]):
            load_watch_state(model, saved)

    def _load(self, states: List[dict]) -> None:
        with torch.no_grad():
            for model, model_state in zip(self.models, states):
                self.engine.load_fp8_state(model, model_state)
