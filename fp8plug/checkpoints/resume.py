"""`save_state` and `load_state` for fp8plug.Accelerator: whole checkpoints, checked before loading.

accelerate writes a checkpoint file by file into the directory it is given, and loads it file by
file into the live objects. Either can stop half way: a save killed between two files leaves a
directory that resumes as half the old state and half the new one, and a load refused at its last
step (the FP8 state) has already replaced the weights and the optimizer. Here:

- a save goes through fp8plug.checkpoints.directory: accelerate writes into a partial directory inside
  the output directory, fp8plug adds the FP8 state (`fp8_state.pt`, with the recipe it belongs
  to) and the manifest, and the files are moved into place, manifest last, under a lock. With
  automatic checkpoint naming the oldest checkpoints are removed (`total_limit`) only once the
  new one is in place.
- a load first finds a complete checkpoint (the latest complete one, with automatic naming),
  reads the FP8 state without pickle, and checks everything it can before accelerate touches
  anything: the manifest, the FP8 state against this run (engine, models, recipe, converted
  layers and shapes), the weight files' names and shapes, the optimizers' parameter groups, the
  number of registered objects. A refusal leaves every model, optimizer and scheduler as it was.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import torch
from accelerate.utils import DistributedType

from fp8plug._upstream import prepared_models, prepared_optimizers, registered_objects
from fp8plug.checkpoints import directory as checkpoint_dir
from fp8plug.checkpoints.directory import FP8_STATE_NAME, read_fp8_state
from fp8plug.coverage import logger

FP8_STATE_CHOICES = ("saved", "fresh")
_SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def save_state(accelerator, accelerate_save, output_dir, safe_serialization: bool, **kwargs):
    """accelerate's save_state (`accelerate_save`), written whole or not at all (module doc)."""
    config = accelerator.project_configuration
    automatic = config.automatic_checkpoint_naming
    folder = None
    if automatic:
        folder = os.path.join(accelerator.project_dir, "checkpoints")
        final = os.path.join(folder, f"checkpoint_{accelerator.save_iteration}")
        if checkpoint_dir.taken(final):
            raise ValueError(
                f"save_state: checkpoint directory {final} already exists; set "
                "accelerator.project_configuration.iteration to the next free number."
            )
    elif output_dir is None:
        raise ValueError(
            "save_state: pass output_dir, or build the Accelerator with "
            "ProjectConfiguration(automatic_checkpoint_naming=True)."
        )
    else:
        final = os.path.expanduser(os.fspath(output_dir))
    checkpoint_dir.check_output(final)  # on every rank, before anything is written
    writer = _writes(accelerator)
    save = checkpoint_dir.start(final) if writer else None  # holds final's lock until closed
    try:
        accelerator.wait_for_everyone()
        work = checkpoint_dir.partial_dir(final)
        config.automatic_checkpoint_naming = False  # accelerate writes where it is told: the partial directory
        try:
            accelerate_save(work, safe_serialization=safe_serialization, **kwargs)
        finally:
            config.automatic_checkpoint_naming = automatic
        state = accelerator.fp8_checkpoint_state
        if state is not None:
            fp8_state = state.state_dict()  # on every rank, as accelerate does for its registered objects
            if writer:
                torch.save(fp8_state, os.path.join(work, FP8_STATE_NAME))
        accelerator.wait_for_everyone()  # every rank's files are written
        if writer:
            save.commit()
    finally:
        if save is not None:
            save.close()
    if writer and automatic and config.total_limit is not None:
        _remove_old_checkpoints(folder, final, config.total_limit)
    accelerator.wait_for_everyone()
    logger.info("fp8plug: checkpoint %s is complete", final)
    return Path(final)


def _remove_old_checkpoints(folder: str, final: str, total_limit: int) -> None:
    """Keep the newest `total_limit` checkpoints, the one just written always among them (as
    accelerate does, for 0 too); removed only now that the new one is complete."""
    others = [path for path in checkpoint_dir.checkpoints_in(folder) if path != final]
    keep = max(total_limit, 1) - 1
    for old in others[: len(others) - keep]:
        logger.info("fp8plug: removing %s (total_limit=%d)", old, total_limit)
        checkpoint_dir.remove(old)


def load_state(accelerator, accelerate_load, input_dir, load_kwargs, fp8_state: str, **kwargs):
    """accelerate's load_state (`accelerate_load`), after every check that can be made first (module doc).

    `fp8_state="fresh"` loads everything but the FP8 scaling state, which stays as this run's
    (a fresh run's, right after prepare): the way to resume under a deliberately changed recipe."""
    if fp8_state not in FP8_STATE_CHOICES:
        raise ValueError(f"load_state(fp8_state={fp8_state!r}): use one of {', '.join(FP8_STATE_CHOICES)}.")
    path = _find(accelerator, input_dir)
    checkpoint_dir.verify(path)
    state = accelerator.fp8_checkpoint_state
    saved = None
    if state is not None and fp8_state == "saved":
        file = os.path.join(path, FP8_STATE_NAME)
        if os.path.isfile(file):
            saved = read_fp8_state(file)
            state.check(saved, where=f"the FP8 state in {path}")
        else:
            logger.warning("fp8plug: %s has no %s (saved without FP8): the FP8 scaling state starts afresh",
                           path, FP8_STATE_NAME)
    _check_registered_objects(accelerator, path)
    if accelerator.distributed_type not in _SHARDED:
        _check_weight_files(accelerator, path, strict=kwargs.get("strict", True))
        _check_optimizer_files(accelerator, path)
    before = None
    if saved is not None:
        before = state.snapshot()
        state.load_state_dict(saved, warn=False)  # the engine checks converted layers and shapes; all or nothing
    try:
        result = accelerate_load(path, load_kwargs, **kwargs)
    except BaseException:
        if before is not None:
            state.restore(before)
        raise
    if saved is not None:
        state.load_state_dict(saved, warn=False)  # again: nothing accelerate loaded may have touched it
    return result


def _writes(accelerator) -> bool:
    """Whether this process writes the checkpoint's shared files (and renames the directory)."""
    if accelerator.project_configuration.save_on_each_node:
        return accelerator.is_local_main_process
    return accelerator.is_main_process


def _find(accelerator, input_dir) -> str:
    """The directory to load: `input_dir`, or the latest complete automatically named checkpoint;
    a swap that a kill interrupted is put right first."""
    config = accelerator.project_configuration
    if input_dir is None and not config.automatic_checkpoint_naming:
        raise ValueError("load_state: no input_dir given and automatic checkpoint naming is off; pass the directory.")
    writer = _writes(accelerator)
    if input_dir is None:
        folder = os.path.join(accelerator.project_dir, "checkpoints")
        if writer:
            checkpoint_dir.recover_all(folder)
        accelerator.wait_for_everyone()
        return checkpoint_dir.latest_complete(folder)
    path = os.path.expanduser(os.fspath(input_dir))
    if writer:
        checkpoint_dir.recover(path)
    accelerator.wait_for_everyone()
    if not os.path.isdir(path):
        raise ValueError(f"load_state: checkpoint directory {path} does not exist.")
    return path


def _check_registered_objects(accelerator, path: str) -> None:
    found = [f for f in os.listdir(path) if re.search(r"^custom_checkpoint_\d+\.pkl$", f)]
    if len(found) != len(registered_objects(accelerator)):
        raise ValueError(
            f"load_state: {path} holds {len(found)} registered object(s) (custom_checkpoint_*.pkl) but "
            f"{len(registered_objects(accelerator))} are registered here; register the same objects, in the same "
            "order, as when it was saved."
        )


def _check_weight_files(accelerator, path: str, strict: bool) -> None:
    """Refuse weight files whose names or shapes do not fit the prepared models, before any is loaded
    (torch copies the tensors that fit and raises only at the end)."""
    for i, model in enumerate(prepared_models(accelerator)):
        shapes = _saved_shapes(path, i)
        if shapes is None:
            continue
        ours = model.state_dict()
        wrong = [f"{key} {tuple(shapes[key])} (here {tuple(ours[key].shape)})"
                 for key in shapes if key in ours and tuple(shapes[key]) != tuple(ours[key].shape)]
        if wrong:
            raise ValueError(
                f"load_state: the weights in {path} do not fit model {i}: {', '.join(wrong[:5])}; "
                "prepare the model the checkpoint was saved from."
            )
        if not strict:
            continue
        saved_storages = {_storage(ours[key]) for key in shapes if key in ours}
        missing = [key for key in ours if key not in shapes and _storage(ours[key]) not in saved_storages]
        unexpected = [key for key in shapes if key not in ours]
        if missing or unexpected:
            raise ValueError(
                f"load_state: the weights in {path} do not fit model {i}: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}; prepare the model the checkpoint was saved from."
            )


def _saved_shapes(path: str, index: int) -> Optional[dict]:
    """{name: shape} of model `index`'s weight file, read without loading the tensors."""
    ending = f"_{index}" if index > 0 else ""
    safetensors_file = os.path.join(path, f"model{ending}.safetensors")
    if os.path.isfile(safetensors_file):
        from safetensors import safe_open

        with safe_open(safetensors_file, framework="pt") as handle:
            return {key: handle.get_slice(key).get_shape() for key in handle.keys()}
    torch_file = os.path.join(path, f"pytorch_model{ending}.bin")
    if os.path.isfile(torch_file):
        state = torch.load(torch_file, map_location="cpu", mmap=True, weights_only=True)
        return {key: value.shape for key, value in state.items() if isinstance(value, torch.Tensor)}
    return None


def _check_optimizer_files(accelerator, path: str) -> None:
    """Refuse optimizer files whose parameter groups differ from the prepared optimizers' (torch
    would refuse them too, but only after the weights were loaded)."""
    for i, optimizer in enumerate(prepared_optimizers(accelerator)):
        file = os.path.join(path, "optimizer.bin" if i == 0 else f"optimizer_{i}.bin")
        if not os.path.isfile(file):
            continue
        saved = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        sizes = [len(group["params"]) for group in saved.get("param_groups", [])]
        ours = [len(group["params"]) for group in optimizer.param_groups]
        if sizes != ours:
            raise ValueError(
                f"load_state: optimizer {i} in {path} has parameter groups of sizes {sizes} but this one "
                f"has {ours}; build the optimizer over the same parameters as when it was saved."
            )


def _storage(tensor: torch.Tensor):
    try:
        return tensor.untyped_storage().data_ptr(), tensor.device
    except RuntimeError:  # a tensor without storage (a wrapper subclass): only its own name counts
        return id(tensor)
