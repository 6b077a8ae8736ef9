"""A save_state killed at any write resumes as the whole old state or the whole new one, or is
refused as incomplete, and leaves the user's own files beside and inside the checkpoint directory
as they were; automatic checkpoint naming resumes from the last complete checkpoint."""

import json
import subprocess
import sys

import pytest
import torch

from fp8plug.checkpoints.directory import IncompleteCheckpointError
from tests.support.hf import fresh
from tests.support.kill_save_worker import build, snapshot
from tests.support.processes import ROOT, child_env


def equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def outcomes(tmp_path, auto):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "tests.support.kill_save_worker", str(out)] + (["--auto"] if auto else [])
    subprocess.run(command, cwd=ROOT, env=child_env(tmp_path), check=True, timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    old = torch.load(out / "old.pt", weights_only=True)
    new = torch.load(out / "new.pt", weights_only=True)
    assert not equal(old["fp8"], new["fp8"]) and not equal(old["weights"], new["weights"])
    assert not equal(old["optimizer"], new["optimizer"]) and not equal(old["scheduler"], new["scheduler"])
    found = {}
    for name in summary["kills"] + [summary["completed_at"]]:
        fresh()
        result = out / "results" / name
        keeps_user_files(result, summary["user_files"], name)
        accelerator, model, optimizer, scheduler = build(result if auto else None, seed=123)
        try:
            accelerator.load_state(None if auto else result / "ckpt")
        except IncompleteCheckpointError as exc:
            assert "is incomplete" in str(exc)
            found[name] = "refused"
        else:
            state = snapshot(accelerator, model, optimizer, scheduler)
            found[name] = "old" if equal(state, old) else "new" if equal(state, new) else "mixed"
        keeps_user_files(result, summary["user_files"], name)  # the load's recovery too
    return summary, found


def keeps_user_files(result, files, name):
    for relative, text in files.items():
        assert (result / relative).is_file() and (result / relative).read_text() == text, (name, relative)


@pytest.mark.slow  # a process killed at each write of a save: about 15-25 s
def test_save_killed_at_any_write_resumes_whole_or_is_refused(tmp_path):
    summary, found = outcomes(tmp_path, auto=False)
    assert len(summary["kills"]) >= 10  # every write of the save was a kill point
    assert found[summary["completed_at"]] == "new"
    assert not [name for name, what in found.items() if what == "mixed"], found
    # killed before the new directory is complete, the old checkpoint survives whole
    assert "old" in found.values()


def test_automatic_naming_resumes_from_the_last_complete_checkpoint(tmp_path):
    summary, found = outcomes(tmp_path, auto=True)
    assert len(summary["kills"]) >= 10
    assert set(found.values()) == {"old", "new"}, found  # never mixed, never refused: checkpoint_0 is whole
    assert found[summary["completed_at"]] == "new"
