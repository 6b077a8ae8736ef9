"""A checkpoint directory on disk: there whole, or refused as incomplete; and read without pickle.

A save that a kill interrupts (preemption sends SIGKILL after a grace period) must not leave a
directory that resumes as half the old state and half the new one, and must not touch what it did
not write: the user's own files in the directory, the directory itself (a symlink stays a link),
its parent (which may be read-only). So a save writes only inside `<dir>`, under an exclusive lock
(`<dir>/.fp8plug-lock`, flock, removed at the end), into `<dir>/.fp8plug-partial`. The manifest
(each file's relative path and size, `MANIFEST_NAME`) is written there last: from then on the save
goes forward. The commit moves `<dir>`'s old manifest into the partial directory (as the list of
the old checkpoint's files), moves each new file into `<dir>` (replacing the old one of its name),
removes the old checkpoint's files the new one lacks, moves the new manifest in last and removes
the partial directory. A kill leaves one of these states, which `recover` (under the lock, before
every save and load) resolves:

- partial directory without a manifest: the save had not finished writing (`<dir>` is untouched:
  the old checkpoint, or none), or the commit had moved the new manifest in (`<dir>` is the new
  checkpoint). Either way the partial directory is not a checkpoint and is removed.
- partial directory with its manifest: the commit is finished, whichever step it reached (each
  step is a rename or a removal, done again or skipped). Until then `<dir>` holds either its old
  manifest with the old files untouched, or no manifest: whole-old or refused, never mixed.
- no partial directory: nothing to do.

A file the save would write over that no manifest in `<dir>` lists is not the checkpoint's: the
save is refused before it commits. Files a manifest lists belong to the checkpoint.

A load checks the manifest first: no manifest, a listed file missing or of another size, and the
directory is refused as incomplete before anything in memory changes (`verify`).

The FP8 state file holds only tensors, strings and numbers, so it is read with
`torch.load(weights_only=True)` (`read_fp8_state`): a crafted file cannot run code.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import socket
from typing import Dict, List, Optional

import torch

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

logger = logging.getLogger("fp8plug")

MANIFEST_NAME = "fp8plug_manifest.json"
FP8_STATE_NAME = "fp8_state.pt"
OWN_PREFIX = ".fp8plug-"  # fp8plug's own entries in a checkpoint directory: never part of a checkpoint
PARTIAL_NAME = OWN_PREFIX + "partial"
LOCK_NAME = OWN_PREFIX + "lock"
_REPLACED_NAME = OWN_PREFIX + "replaced.json"  # in the partial directory, during a commit: the old manifest
_FORMAT = "fp8plug-checkpoint"
_VERSION = 1
_CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)$")  # accelerate's automatic checkpoint naming
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF}


class IncompleteCheckpointError(ValueError):
    """A checkpoint directory whose save did not finish (or whose files changed since): loading it
    could mix two states, so it is refused."""


def partial_dir(path: str) -> str:
    """Where a save into `path` writes before it is complete (inside `path`)."""
    return os.path.join(path, PARTIAL_NAME)


# writing ---------------------------------------------------------------------------------------------
def check_output(path: str) -> None:
    """Refuse, before anything is written, an output path that is not a directory: a file, a
    symlink to a file, a symlink to nothing (accelerate refuses them too). A symlink to a directory
    is fine: the checkpoint is written through it, onto the target's storage."""
    if os.path.islink(path) and not os.path.exists(path):
        raise FileExistsError(
            f"save_state: {path} is a symbolic link to {os.readlink(path)}, which does not exist; create that "
            "directory (the checkpoint is written there, through the link) or remove the link."
        )
    if os.path.lexists(path) and not os.path.isdir(path):
        what = "a symbolic link to a file" if os.path.islink(path) else "a file"
        raise FileExistsError(
            f"save_state: {path} is {what}, not a directory; nothing was written. Pass the directory to save "
            f"the checkpoint in (a new or an existing one), or move {path} away."
        )


def taken(path: str) -> bool:
    """Whether `path` holds anything but fp8plug's leftovers of a save that never committed (so an
    automatically named checkpoint may not be written there)."""
    if not os.path.lexists(path):
        return False
    if not os.path.isdir(path):
        return True
    if os.path.isfile(os.path.join(partial_dir(path), MANIFEST_NAME)):
        return True  # a committed save that a kill interrupted: recover finishes it
    return any(not name.startswith(OWN_PREFIX) for name in os.listdir(path))


class Save:
    """One save into a directory, from `start` on: holds the directory's lock until `close`."""

    def __init__(self, path: str, lock: "_Lock"):
        self.path, self.work, self._lock = path, partial_dir(path), lock

    def commit(self) -> None:
        """Refuse files of someone else's that the save would write over, write the manifest, and
        move the checkpoint into place (module doc)."""
        old = _listed(os.path.join(self.path, MANIFEST_NAME)) or {}
        clashes = [rel for rel in _files(self.work) if rel not in old and _clash(self.path, rel)]
        if clashes:
            raise FileExistsError(
                f"save_state: {os.path.join(self.path, clashes[0])} is already there and no fp8plug manifest in "
                f"{self.path} lists it (it was not written by fp8plug's save_state); nothing was changed. Move "
                f"{', '.join(clashes[:5])} out of {self.path}, or save into another directory."
            )
        write_manifest(self.work)
        _commit(self.path)

    def close(self) -> None:
        """Release the lock; a partial directory that was never committed is removed first."""
        try:
            if os.path.isdir(self.work) and not os.path.isfile(os.path.join(self.work, MANIFEST_NAME)):
                shutil.rmtree(self.work)
        finally:
            self._lock.release()


def start(path: str) -> Save:
    """Get a save into `path` going: create `path` if need be, take its lock (waiting for another
    save into it to finish), put right an interrupted earlier save, and make an empty partial
    directory to write into."""
    check_output(path)
    os.makedirs(path, exist_ok=True)
    lock = _Lock(path)
    try:
        _recover(path)
        os.makedirs(partial_dir(path))
    except BaseException:
        lock.release()
        raise
    return Save(path, lock)


def write_manifest(path: str) -> None:
    """List every file under `path` with its size, flushed to disk first, and write the list last,
    atomically (a temporary file renamed over): its presence says the directory is complete.
    fp8plug's own entries (`.fp8plug-*`) are left out. Called on a directory by hand (to vouch for
    it), it claims every file in it as the checkpoint's: a later save replaces or removes them."""
    files = {}
    for relative in _files(path):
        _fsync_file(os.path.join(path, *relative.split("/")))
        files[relative] = os.path.getsize(os.path.join(path, *relative.split("/")))
    temporary = os.path.join(path, MANIFEST_NAME + ".tmp")
    with open(temporary, "w") as handle:
        json.dump({"format": _FORMAT, "version": _VERSION, "files": files}, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(path, MANIFEST_NAME))
    _fsync_dir(path)


def recover(path: str) -> None:
    """Finish or drop a save into `path` that a kill interrupted (module doc), under `path`'s lock.
    Nothing to do, nothing is written: a read-only checkpoint loads."""
    if os.path.isdir(partial_dir(path)):
        lock = _Lock(path)
        try:
            _recover(path)
        finally:
            lock.release()


def remove(path: str) -> None:
    """Remove the checkpoint `path` (for `total_limit`): the files its manifest lists (manifest last,
    so a kill leaves the list of what is left) and fp8plug's own entries; then `path` itself if it
    is an empty directory. Anything else in it stays, and is named."""
    if not os.path.isdir(path):
        return
    lock = _Lock(path)
    try:
        _recover(path)
        manifest = os.path.join(path, MANIFEST_NAME)
        for relative in _listed(manifest) or {}:
            _remove_listed(path, relative)
        if os.path.isfile(manifest):
            os.remove(manifest)
    finally:
        lock.release()
    kept = sorted(os.listdir(path))
    if kept:
        logger.warning("fp8plug: removed checkpoint %s but kept what fp8plug did not write there: %s",
                       path, ", ".join(kept[:5]))
    elif not os.path.islink(path):
        os.rmdir(path)


def _commit(path: str) -> None:
    """Move the complete partial directory's files into `path` (module doc). Each step is a rename
    or a removal that is skipped once done, so a commit a kill interrupted is finished by running
    this again."""
    work = partial_dir(path)
    new = {relative for relative in _listed(os.path.join(work, MANIFEST_NAME)) or {} if _plain(relative)}
    replaced = os.path.join(work, _REPLACED_NAME)
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        os.replace(os.path.join(path, MANIFEST_NAME), replaced)  # `path` is no longer a whole checkpoint
    old = (_listed(replaced) or {}) if os.path.isfile(replaced) else {}
    for relative in new:
        source, target = os.path.join(work, *relative.split("/")), os.path.join(path, *relative.split("/"))
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(source, target)
    for relative in old:
        if relative not in new:
            _remove_listed(path, relative)
    for folder in {os.path.dirname(os.path.join(path, *r.split("/"))) for r in new}:
        _fsync_dir(folder)
    os.replace(os.path.join(work, MANIFEST_NAME), os.path.join(path, MANIFEST_NAME))
    _fsync_dir(path)
    shutil.rmtree(work)


def _recover(path: str) -> None:
    """`recover`, with the lock held."""
    work = partial_dir(path)
    if not os.path.isdir(work):
        return
    if _listed(os.path.join(work, MANIFEST_NAME)) is not None:
        _commit(path)
        logger.warning("fp8plug: %s: finished a save that was interrupted while it was being moved into place", path)
    else:
        shutil.rmtree(work)  # the save never got as far as its manifest: never a checkpoint


def _files(path: str) -> List[str]:
    """Every file under `path` ('/'-separated, relative), without links, the manifest (and its
    temporary) and fp8plug's own entries at the top."""
    found = []
    for root, dirs, names in os.walk(path):
        if root == path:
            dirs[:] = [d for d in dirs if not d.startswith(OWN_PREFIX)]
        for name in names:
            full = os.path.join(root, name)
            relative = os.path.relpath(full, path).replace(os.sep, "/")
            if os.path.islink(full) or (
                    root == path and (name.startswith(MANIFEST_NAME) or name.startswith(OWN_PREFIX))):
                continue
            found.append(relative)
    return sorted(found)


def _listed(manifest: str) -> Optional[Dict[str, int]]:
    """The files a manifest lists, or None if there is none or it cannot be read."""
    try:
        with open(manifest) as handle:
            files = json.load(handle)["files"]
        return files if isinstance(files, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _plain(relative: str) -> bool:
    """Whether a manifest entry is a plain relative path of a checkpoint file (a manifest could be
    crafted to name ../ anything, or fp8plug's own entries)."""
    parts = relative.split("/") if isinstance(relative, str) else [""]
    return not (any(p in ("", ".", "..") for p in parts) or parts[0].startswith(OWN_PREFIX)
                or relative == MANIFEST_NAME or relative.startswith("/") or "\\" in relative)


def _inside(path: str, relative: str) -> Optional[str]:
    """`path`/`relative` if `relative` is plain and no link takes it out of `path`, else None."""
    if not _plain(relative):
        return None
    full = os.path.join(path, *relative.split("/"))
    root = os.path.realpath(path)
    if os.path.commonpath([root, os.path.realpath(os.path.dirname(full))]) != root:
        return None
    return full


def _clash(path: str, relative: str) -> bool:
    """Whether writing `relative` into `path` would replace something there (or a folder on its way)."""
    parts = relative.split("/")
    if os.path.lexists(os.path.join(path, *parts)):
        return True
    for i in range(1, len(parts)):
        folder = os.path.join(path, *parts[:i])
        if os.path.lexists(folder) and (os.path.islink(folder) or not os.path.isdir(folder)):
            return True
    return False


def _remove_listed(path: str, relative: str) -> None:
    """Remove a file a manifest in `path` lists, if it is still there, and the folders that leaves empty."""
    full = _inside(path, relative)
    if full is None or os.path.islink(full) or not os.path.isfile(full):
        return
    os.remove(full)
    parts = relative.split("/")
    for i in range(len(parts) - 1, 0, -1):
        folder = os.path.join(path, *parts[:i])
        if os.listdir(folder):
            break
        os.rmdir(folder)


class _Lock:
    """An exclusive flock on `<dir>/.fp8plug-lock`, so two saves into one directory (two runs) take
    turns instead of mixing their files. The file holds its holder's pid and host, and is removed on
    release. Where the file system has no locks, a warning says that saves are not serialised."""

    def __init__(self, path: str):
        self.file = os.path.join(path, LOCK_NAME)
        self.fd: Optional[int] = None
        waited = False
        while True:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
            try:
                if fcntl is None:
                    raise OSError(errno.ENOSYS, "no fcntl")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if not waited:
                        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                        logger.warning("fp8plug: %s: another save into it is under way (%s); waiting for it to "
                                       "finish", path, holder)
                        waited = True
                    fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    os.close(fd)
                    raise
                logger.warning("fp8plug: %s: the file system does not lock files (%s); two runs saving into it at "
                               "once would not be kept apart", path, exc)
            # the holder we waited for removed the file: lock the one now at the path instead
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.file))
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
                self.fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.remove(self.file)  # while still held: a waiter then finds it gone and locks a new one
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None


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
    """`recover` every `checkpoint_<n>` in `folder` whose save a kill interrupted."""
    for path in checkpoints_in(folder):
        recover(path)


def latest_complete(folder: str) -> str:
    """The highest-numbered complete `checkpoint_<n>` in `folder` (accelerate's automatic naming);
    incomplete ones after it are skipped with a warning (empty ones, left by a killed save, silently)."""
    skipped: List[str] = []
    for path in checkpoints_in(folder)[::-1]:
        if not taken(path):
            continue
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
