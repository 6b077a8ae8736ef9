"""The output directory of save_state: what is in it stays, a file is refused up front, a symlink is
followed, only the directory itself need be writable, total_limit keeps the newest checkpoint, and
two runs saving into one directory at once take turns."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from fp8plug.checkpoints.directory import MANIFEST_NAME
from tests.cpu.test_checkpoint_atomic import equal
from tests.support.hf import fresh
from tests.support.kill_save_worker import build, snapshot, train
from tests.support.processes import ROOT, child_env

USER_FILES = {"notes.txt": "my notes\n", "logs/run.log": "step 1\n"}


def trained(project_dir=None, seed=0, steps=2, **config):
    fresh()
    accelerator, model, optimizer, scheduler = build(project_dir, seed=seed, **config)
    train(accelerator, model, optimizer, scheduler, steps, seed=seed + 1)
    return accelerator, (model, optimizer, scheduler)


def state(accelerator, objects):
    return snapshot(accelerator, *objects)


def resumed(path=None, project_dir=None, **config):
    """What load_state(path) gives a fresh run."""
    fresh()
    accelerator, model, optimizer, scheduler = build(project_dir, seed=123, **config)
    accelerator.load_state(None if path is None else str(path))
    return snapshot(accelerator, model, optimizer, scheduler)


def put(folder, files):
    for relative, text in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)


def has(folder, files):
    return all((folder / r).is_file() and (folder / r).read_text() == text for r, text in files.items())


def no_leftovers(folder):
    return not [name for name in os.listdir(folder) if name.startswith(".fp8plug-") or "fp8plug-" in name]


def test_the_users_files_in_the_output_directory_stay(tmp_path):
    ckpt = tmp_path / "ckpt"
    put(ckpt, USER_FILES)
    accelerator, objects = trained(seed=0)
    accelerator.register_for_checkpointing(torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)]), 1))
    accelerator.save_state(ckpt)
    assert has(ckpt, USER_FILES) and (ckpt / "custom_checkpoint_0.pkl").is_file()
    accelerator, objects = trained(seed=1)  # another state, without the registered object
    accelerator.save_state(ckpt)
    assert has(ckpt, USER_FILES) and no_leftovers(ckpt) and no_leftovers(tmp_path)
    assert not (ckpt / "custom_checkpoint_0.pkl").exists()  # the old checkpoint's file the new one lacks
    assert equal(resumed(ckpt), state(accelerator, objects))


def test_save_into_the_current_directory(tmp_path, monkeypatch):
    put(tmp_path, USER_FILES)
    monkeypatch.chdir(tmp_path)
    accelerator, objects = trained()
    accelerator.save_state(".")
    accelerator.save_state(".")
    assert has(tmp_path, USER_FILES) and no_leftovers(tmp_path)
    assert equal(resumed("."), state(accelerator, objects))


@pytest.mark.parametrize("kind", ["file", "link to a file", "link to nothing"])
def test_a_path_that_is_not_a_directory_is_refused_before_anything_is_written(tmp_path, kind):
    target = tmp_path / "results.json"
    if kind == "file":
        target.write_text("{}")
    else:
        if kind == "link to a file":
            (tmp_path / "elsewhere.json").write_text("{}")
        target.symlink_to(tmp_path / "elsewhere.json")
    before = sorted(os.listdir(tmp_path))
    accelerator, _ = trained()
    with pytest.raises(FileExistsError, match=re.escape(str(target)) + " is a .*(not a directory|does not exist)"):
        accelerator.save_state(target)
    assert sorted(os.listdir(tmp_path)) == before
    assert target.is_symlink() == (kind != "file")
    if kind == "file":
        assert target.read_text() == "{}"


def test_a_symlinked_directory_is_followed_and_stays_a_link(tmp_path):
    storage = tmp_path / "big_disk" / "run1"
    put(storage, USER_FILES)
    link = tmp_path / "ckpt"
    link.symlink_to(storage, target_is_directory=True)
    accelerator, objects = trained()
    accelerator.save_state(link)
    train(accelerator, *objects, 1, seed=5)
    accelerator.save_state(link)  # again, over the first
    assert link.is_symlink() and os.readlink(link) == str(storage)
    assert (storage / MANIFEST_NAME).is_file() and (storage / "model.safetensors").is_file()
    assert has(storage, USER_FILES) and no_leftovers(storage) and sorted(os.listdir(tmp_path)) == ["big_disk", "ckpt"]
    assert equal(resumed(link), state(accelerator, objects))


def test_only_the_output_directory_need_be_writable(tmp_path):
    parent = tmp_path / "shared"
    ckpt = parent / "mine"
    ckpt.mkdir(parents=True)
    put(ckpt, USER_FILES)
    parent.chmod(0o555)
    try:
        try:
            (parent / "probe").write_text("")
        except PermissionError:
            pass
        else:
            pytest.skip("chmod does not stop this user writing (root)")
        accelerator, objects = trained()
        accelerator.save_state(ckpt)
        train(accelerator, *objects, 1, seed=5)
        accelerator.save_state(ckpt)
        assert equal(resumed(ckpt), state(accelerator, objects))
        assert has(ckpt, USER_FILES) and no_leftovers(ckpt) and os.listdir(parent) == ["mine"]
    finally:
        parent.chmod(0o755)


def test_a_file_of_the_users_that_the_save_would_replace_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    put(ckpt, {"model.safetensors": "mine", **USER_FILES})
    accelerator, _ = trained()
    with pytest.raises(FileExistsError,
                       match=re.escape(f"{ckpt / 'model.safetensors'} is already there and no fp8plug manifest")):
        accelerator.save_state(ckpt)
    assert has(ckpt, {"model.safetensors": "mine", **USER_FILES}) and no_leftovers(ckpt)
    assert sorted(os.listdir(ckpt)) == ["logs", "model.safetensors", "notes.txt"]


def test_a_crafted_manifest_makes_no_save_remove_anything_outside_the_checkpoint(tmp_path):
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside.txt"
    outside.write_text("mine")
    accelerator, objects = trained()
    accelerator.save_state(ckpt)
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    manifest["files"].update({"../outside.txt": 4, str(outside): 4, ".fp8plug-lock": 0})
    (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))
    accelerator.save_state(ckpt)
    assert outside.read_text() == "mine"
    assert equal(resumed(ckpt), state(accelerator, objects))


@pytest.mark.parametrize("total_limit, kept", [(0, [2]), (1, [2]), (2, [1, 2])])
def test_total_limit_keeps_the_newest_checkpoints_as_accelerate_does(tmp_path, total_limit, kept):
    accelerator, objects = trained(tmp_path, total_limit=total_limit)
    put(tmp_path / "checkpoints", {"README.txt": "mine"})
    for step in range(3):
        train(accelerator, *objects, 1, seed=10 + step)
        path = accelerator.save_state()
        assert path.is_dir() and (path / MANIFEST_NAME).is_file()
        if step == 0:
            put(path, {"notes.txt": "mine"})  # the user's file in a checkpoint total_limit removes
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    expected = sorted(["README.txt"] + [f"checkpoint_{n}" for n in kept] + (["checkpoint_0"] if 0 not in kept else []))
    assert names == expected
    # only the user's file is left
    assert sorted(os.listdir(tmp_path / "checkpoints" / "checkpoint_0")) == ["notes.txt"]
    assert equal(resumed(project_dir=tmp_path, total_limit=total_limit), state(accelerator, objects))


def test_two_runs_saving_into_one_directory_at_once_take_turns(tmp_path):
    ckpt, go = tmp_path / "ckpt", tmp_path / "go"
    put(ckpt, USER_FILES)
    command = [sys.executable, "-m", "tests.cpu.test_checkpoint_dirs", str(ckpt), str(go)]
    children = [subprocess.Popen(command + [str(seed), str(tmp_path / f"state_{seed}.pt")], cwd=ROOT,
                                 env=child_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for seed in (1, 2)]
    deadline = time.time() + 400
    while not all((tmp_path / f"ready_{seed}").exists() for seed in (1, 2)):
        assert time.time() < deadline and all(c.poll() is None for c in children), [c.communicate() for c in children]
        time.sleep(0.1)
    go.write_text("")
    outputs = [c.communicate(timeout=400)[0] for c in children]
    assert [c.returncode for c in children] == [0, 0], outputs
    assert any("another save into it is under way" in out for out in outputs), outputs  # they did overlap
    states = [torch.load(tmp_path / f"state_{seed}.pt", weights_only=True) for seed in (1, 2)]
    assert not equal(states[0], states[1])
    loaded = resumed(ckpt)
    assert equal(loaded, states[0]) or equal(loaded, states[1])
    assert has(ckpt, USER_FILES) and no_leftovers(ckpt)


def _save_when_told(ckpt, go, seed, state_file):
    """A run for the test above: train with `seed`, wait for `go`, save slowly into `ckpt`."""
    torch.set_num_threads(1)
    accelerator, objects = trained(seed=seed)
    torch.save(state(accelerator, objects), state_file)
    slow, real = [0.3], torch.save

    def slow_save(*args, **kwargs):  # every file takes a while: the two saves overlap
        time.sleep(slow[0])
        return real(*args, **kwargs)

    torch.save = slow_save
    open(os.path.join(os.path.dirname(go), f"ready_{seed}"), "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    accelerator.save_state(ckpt)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    _save_when_told(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
