"""benchmarks/training/hf_llama.py's `trainer` rows: the model trained by Hugging Face `transformers.Trainer`
with `TrainingArguments(torch_compile=True)`, as a Trainer user turns compilation on.

A module of its own because the row does not run hf_llama.py's training loop: Trainer runs its
own (data loader, loss scaling, gradient norm, callbacks), so the steps are marked from a
TrainerCallback instead. What every row shares comes from hf_llama_task.py (data, initial weights,
learning-rate schedule) and hf_llama_measure.py (how each reported number is computed).

Per row base (hf_llama.BASES):
  bf16, bf16-skipmask   transformers.Trainer, TrainingArguments(bf16=True) (skipmask: fp8plug's
                        attention change applied to the model first)
  fp8plug[-engine...]   the same Trainer class with fp8plug.integrations.trainer.FP8TrainerMixin in front,
                        fp8_recipe=FP8RecipeKwargs(backend=...) where the row names an engine or
                        an option; `fp8plug` passes no recipe: fp8plug's own engine choice, which
                        sees Trainer's dynamo plugin and so chooses for a compiled model
  accelerate-*          Accelerate's own FP8: TrainingArguments has no place for a recipe handler,
                        so while the row trains, the environment holds what `accelerate launch
                        --mixed_precision fp8 --fp8_backend ...` exports (ACCELERATE_MIXED_PRECISION
                        =fp8, ACCELERATE_FP8_BACKEND, ACCELERATE_FP8_<option>), which Trainer's
                        arguments and Accelerate's recipe read; bf16=False (bf16=True would override
                        that mixed precision). The same recipes as the other modes' accelerate rows'
                        handlers (accelerate-ao's FSDP float8 all-gather default included)

The same work as hf_llama.py's rows, as far as Trainer allows: the same batches in the same order
(train_sampling_strategy="sequential", no workers), the same initial weights, AdamW with torch's
defaults (fused on a GPU; weight decay 0.01, from which Trainer exempts the norm weights), the
same warm-up schedule (create_scheduler overridden: Trainer's "linear" would decay to zero), no
gradient clipping (max_grad_norm=0; Trainer still computes the norm every step), no logging,
evaluation or checkpoints. Trainer's defaults otherwise stay, its NaN check of each step's loss
(logging_nan_inf_filter, one device synchronisation a step) included: that is what a user runs.

Measured: a step from the end of the previous one (the first from its own start) to its end,
so the time between steps (the next batch, Trainer's bookkeeping) counts, as a user pays it; that
share alone is `between_steps_ms`. The loss is each step's compute_loss value (recorded without
a synchronisation). --profile does not apply here: Trainer owns the loop.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from unittest import mock

import torch
import transformers
from hf_llama_measure import StepClock, dynamo_graphs, gpu_memory, model_facts, note_early_step, step_numbers
from hf_llama_task import build_model, make_batches, warmup_schedule


class Batches(torch.utils.data.Dataset):
    """make_batches' tokens as Trainer takes them: one {input_ids, labels} dict per sequence, in
    order, so that a sequential sampler with the preset's batch size gives back batch i at step i."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens.reshape(-1, tokens.shape[-1])

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class BenchTrainer(transformers.Trainer):
    """Trainer with the bench's learning-rate schedule, recording each training step's loss."""

    def __init__(self, *args, **kwargs):
        self.bench_losses = []
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if model.training:
            self.bench_losses.append((result[0] if return_outputs else result).detach())
        return result

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = warmup_schedule(self.optimizer if optimizer is None else optimizer, num_training_steps)
            self._created_lr_scheduler = True
        return self.lr_scheduler


class StepMarks(transformers.TrainerCallback):
    """Each step's start and end on StepClock, the first step's and the warm-up's end from process
    start, and the allocation once Trainer prepared the model and optimizer."""

    def __init__(self, clock: StepClock, warmup: int, t0: float, device):
        self.clock, self.warmup, self.t0, self.device = clock, warmup, t0, device
        self.begins, self.ends, self.early, self.prepared_gb = [], [], {}, None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.clock.cuda:
            self.prepared_gb = torch.cuda.memory_allocated(self.device) / 1e9

    def on_step_begin(self, args, state, control, **kwargs):
        self.begins.append(self.clock.mark())

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(self.clock.mark())
        note_early_step(self.early, len(self.ends) - 1, self.warmup, self.t0, self.clock.cuda)

    def step_ms(self) -> list:
        marks = [self.begins[0], *self.ends]
        return [self.clock.ms(a, b) for a, b in zip(marks, marks[1:])]

    def between_steps_ms(self) -> list:
        return [self.clock.ms(end, begin) for end, begin in zip(self.ends, self.begins[1:])]


def trainer_class(kind: str):
    """BenchTrainer, with FP8TrainerMixin in front for fp8plug rows (fp8plug's documented way)."""
    if kind != "fp8plug":
        return BenchTrainer
    from fp8plug.integrations.trainer import FP8TrainerMixin

    class FP8BenchTrainer(FP8TrainerMixin, BenchTrainer):
        pass

    return FP8BenchTrainer


def accelerate_fp8_environment(engine: str, options: dict) -> dict:
    """What `accelerate launch --mixed_precision fp8 --fp8_backend ENGINE` exports for Accelerate's
    own FP8 (the only way to reach it through Trainer), the recipe options as ACCELERATE_FP8_*."""
    env = dict(ACCELERATE_MIXED_PRECISION="fp8", ACCELERATE_FP8_BACKEND=engine.upper())
    env.update({f"ACCELERATE_FP8_{key.upper()}": str(value).lower() for key, value in options.items()})
    return env


def train_with_trainer(base: tuple, spec: dict, steps: int, warmup: int, lr: float, device, t0: float) -> dict:
    """Train one `trainer` row (`base`: its hf_llama.BASES entry) for `steps` steps; its numbers."""
    kind, precision, engine, options = base
    cuda = device.type == "cuda"
    model = build_model(spec, device)
    extra, environment = {}, {}
    if kind == "accelerate" and options.get("skip_causal_mask"):
        from fp8plug.hf.attention import skip_causal_mask

        skip_causal_mask(model)
    elif kind == "accelerate" and precision == "fp8":
        environment = accelerate_fp8_environment(engine, options)
    elif kind == "fp8plug" and (engine is not None or options):
        from fp8plug import FP8RecipeKwargs

        extra["fp8_recipe"] = FP8RecipeKwargs(backend=engine, **options)
    marks = StepMarks(StepClock(cuda), warmup, t0, device)
    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ, environment):
        args = transformers.TrainingArguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=spec["batch"], learning_rate=lr,
            optim="adamw_torch_fused" if cuda else "adamw_torch", weight_decay=0.01, max_grad_norm=0.0,
            bf16=precision == "bf16" or kind == "fp8plug", use_cpu=not cuda,
            torch_compile=True, torch_compile_backend=spec.get("compile_backend", "inductor"),
            train_sampling_strategy="sequential", dataloader_num_workers=0, logging_strategy="no",
            save_strategy="no", report_to="none", disable_tqdm=True)
        trainer = trainer_class(kind)(model=model, args=args, train_dataset=Batches(make_batches(spec, steps)),
                                      callbacks=[marks], **extra)
        trainer.train()
    if len(marks.ends) != steps or len(trainer.bench_losses) != steps:
        raise RuntimeError(f"Trainer ran {len(marks.ends)} steps and {len(trainer.bench_losses)} losses, not {steps}")
    out = model_facts(trainer.model, trainer.optimizer, trainer.accelerator, engine)
    out.update(marks.early)
    if cuda:
        torch.cuda.synchronize()
        out.update(gpu_memory(device, marks.prepared_gb))
    out.update(step_numbers(spec, steps, warmup, marks.step_ms(), trainer.bench_losses))
    out["between_steps_ms"] = statistics.median(marks.between_steps_ms()[warmup - 1:])
    out["dynamo_graphs"] = dynamo_graphs()
    return out
