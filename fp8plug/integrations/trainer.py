"""Hugging Face `transformers.Trainer` training in FP8 with any fp8plug engine.

Trainer builds its own `accelerate.Accelerator` from `TrainingArguments`, which cannot carry a
kwargs handler. `FP8TrainerMixin` has it build `fp8plug.Accelerator` instead, with the recipe given
as `fp8_recipe=` (or read from `accelerate launch`'s environment), and leaves the rest to the
Trainer class it is mixed into. Each checkpoint folder also holds `fp8_state.pt`, the FP8 scaling
state, put back on `resume_from_checkpoint`; the model files stay the plain architecture's.
transformers is imported only when this module is, never by `import fp8plug`. See docs/trainer.md.
"""

from __future__ import annotations

import logging
import numbers
import os
from typing import Any, Dict, Mapping, Optional

import torch
import transformers

from fp8plug._upstream import TrainerInternals, forget_prepared, is_prepared, trainer_builds_accelerator_with
from fp8plug.checkpoints.directory import FP8_STATE_NAME, read_fp8_state
from fp8plug.integrations.accelerator import Accelerator
from fp8plug.recipe.kwargs import FP8RecipeKwargs

logger = logging.getLogger("fp8plug")


class FP8TrainerMixin(TrainerInternals):
    """Put in front of any `transformers.Trainer` subclass to train it in FP8:
    `class MySFT(FP8TrainerMixin, SFTTrainer)`; `FP8Trainer` is the mixin on Trainer itself.

    Takes one keyword more than the Trainer it is mixed into: `fp8_recipe`, an
    `fp8plug.FP8RecipeKwargs` (default: one read from the `ACCELERATE_FP8_*` environment that
    `accelerate launch` exports, else fp8plug's defaults: the automatic engine choice).

    `bf16=True` in TrainingArguments is welcome (fp8plug runs bf16 outside the FP8 layers anyway);
    `fp16=True` is refused. `self.accelerator` is an `fp8plug.Accelerator`: its `fp8_engine`,
    `fp8_reports` (filled when training starts) and `fp8_recipe` say what runs in FP8.
    """

    def __init__(self, *args, fp8_recipe: Optional[FP8RecipeKwargs] = None, **kwargs):
        if fp8_recipe is not None and not isinstance(fp8_recipe, FP8RecipeKwargs):
            raise TypeError(
                f"{type(self).__name__}(fp8_recipe=...): expected an fp8plug.FP8RecipeKwargs, got "
                f"{type(fp8_recipe).__name__}; build one with fp8plug.FP8RecipeKwargs(backend=..., ...)."
            )
        self.fp8_recipe = fp8_recipe  # read by create_accelerator_and_postprocess, during __init__
        super().__init__(*args, **kwargs)

    # the Accelerator ---------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's own setup, with `fp8plug.Accelerator` built where it builds accelerate's."""
        with trainer_builds_accelerator_with(self.fp8_build_accelerator):
            super().create_accelerator_and_postprocess()
        if not isinstance(self.accelerator, Accelerator):
            raise TypeError(
                f"{type(self).__name__}: the Trainer class built its accelerator ({type(self.accelerator).__name__}) "
                "itself instead of through transformers.Trainer.create_accelerator_and_postprocess; put "
                "FP8TrainerMixin first among the base classes, or build fp8plug.Accelerator there yourself."
            )
        self.fp8_recipe = self.accelerator.fp8_recipe

    def fp8_build_accelerator(self, *args, **kwargs) -> Accelerator:
        """What Trainer's `Accelerator(**kwargs)` call makes instead: fp8plug's, in FP8."""
        precision = str(getattr(kwargs.get("mixed_precision"), "value", kwargs.get("mixed_precision"))).lower()
        if precision == "fp16":
            raise ValueError(
                f"{type(self).__name__}: TrainingArguments(fp16=True) (or mixed precision fp16 from "
                "`accelerate launch`) cannot combine with FP8 training, which runs bf16 outside the FP8 "
                "layers; drop fp16=True (bf16=True is fine)."
            )
        if kwargs.get("deepspeed_plugin") is not None and not self.args.bf16:
            # DeepSpeed gets bf16 enabled (what runs outside the FP8 layers), and transformers
            # refuses a DeepSpeed config whose bf16 disagrees with TrainingArguments.bf16
            self.args.bf16 = True
        kwargs["mixed_precision"] = "fp8"
        handlers = list(kwargs.get("kwargs_handlers") or [])
        if self.fp8_recipe is not None:
            handlers.append(self.fp8_recipe)
        kwargs["kwargs_handlers"] = handlers
        return Accelerator(*args, **kwargs)

    # training (Trainer's private hooks that call these: fp8plug._upstream.TrainerInternals) ----
    def fp8_before_training_wrap(self) -> None:
        """Before Trainer wraps the model for training: a model that `evaluate()` prepared for
        evaluation only (accelerate then marks it prepared, so `prepare` would skip its FP8
        conversion) gets that evaluation-only preparation undone first.

        One process that sees several GPUs is refused here. Trainer would wrap the model in
        `nn.DataParallel` and, because the model is then wrapped, never hand it to the
        Accelerator's `prepare`: no layer would be converted and the run would train in bf16
        (every step's coverage at 0 FP8 GEMMs; found on two H200s)."""
        gpus = getattr(self.args, "n_gpu", 1)
        if gpus > 1:
            raise ValueError(
                f"{type(self).__name__}: this one process sees {gpus} GPUs (TrainingArguments.n_gpu), so "
                "Trainer would train under nn.DataParallel, which never passes the model to the Accelerator: "
                "it would not be converted and would train in bf16. Start one process per GPU "
                f"(`accelerate launch --num_processes {gpus} train.py` or `torchrun --nproc_per_node {gpus} "
                "train.py`: DistributedDataParallel, which FP8 supports), or make one GPU visible "
                "(CUDA_VISIBLE_DEVICES=0)."
            )
        _undo_evaluation_prepare(self.accelerator, self.model)

    # checkpoints -------------------------------------------------------------------------------
    def fp8_save_checkpoint(self, output_dir: str) -> None:
        """After Trainer wrote a checkpoint's optimizer and scheduler files: the FP8 scaling state
        beside them."""
        state = self.accelerator.fp8_checkpoint_state
        if state is None or not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        torch.save(state.state_dict(), os.path.join(output_dir, FP8_STATE_NAME))

    def fp8_load_checkpoint(self, checkpoint: Optional[str], load_rest) -> None:
        """Trainer's optimizer and scheduler (`load_rest()`), plus the FP8 scaling state (the
        model is converted by now: Trainer loads these after `prepare`). The FP8 state is read
        (without pickle) and checked against this run's recipe before the optimizer is touched,
        so a refusal leaves the optimizer and scheduler as they were."""
        state = self.accelerator.fp8_checkpoint_state
        saved = None
        if checkpoint is not None and state is not None:
            path = os.path.join(checkpoint, FP8_STATE_NAME)
            if os.path.isfile(path):
                saved = read_fp8_state(path)
                state.check(saved, where=f"the FP8 state in {checkpoint}")
            else:
                logger.warning(
                    "%s has no %s (a checkpoint written without FP8, or by another trainer): the FP8 scaling "
                    "state starts afresh, so the resumed run will not match one that never stopped.",
                    checkpoint, FP8_STATE_NAME,
                )
        before = state.snapshot() if saved is not None else None
        if saved is not None:
            state.load_state_dict(saved, warn=False)  # the engine checks converted layers and shapes; all or nothing
        try:
            load_rest()
        except BaseException:
            if before is not None:
                state.restore(before)
            raise

    # logging -----------------------------------------------------------------------------------
    def log(self, logs: Dict[str, float], *args, **kwargs) -> None:
        """Trainer's log, with the FP8 coverage the Accelerator reports (if it offers
        `fp8_coverage()`) added as `fp8/<name>` entries."""
        coverage = getattr(self.accelerator, "fp8_coverage", None)
        if callable(coverage):
            for key, value in _flatten(coverage() or {}, "fp8").items():
                logs.setdefault(key, value)
        super().log(logs, *args, **kwargs)


class FP8Trainer(FP8TrainerMixin, transformers.Trainer):
    """`transformers.Trainer` training in FP8 through fp8plug: the same arguments, plus
    `fp8_recipe=fp8plug.FP8RecipeKwargs(...)` (see FP8TrainerMixin)."""


def _undo_evaluation_prepare(accelerator: Accelerator, model) -> None:
    """If `model` was prepared with `prepare_model(model, evaluation_mode=True)` but not converted,
    take it back to unprepared: the bf16 autocast wrapper off its forward, the prepared mark off,
    out of the accelerator's model list. Trainer's evaluation loop does that preparation when it
    runs before any training; without this, training would then run the model in bf16."""
    if model is None or not is_prepared(model):
        return
    if accelerator.fp8_engine is None or any(model is m for m in accelerator.fp8_models):
        return
    forget_prepared(accelerator, model)


def _flatten(values: Mapping[str, Any], prefix: str) -> Dict[str, float]:
    """{"a": 1, "b": {"c": 2}} -> {"prefix/a": 1, "prefix/b/c": 2}; numbers only (what loggers take)."""
    out: Dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name))
        elif isinstance(value, numbers.Number):
            out[name] = value
    return out


__all__ = ["FP8_STATE_NAME", "FP8Trainer", "FP8TrainerMixin"]
