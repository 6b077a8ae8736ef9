"""The numerics watch and guard across save_state / load_state: a run saved at any step and
resumed is bit-identical to the uninterrupted one with the watch and the guard on (the guard's
counts of bad checks, the watch's step and the moves are part of the FP8 state); checks and
tracker steps follow the optimizer step count; a checkpoint written without that state still
loads, and says the guard starts afresh."""

import logging
import os

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs
from fp8plug.numerics.watch import watch_of
from tests.cpu.test_numerics_watch import Planted, RecordingTracker
from tests.support.hf import fresh
from tests.support.threads import one_thread  # noqa: F401 - autouse: one torch thread

STEPS = 16
GROWTH = 1.5  # the outliers of docs/numerics.md: from 1000x, 1.5x a step


def recipe(backend="native", interval=1, guard=True, **kwargs):
    return FP8RecipeKwargs(backend=backend, numerics_watch_interval=interval, numerics_guard=guard, **kwargs)


def run(kwargs, steps, resume_from=None, save_at=None, save_to=None, tracker=None):
    """Train Planted through fp8plug.Accelerator for optimizer steps `steps` (1-based), the
    outliers growing GROWTH a step; save after step `save_at`, or load `resume_from` first.
    Returns the losses, the model and the guard's warnings."""
    fresh()
    accelerator = fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[kwargs],
                                      log_with=[tracker] if tracker is not None else None)
    if tracker is not None:
        accelerator.init_trackers("resume")
    torch.manual_seed(0)
    model, teacher = Planted(), nn.Linear(60, 16)
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=3e-3))
    if resume_from:
        accelerator.load_state(resume_from)
    losses = []
    for step in steps:
        model.boost = 1000.0 * GROWTH ** (step - 1)
        x = torch.randn(128, 64, generator=torch.Generator().manual_seed(step))
        loss = nn.functional.mse_loss(model(x), teacher(x[:, 4:]).detach())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == save_at:
            accelerator.save_state(save_to)
    if tracker is not None:
        accelerator.end_training()
    return losses, accelerator.unwrap_model(model)


def guard_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "numerics guard moved" in r.getMessage()]


_STRAIGHT = {}


def straight(backend):
    """The uninterrupted guarded run of `backend` (once per module): losses, model, the guard's warnings."""
    if backend not in _STRAIGHT:
        handler = _Collect()
        logging.getLogger("fp8plug").addHandler(handler)
        try:
            losses, model = run(recipe(backend), range(1, STEPS + 1))
        finally:
            logging.getLogger("fp8plug").removeHandler(handler)
        _STRAIGHT[backend] = losses, model, [m for m in handler.messages if "numerics guard moved" in m]
    return _STRAIGHT[backend]


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_planted_case_moves_fc1():
    # the case the resumes below cut: native moves fc1 one step finer, then to bf16, a few checks
    # apart; ao (no finer scaling for one layer) straight to bf16
    _, model, warnings = straight("native")
    assert [w.split(" (")[0] for w in warnings] == ["fp8plug: the numerics guard moved fc1 to rowwise",
                                                    "fp8plug: the numerics guard moved fc1 to bf16"]
    assert type(model.fc1) is nn.Linear
    _, model, warnings = straight("ao")
    assert [w.split(" (")[0] for w in warnings] == ["fp8plug: the numerics guard moved fc1 to bf16"]
    assert type(model.fc1) is nn.Linear


def step_of(warning):
    return int(warning.rpartition("at step ")[2].rstrip(")."))


# each engine that resumes exactly: cut before any move, inside a streak of bad checks (two bad
# checks before the move after it) and between two moves
@pytest.mark.parametrize("backend,save_at", [("native", 2), ("native", 11), ("native", 13), ("ao", 10)])
def test_resumed_guarded_run_is_bit_identical(backend, save_at, tmp_path, caplog):
    losses, model, warnings = straight(backend)
    assert any(step_of(w) > save_at for w in warnings)
    ckpt = str(tmp_path / "ckpt")
    first, _ = run(recipe(backend), range(1, save_at + 1), save_at=save_at, save_to=ckpt)
    assert first == losses[:save_at]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp8plug"):
        resumed, resumed_model = run(recipe(backend), range(save_at + 1, STEPS + 1), resume_from=ckpt)
    assert resumed == losses[save_at:]  # bit for bit
    assert type(resumed_model.fc1) is type(model.fc1)
    assert watch_of(resumed_model).step == STEPS and watch_of(resumed_model).checks == STEPS
    # the same moves, at the same steps, and nothing said about starting afresh
    assert guard_warnings(caplog) == [w for w in warnings if step_of(w) > save_at]
    assert not [r for r in caplog.records if "numerics watch state" in r.getMessage()]


def test_checks_and_tracker_steps_follow_the_optimizer_steps(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    tracker = RecordingTracker()
    run(recipe(interval=2, guard=False), range(1, 4), save_at=3, save_to=ckpt, tracker=tracker)
    assert [step for step, _ in tracker.logged] == [2]
    tracker = RecordingTracker()
    _, model = run(recipe(interval=2, guard=False), range(4, 8), resume_from=ckpt, tracker=tracker)
    assert [step for step, _ in tracker.logged] == [4, 6]  # after steps 4 and 6, as if never stopped
    assert watch_of(model).step == 7


def test_a_checkpoint_without_the_watch_state_loads_and_says_the_guard_starts_afresh(tmp_path, caplog):
    ckpt = str(tmp_path / "ckpt")
    run(recipe(), range(1, 11), save_at=10, save_to=ckpt)
    # as written before the watch's state was kept: the moves only
    path = os.path.join(ckpt, "fp8_state.pt")
    state = torch.load(path, weights_only=True)
    assert "numerics" in state
    del state["numerics"]
    torch.save(state, path)
    from fp8plug.checkpoints.directory import write_manifest

    write_manifest(ckpt)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp8plug"):
        losses, model = run(recipe(), range(11, 13), resume_from=ckpt)
    said = [r.getMessage() for r in caplog.records if "numerics watch state" in r.getMessage()]
    assert len(said) == 1 and ckpt in said[0] and "guard's counts of bad checks start afresh" in said[0], said
    assert len(losses) == 2 and watch_of(model).step == 2
