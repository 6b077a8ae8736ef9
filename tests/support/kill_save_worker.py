"""Kill `Accelerator.save_state` at every file-system write, one write at a time.

    python -m tests.support.kill_save_worker OUT [--auto]

Trains a small native-FP8 model, saves a complete checkpoint (the old state), trains on (the new
state), then for n = 1, 2, ... forks a child that saves the new state over the old checkpoint and
SIGKILLs itself at its n-th write (a file opened for writing, torch.save, safetensors, a rename or a
removal); "during" kills write the file, cut it to half its size, then kill. What each kill left
is copied to OUT/results/<n>-<when>; OUT/old.pt and OUT/new.pt hold the two states, and
OUT/summary.json the kills and the user's own files (beside and inside the checkpoint directory),
which every kill must leave as they were. With --auto the checkpoints are automatically named
(checkpoint_0, then checkpoint_1, total_limit=1). tests/cpu/test_checkpoint_atomic.py loads each result.
"""

import argparse
import copy
import json
import os
import shutil
import signal
import sys

import torch
from torch import nn

RECIPE = dict(backend="native", amax_history_len=4)
# the user's own files beside and inside the checkpoint directories (relative to the work folder): every kill keeps them
USER_FILES = {
    "named": {"notes.txt": "beside\n", "ckpt/notes.txt": "inside\n", "ckpt/logs/run.log": "step 2\n"},
    "named, after the first save": {"ckpt/later.txt": "added later\n"},
    "auto": {"notes.txt": "beside\n", "checkpoints/README.txt": "mine\n"},
    "auto, after the first save": {"checkpoints/checkpoint_0/notes.txt": "inside\n"},
}


def build(project_dir=None, seed=0, total_limit=1):
    """The accelerator, model, optimizer and scheduler both this worker and the test use."""
    from accelerate.utils import ProjectConfiguration

    import fp8plug
    from fp8plug import FP8RecipeKwargs

    kwargs = {}
    if project_dir is not None:
        kwargs["project_config"] = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True,
                                                        total_limit=total_limit)
    accelerator = fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(**RECIPE)],
                                      **kwargs)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def train(accelerator, model, optimizer, scheduler, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        accelerator.backward(model(x).float().pow(2).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def snapshot(accelerator, model, optimizer, scheduler):
    """Everything a resume restores, as copies."""
    return {
        "weights": {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()["state"]),
        "scheduler": copy.deepcopy(scheduler.state_dict()),
        "fp8": accelerator.fp8_engine.fp8_state(accelerator.unwrap_model(model)),
    }


def put(folder, files):
    for relative, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, relative)), exist_ok=True)
        with open(os.path.join(folder, relative), "w") as handle:
            handle.write(text)


def kill_at(n, during):
    """From now on, SIGKILL this process at its n-th file-system write."""
    import accelerate.utils.other as accelerate_other

    count = [0]

    def tick():
        count[0] += 1
        return count[0] == n

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(save, path_arg):
        def saving(*args, **kwargs):
            if not tick():
                return save(*args, **kwargs)
            if not during:
                die()
            save(*args, **kwargs)
            path = args[path_arg]
            with open(path, "r+b") as handle:  # counted as a write too, but n is already passed
                handle.truncate(os.path.getsize(path) // 2)
            die()
        return saving

    torch.save = wrap(torch.save, 1)
    accelerate_other.safe_save_file = wrap(accelerate_other.safe_save_file, 1)

    def hook(event, args):
        if event == "open":
            mode, flags = args[1], args[2]
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(
                flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writing and tick():
                die()
        elif event in ("os.rename", "os.replace", "shutil.rmtree", "os.remove", "os.mkdir", "os.rmdir") and tick():
            die()

    sys.addaudithook(hook)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--auto", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # forked children must not inherit a busy thread pool
    out = os.path.abspath(args.out)
    work = os.path.join(out, "work")
    pristine = os.path.join(out, "pristine")
    results = os.path.join(out, "results")
    os.makedirs(results)
    accelerator, model, optimizer, scheduler = build(work if args.auto else None)
    target = None if args.auto else os.path.join(work, "ckpt")
    put(work, USER_FILES["auto" if args.auto else "named"])
    train(accelerator, model, optimizer, scheduler, 2, seed=1)
    accelerator.save_state(target)
    put(work, USER_FILES["auto, after the first save" if args.auto else "named, after the first save"])
    torch.save(snapshot(accelerator, model, optimizer, scheduler), os.path.join(out, "old.pt"))
    train(accelerator, model, optimizer, scheduler, 2, seed=2)
    torch.save(snapshot(accelerator, model, optimizer, scheduler), os.path.join(out, "new.pt"))
    shutil.copytree(work, pristine)
    summary = {"kills": [], "completed_at": None, "user_files": {}}
    for kind, files in USER_FILES.items():
        if kind.startswith("auto") == args.auto:
            summary["user_files"].update(files)
    for n in range(1, 100):
        for when in ("before", "during"):
            shutil.rmtree(work)
            shutil.copytree(pristine, work)
            pid = os.fork()
            if pid == 0:
                kill_at(n, when == "during")
                accelerator.save_state(target)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            shutil.copytree(work, os.path.join(results, f"{n}-{when}"))
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                summary["kills"].append(f"{n}-{when}")
            elif os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                summary["completed_at"] = f"{n}-{when}"
                break
            else:
                raise SystemExit(f"save child ended with status {status}")
        if summary["completed_at"]:
            break
    with open(os.path.join(out, "summary.json"), "w") as handle:
        json.dump(summary, handle)


if __name__ == "__main__":
    main()
