"""The numerics guard: a layer the watch finds bad check after check is moved, once, and told about.

Why: a per-tensor FP8 layer whose forward GEMM keeps a low SQNR, or whose delayed scale keeps
clipping its operands, costs the run more than its speed-up; left alone it shows in the loss
thousands of steps later. So a layer whose SQNR (forward or input-gradient GEMM) stays below
`min_sqnr_db`, or whose saturated fraction (any operand) stays above `max_saturation`, for
`patience` checks in a row, is moved (one layer per check, the first in the model's order;
the other layers then count afresh, as the move changes what reaches them): to the next finer
scaling where the engine offers `rescale_layer` (per tensor -> blockwise -> rowwise -> high
precision), else to high precision through the engine's own `unconvert` of that one module.
One warning names the layer, the numbers and the move. Every rank takes the same decision
(the bad flags are reduced with max).

The moves are kept on the model (`moves_of`): fp8plug's checkpoint state saves them and
`apply_moves` makes them again on resume before the FP8 state is loaded; `fp8_coverage` and the
conversion report show them. The streaks are saved too (`NumericsGuard.state_dict`, through the
watch's state), so a run resumed in the middle of one moves the layer at the check the
uninterrupted run would have.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch
from torch import nn

from fp8plug.backends.base import offers
from fp8plug.layers.gemm_counts import GUARD_MOVES
from fp8plug.layers.rules import replace_module

logger = logging.getLogger("fp8plug")
HIGH_PRECISION = "bf16"  # the word for "no FP8": the layer runs in the model's own precision
# Where a layer goes next, from the scaling it has (None: the engine's per-tensor scaling).
_LADDER = {None: ("blockwise", "rowwise", HIGH_PRECISION), "blockwise": (HIGH_PRECISION,),
           "rowwise": (HIGH_PRECISION,)}
MOVED_KIND = "moved by the numerics guard"


def moves_of(model: nn.Module) -> Dict[str, Dict]:
    """{layer fqn: {"scaling": where it went, "why": the numbers, "step": when}} for `model`:
    plain values, so they pickle and load with weights_only=True."""
    return model.__dict__.setdefault(GUARD_MOVES, {})


class NumericsGuard:
    """Counts each layer's bad checks in a row and moves the layers that reach `patience`."""

    def __init__(self, min_sqnr_db: float, max_saturation: float, patience: int):
        self.min_sqnr_db = min_sqnr_db
        self.max_saturation = max_saturation
        self.patience = patience
        self.streaks: Dict[str, List[str]] = {}  # fqn -> the reasons of its bad checks in a row

    def state_dict(self) -> Dict[str, Dict[str, List[str]]]:
        """What a checkpoint keeps of the guard: each layer's streak of bad checks (plain strings,
        so it loads with weights_only=True). The moves are kept on the model (`moves_of`)."""
        return {"streaks": {fqn: list(reasons) for fqn, reasons in self.streaks.items()}}

    def load_state_dict(self, state: Dict) -> None:
        """Put back what `state_dict` gave: the streaks, the saved run's exactly."""
        self.streaks = {str(fqn): [str(r) for r in reasons] for fqn, reasons in state.get("streaks", {}).items()}

    def why_bad(self, stats: Dict[str, float]) -> Optional[str]:
        """What is wrong with one layer's check, or None."""
        sqnr = min(stats.get("sqnr_db", float("inf")), stats.get("dgrad_sqnr_db", float("inf")))
        if sqnr < self.min_sqnr_db:
            return f"SQNR {sqnr:.1f} dB < {self.min_sqnr_db:g} dB"
        saturated = max(stats.get(f"{op}/saturated", 0.0) for op in ("input", "weight", "grad_output"))
        if saturated > self.max_saturation:
            return f"saturated {100 * saturated:.3g}% > {100 * self.max_saturation:.3g}%"
        return None

    def check(self, model: nn.Module, engine, records: Dict[str, Dict[str, float]], step: int,
              report=None) -> List[str]:
        """Fold one check into the streaks and move the first layer whose streak reached
        `patience`; returns the layers moved ([] or one)."""
        names = sorted(records)
        reasons = {fqn: self.why_bad(records[fqn]) for fqn in names}
        bad = _agree(names, reasons)
        moved = []
        for fqn in names:
            if not bad[fqn]:
                self.streaks.pop(fqn, None)
                continue
            streak = self.streaks.setdefault(fqn, [])
            streak.append(reasons[fqn] or "bad on another rank")
        due = [fqn for fqn in names if len(self.streaks.get(fqn, ())) >= self.patience]
        if due:
            # One move per check, the first layer in the model's order: a layer's error reaches the
            # layers after it (their inputs) and before it (their gradients), so the others start
            # their count again under the moved layer's new numerics.
            fqn = min(due, key=order(model).get)
            why = f"{self.streaks[fqn][-1]} for {len(self.streaks[fqn])} checks"
            self.streaks.clear()
            try:
                to = move_layer(model, engine, fqn, why, step, report)
            except CannotMove as exc:
                logger.warning("fp8plug: the numerics guard cannot move %s (%s, at step %d): %s", fqn, why, step, exc)
                return moved
            moved.append(fqn)
            logger.warning("fp8plug: the numerics guard moved %s to %s (%s, at step %d).", fqn, to, why, step)
        return moved


def order(model: nn.Module) -> Dict[str, int]:
    """Each module's position in the model's order."""
    return {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}


def _agree(names: List[str], reasons: Dict[str, Optional[str]]) -> Dict[str, bool]:
    """Each layer bad on any rank is bad on all (one all-reduce of flags), so every rank moves the
    same layers."""
    flags = torch.tensor([reasons[n] is not None for n in names], dtype=torch.float32)
    dist = torch.distributed
    if names and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else flags.device
        flags = flags.to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        flags = flags.cpu()
    return {n: bool(f) for n, f in zip(names, flags.tolist())}


def move_layer(model: nn.Module, engine, fqn: str, why: str, step: int = 0, report=None,
               to: Optional[str] = None) -> str:
    """Move converted layer `fqn` of `model` one step finer (or to `to`, as a resume replays it),
    record the move, and return where it went."""
    moves = moves_of(model)
    current = moves.get(fqn, {}).get("scaling")
    choices = (to,) if to else _LADDER.get(current, (HIGH_PRECISION,))
    done = None
    if offers(engine, "rescale_layer"):
        for word in choices:
            try:
                engine.rescale_layer(model, fqn, word)
            except ValueError:
                continue
            done = word
            break
    if done is None:
        to_high_precision(model, engine, fqn)
        done = HIGH_PRECISION
    moves[fqn] = {"scaling": done, "why": why, "step": int(step)}
    if report is not None:
        _tell_report(report, fqn, done, why)
    return done


class CannotMove(RuntimeError):
    """A layer the guard would move but cannot (sharded by FSDP2, whose hooks live on the module)."""


def to_high_precision(model: nn.Module, engine, fqn: str) -> None:
    """Put back the plain module for converted layer `fqn` alone, by the engine's own `unconvert`
    run on a holder of just that module (its Parameters kept, so optimizers stay valid)."""
    module = model.get_submodule(fqn)
    if type(module).__name__.startswith("FSDP"):  # fully_shard gave the module a class of its own
        raise CannotMove("it is sharded by FSDP2 (fully_shard), whose hooks a new module would not have; "
                         "leave it in high precision from the start with FP8RecipeKwargs.modules_to_ignore")
    holder = nn.Module()
    holder.add_module("layer", module)
    engine.unconvert(holder)
    replace_module(model, fqn, holder.layer)


def _tell_report(report, fqn: str, scaling: str, why: str) -> None:
    """The conversion report shows the move: a layer now in high precision is listed with those
    left there, kind MOVED_KIND; one moved to a finer FP8 scaling gets a note."""
    text = f"moved to {scaling} by the numerics guard ({why})"
    if scaling == HIGH_PRECISION:
        if fqn in report.converted:
            report.converted.remove(fqn)
        report.skip(fqn, text, MOVED_KIND, note=why)
    else:
        report.notes[fqn] = text


def apply_moves(model: nn.Module, engine, saved: Dict[str, Dict], report=None) -> None:
    """Make the moves a checkpoint recorded (`saved`, as moves_of gave it) that `model` has not
    made yet: on resume, before the layers' FP8 state is loaded into the layers as they were."""
    moves = moves_of(model)
    for fqn, move in saved.items():
        if moves.get(fqn, {}).get("scaling") == move["scaling"]:
            continue
        try:
            model.get_submodule(fqn)
        except AttributeError:
            raise ValueError(f"FP8 checkpoint state: the numerics guard moved {fqn!r}, which this model does not "
                             "have; resume the model the checkpoint was saved from.") from None
        move_layer(model, engine, fqn, move.get("why", ""), move.get("step", 0), report, to=move["scaling"])
