"""Writing an exported checkpoint into a directory as one change: all of it, or none of it.

A server reads `config.json`, the safetensors index and the shards it names together, so an
export that replaced them one by one could be read (or left by a kill) half old, half new: FP8
weights beside a plain config, or an old index naming old bf16 shards. So an export is written
whole into a sibling, `<dir>.fp8plug-partial`, and swapped in by renaming directories (`_commit`;
`recover`, at the next export, finishes or undoes a swap a kill interrupted).

The target may hold files that are not the model's (a tokenizer, a README, training logs). Those
are carried into the new directory as hard links (copies where the filesystem has none) before
the swap, so they survive. The files of a previous model checkpoint are not carried: they would
be stale beside the new weights. They are the names `save_pretrained` and the FP8 exporters write
(`PREVIOUS_CHECKPOINT`): config.json, generation_config.json, model.safetensors and
pytorch_model.bin with their shards (`-00001-of-00004`) and `.index.json`, and
hf_quant_config.json (ModelOpt's, which vLLM reads before config.json).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from typing import Iterator

from fp8plug.checkpoints import directory as checkpoint_dir

PREVIOUS_CHECKPOINT = re.compile(
    r"^(?:config\.json|generation_config\.json|hf_quant_config\.json"
    r"|(?:model|pytorch_model)(?:-\d{5}-of-\d{5})?\.(?:safetensors|bin)"
    r"|(?:model\.safetensors|pytorch_model\.bin)\.index\.json)$"
)


@contextlib.contextmanager
def replacing(directory: str) -> Iterator[str]:
    """Yield an empty directory to write the export into; on leaving the block without an error,
    it replaces `directory` (created if missing) in one rename, with the files of `directory` that
    are not a previous checkpoint's carried over. On an error `directory` is left as it was."""
    target = os.path.realpath(os.fspath(directory))
    if os.path.exists(target) and not os.path.isdir(target):
        raise NotADirectoryError(f"cannot export into {directory}: it is a file; give a directory path.")
    work = _start(target)  # an interrupted earlier swap put right, a stale partial removed
    try:
        yield work
        if os.path.isdir(target):
            shutil.copystat(target, work)
            _carry_over(target, work)
        checkpoint_dir.write_manifest(work)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    _commit(target)
    with contextlib.suppress(FileNotFoundError):  # only the swap needed it; the export holds no fp8plug file
        os.remove(os.path.join(target, checkpoint_dir.MANIFEST_NAME))


def _carry_over(source: str, work: str) -> None:
    """Link (or copy) every entry of `source` that is not a previous checkpoint's into `work`."""
    for name in os.listdir(source):
        if PREVIOUS_CHECKPOINT.match(name) or name == checkpoint_dir.MANIFEST_NAME:
            continue
        src, dst = os.path.join(source, name), os.path.join(work, name)
        if os.path.exists(dst):  # the export wrote it (a file of its own name): the new one wins
            continue
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst)


# the swap -------------------------------------------------------------------------------------------
PARTIAL_SUFFIX = ".fp8plug-partial"
PREVIOUS_SUFFIX = ".fp8plug-previous"


def _start(target: str) -> str:
    """An empty sibling of `target` to write into, after putting right a swap a kill interrupted."""
    recover(target)
    work = target + PARTIAL_SUFFIX
    if os.path.isdir(work):
        shutil.rmtree(work)
    os.makedirs(work)
    return work


def _commit(target: str) -> None:
    """Rename the complete sibling in as `target`; the old `target` goes once the new one is there."""
    work, previous = target + PARTIAL_SUFFIX, target + PREVIOUS_SUFFIX
    if os.path.exists(target):
        if os.path.exists(previous):
            shutil.rmtree(previous)
        os.rename(target, previous)
    os.rename(work, target)
    if os.path.exists(previous):
        shutil.rmtree(previous)


def recover(target: str) -> None:
    """Finish a swap a kill stopped between its two renames (forward when the new export's manifest
    is there, else back to the old directory); leftovers beside a whole `target` are removed."""
    work, previous = target + PARTIAL_SUFFIX, target + PREVIOUS_SUFFIX
    if not os.path.exists(target):
        if os.path.isfile(os.path.join(work, checkpoint_dir.MANIFEST_NAME)):
            os.rename(work, target)
        elif os.path.isdir(previous):
            os.rename(previous, target)
    if os.path.exists(target) and os.path.isdir(previous):
        shutil.rmtree(previous)
