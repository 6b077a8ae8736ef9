"""What load_state refuses, and that a refusal changes nothing: another recipe, an incomplete or
altered directory, a crafted FP8 state file, weights or optimizers that do not fit."""

import os

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs
from fp8plug.checkpoints.directory import (
    FP8_STATE_NAME,
    MANIFEST_NAME,
    IncompleteCheckpointError,
    read_fp8_state,
    write_manifest,
)
from tests.cpu.test_checkpoint_atomic import equal
from tests.support.hf import fresh
from tests.support.kill_save_worker import snapshot, train

SAVED = dict(backend="native", amax_history_len=4)


def prepared(seed=0, hidden=64, groups=1, **recipe):
    fresh()
    acc = fp8plug.Accelerator(cpu=True, mixed_precision="fp8",
                              kwargs_handlers=[FP8RecipeKwargs(**{**SAVED, **recipe})])
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, hidden), nn.GELU(), nn.Linear(hidden, 32))
    params = [{"params": [p]} for p in model.parameters()] if groups > 1 else model.parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    return acc, model, optimizer, scheduler


@pytest.fixture
def checkpoint(tmp_path):
    """A complete checkpoint after two native delayed-scaling steps under SAVED."""
    acc, model, optimizer, scheduler = prepared()
    train(acc, model, optimizer, scheduler, 2, seed=1)
    acc.save_state(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def refused_unchanged(path, match, error=ValueError, **setup):
    """load_state(path) in a run made by prepared(**setup) (seed 7, one step trained) raises
    `error` matching `match`, and weights, optimizer, scheduler and FP8 state are as before."""
    acc, model, optimizer, scheduler = prepared(seed=7, **setup)
    train(acc, model, optimizer, scheduler, 1, seed=3)
    before = snapshot(acc, model, optimizer, scheduler)
    with pytest.raises(error, match=match):
        acc.load_state(path)
    assert equal(snapshot(acc, model, optimizer, scheduler), before)
    return acc


@pytest.mark.parametrize("field, value, saved", [
    ("fp8_format", "E4M3", "'HYBRID'"),
    ("margin", 1, "0"),
    ("amax_history_len", 8, "4"),
    ("amax_compute_algo", "max", "'most_recent'"),
    ("interval", 10, "1"),
    ("scaling", "dynamic", "'delayed'"),
])
def test_another_recipe_is_refused_naming_the_field_and_both_values(checkpoint, field, value, saved):
    refused_unchanged(checkpoint, rf"{field}={saved} \(this run: {value!r}\)", **{field: value})


def test_another_engine_is_refused(checkpoint):
    pytest.importorskip("torchao.float8")
    refused_unchanged(checkpoint, "saved with backend 'native' but this run uses 'ao'", backend="ao")


def test_fresh_fp8_state_resumes_the_rest_under_a_changed_recipe(checkpoint):
    acc, model, optimizer, scheduler = prepared(seed=7, margin=1)
    fresh_fp8 = acc.fp8_engine.fp8_state(model)
    acc.load_state(checkpoint, fp8_state="fresh")
    acc2, model2, optimizer2, scheduler2 = prepared(seed=7)
    acc2.load_state(checkpoint)
    loaded, reference = snapshot(acc, model, optimizer, scheduler), snapshot(acc2, model2, optimizer2, scheduler2)
    assert equal(loaded["weights"], reference["weights"]) and equal(loaded["optimizer"], reference["optimizer"])
    assert equal(loaded["fp8"], fresh_fp8) and not equal(loaded["fp8"], reference["fp8"])


def test_the_recipe_is_saved_with_the_fp8_state(checkpoint):
    state = read_fp8_state(str(checkpoint / FP8_STATE_NAME))
    assert state["recipe"] == {"backend": "native", "scaling": "delayed", "fp8_format": "HYBRID", "margin": 0,
                               "amax_history_len": 4, "amax_compute_algo": "most_recent", "interval": 1}


def test_a_directory_without_manifest_or_with_a_changed_file_is_refused_as_incomplete(checkpoint):
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a file cut short after the save
    refused_unchanged(checkpoint, "model.safetensors has .* bytes but was saved with", IncompleteCheckpointError)
    weights.write_bytes(data)
    os.remove(checkpoint / MANIFEST_NAME)  # what a save that never finished leaves
    refused_unchanged(checkpoint, f"is incomplete: it has no {MANIFEST_NAME}", IncompleteCheckpointError)
    write_manifest(str(checkpoint))  # vouched for: loads again
    prepared()[0].load_state(checkpoint)


class RunsCode:
    """Unpickled, it creates the file `marker`: what a crafted checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_crafted_fp8_state_file_runs_no_code(checkpoint, tmp_path):
    marker = tmp_path / "code_ran"
    state = read_fp8_state(str(checkpoint / FP8_STATE_NAME))
    state["backend"] = RunsCode(str(marker))
    torch.save(state, checkpoint / FP8_STATE_NAME)
    write_manifest(str(checkpoint))  # the attacker updates the manifest too
    refused_unchanged(checkpoint, "holds something other than tensors")
    with pytest.raises(ValueError, match="holds something other than tensors"):  # the Trainer's reader too
        read_fp8_state(str(checkpoint / FP8_STATE_NAME))
    assert not marker.exists()


def test_fp8_state_of_other_layers_is_refused_without_changing_anything(checkpoint):
    # the engine's own check (another set of converted layers) comes after the recipe's
    refused_unchanged(checkpoint, "convert the model with the same recipe", modules_to_ignore=["2"])


def test_weights_that_do_not_fit_are_refused_before_any_is_loaded(checkpoint, tmp_path):
    # the FP8 state fits (same layers and history), the weight shapes do not: torch would copy the
    # tensors that fit before raising
    refused_unchanged(checkpoint, r"do not fit model 0: 0.bias \(64,\) \(here \(48,\)\), 0.weight \(64, 32\)",
                      hidden=48)


def test_an_optimizer_that_does_not_fit_is_refused_before_the_weights_are_loaded(checkpoint):
    refused_unchanged(checkpoint, r"parameter groups of sizes \[4\] but this one has \[1, 1, 1, 1\]", groups=4)


def test_a_failure_inside_accelerate_puts_the_fp8_state_back(checkpoint, monkeypatch):
    import accelerate

    def broken(self, *args, **kwargs):
        raise RuntimeError("disk went away")

    monkeypatch.setattr(accelerate.Accelerator, "load_state", broken)
    refused_unchanged(checkpoint, "disk went away", RuntimeError)
