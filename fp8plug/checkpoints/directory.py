"""A checkpoint directory on disk: there whole, or refused as incomplete; and read without pickle.

A save that a kill interrupts (preemption sends SIGKILL after a grace period) must not leave a
directory that resumes as half the old state and half the new one. So a save never writes into
the directory it is asked for. It writes everything into a sibling, `<dir>.fp8plug-partial`, then
writes a manifest there last (every file's relative path and size, `MANIFEST_NAME`), and only
then swaps it in: the old directory is renamed to `<dir>.fp8plug-previous`, the partial one to
`<dir>`, and the previous one is removed. Each rename is atomic; a kill between the two leaves
`<dir>` missing, which `recover` puts right (forward to the new directory if its manifest is there,
else back to the old one) before the next save or load.

A load checks the manifest first: no manifest, a listed file missing or of another size, and the
directory is refused as incomplete before anything in memory changes (`verify`).

The FP8 state file holds only tensors, strings and numbers, so it is read with
`torch.load(weights_only=True)` (`read_fp8_state`): a crafted file cannot run code.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Dict, List, Optional

import torch

logger = logging.getLogger("fp8plug")

MANIFEST_NAME = "fp8plug_manifest.json"
FP8_STATE_NAME = "fp8_state.pt"
PARTIAL_SUFFIX = ".fp8plug-partial"
PREVIOUS_SUFFIX = ".fp8plug-previous"
_FORMAT = "fp8plug-checkpoint"
_VERSION = 1
_CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)$")  # accelerate's automatic checkpoint naming


class IncompleteCheckpointError(ValueError):
    """A checkpoint directory whose save did not finish (or whose files changed since): loading it
    could mix two states, so it is refused."""


def partial_dir(path: str) -> str:
    """Where a save into `path` writes before it is complete."""
    return os.path.normpath(path) + PARTIAL_SUFFIX


def previous_dir(path: str) -> str:
    """Where the directory a save replaces waits while the new one is renamed in."""
    return os.path.normpath(path) + PREVIOUS_SUFFIX


# writing ---------------------------------------------------------------------------------------------
def start(path: str) -> str:
    """Get a save into `path` going: put right an interrupted earlier one, and return an empty
    partial directory to write into (a stale one, left by a kill, is removed: it never was a
    checkpoint)."""
    recover(path)
    work = partial_dir(path)
    if os.path.isdir(work):
        shutil.rmtree(work)
    os.makedirs(work)
    return work


def write_manifest(path: str) -> None:
    """List every file under `path` with its size, flushed to disk first, and write the list last,
    atomically (a temporary file renamed over): its presence says the directory is complete."""
    files = {}
    for root, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            relative = os.path.relpath(full, path)
            if relative == MANIFEST_NAME or os.path.islink(full):
                continue
            _fsync_file(full)
            files[relative.replace(os.sep, "/")] = os.path.getsize(full)
    temporary = os.path.join(path, MANIFEST_NAME + ".tmp")
    with open(temporary, "w") as handle:
        json.dump({"format": _FORMAT, "version": _VERSION, "files": files}, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(path, MANIFEST_NAME))
    _fsync_dir(path)


def commit(path: str) -> None:
    """Swap the complete partial directory in as `path` (the old `path`, if any, is removed once the
    new one is in place)."""
    work, previous = partial_dir(path), previous_dir(path)
    if os.path.exists(path):
        if os.path.exists(previous):
            shutil.rmtree(previous)
        os.rename(path, previous)
    os.rename(work, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if os.path.exists(previous):
        shutil.rmtree(previous)


def recover(path: str) -> None:
    """Finish or undo a swap that a kill interrupted between its two renames, so that `path` is a
    whole checkpoint again: the new (partial) directory if its manifest was written, else the old
    one. Leftovers beside a `path` that exists are stale and are removed."""
    work, previous = partial_dir(path), previous_dir(path)
    if not os.path.exists(path):
        if os.path.isfile(os.path.join(work, MANIFEST_NAME)):
            os.rename(work, path)
            logger.warning("fp8plug: %s: finished a save that was interrupted while it was being renamed in", path)
        elif os.path.isdir(previous):
            os.rename(previous, path)
            logger.warning("fp8plug: %s: put back the checkpoint that an interrupted save was replacing", path)
    if os.path.exists(path) and os.path.isdir(previous):
        shutil.rmtree(previous)


# reading ---------------------------------------------------------------------------------------------
def problem(path: str) -> Optional[str]:
    """Why `path` is not a complete checkpoint, or None if it is."""
    manifest_path = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(manifest_path):
        return (f"it has no {MANIFEST_NAME}, which a save writes last (the save was interrupted, or the "
                "directory was not written by fp8plug.Accelerator.save_state)")
    try:
        with open(manifest_path) as handle:
            manifest = json.load(handle)
        files: Dict[str, int] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its {MANIFEST_NAME} cannot be read ({exc})"
    for relative, size in sorted(files.items()):
        full = os.path.join(path, *relative.split("/"))
        if not os.path.isfile(full):
            return f"{relative}, listed in its {MANIFEST_NAME}, is missing"
        if os.path.getsize(full) != size:
            return f"{relative} has {os.path.getsize(full)} bytes but was saved with {size}"
    return None


def verify(path: str) -> None:
    """Refuse `path` with IncompleteCheckpointError unless its manifest says it is complete."""
    why = problem(path)
    if why is not None:
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: {why}; resume from a complete checkpoint (one that "
            "fp8plug's save_state finished), or, for one written by another tool that you know is "
            "complete, vouch for it once with fp8plug.checkpoints.directory.write_manifest(path)."
        )


def recover_all(folder: str) -> None:
    """`recover` every `checkpoint_<n>` in `folder` whose swap a kill interrupted."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        for suffix in (PARTIAL_SUFFIX, PREVIOUS_SUFFIX):
            if name.endswith(suffix) and _CHECKPOINT_NAME.match(name[: -len(suffix)]):
                recover(os.path.join(folder, name[: -len(suffix)]))


def latest_complete(folder: str) -> str:
    """The highest-numbered complete `checkpoint_<n>` in `folder` (accelerate's automatic naming);
    incomplete ones after it are skipped with a warning."""
    skipped: List[str] = []
    for path in checkpoints_in(folder)[::-1]:
        why = problem(path)
        if why is None:
            if skipped:
                logger.warning("fp8plug: resuming from %s; skipped the incomplete %s", path, ", ".join(skipped))
            return path
        skipped.append(f"{path} ({why})")
    raise IncompleteCheckpointError(
        f"no complete checkpoint in {folder}" + (f": {'; '.join(skipped)}" if skipped else " (it holds none)")
        + "; pass load_state the directory of a complete checkpoint."
    )


def checkpoints_in(folder: str) -> List[str]:
    """The `checkpoint_<n>` directories in `folder`, oldest (lowest n) first."""
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(folder) if (m := _CHECKPOINT_NAME.match(name))]
    return [os.path.join(folder, name) for _n, name in sorted(found)]


def read_fp8_state(path: str) -> dict:
    """The FP8 state file at `path`, read with weights_only=True: tensors, strings, numbers and
    containers only; anything else (a crafted pickle) is refused, never run."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # torch's UnpicklingError, or a damaged archive
        raise ValueError(
            f"FP8 state file {path} holds something other than tensors, strings and numbers, or is "
            f"damaged ({type(exc).__name__}); it was not written by fp8plug, so it is not loaded."
        ) from exc
    if not isinstance(state, dict):
        raise ValueError(f"FP8 state file {path} holds a {type(state).__name__}, not fp8plug's dict; it is not loaded.")
    return state


def _fsync_file(path: str) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - a platform without directory descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)
