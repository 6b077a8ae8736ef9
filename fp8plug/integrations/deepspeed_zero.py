"""DeepSpeed ZeRO (stages 1, 2 and 3) under fp8plug.Accelerator.

`prepare()` converts the model before `deepspeed.initialize`, as for DDP and FSDP2, so DeepSpeed
casts and partitions the FP8 modules' own parameters. What differs from DDP is handled here: the
step's end is hooked on the DeepSpeed engine's `step()` (ZeRO steps the torch optimizer once per
flat partition, never with the model's parameters), and what cannot work (an engine's
`deepspeed_problem`, an fp16 config, a launch whose ranks do not count one another) is refused
before anything is built. Checkpoints need nothing extra. See docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Iterable, List

from torch import nn

from fp8plug.backends.base import offers
from fp8plug.backends.steps import end_step

logger = logging.getLogger("fp8plug")
_STEP_HOOKED = "_fp8plug_step_hooked"


def is_deepspeed(accelerator) -> bool:
    """Whether `accelerator` runs under DeepSpeed."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def zero_stage(accelerator) -> int:
    """The ZeRO stage of the active DeepSpeed plugin (0 when its config says none)."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    return int(config.get("zero_optimization", {}).get("stage", 0) or 0)


def check_processes(accelerator) -> None:
    """After accelerate.Accelerator.__init__ under DeepSpeed: every launched process must count
    the others. Where accelerate's process state was set up earlier without a backend (by
    transformers.TrainingArguments on a CPU, say), it counts one, and DeepSpeed would fail later
    with a bare assertion."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and accelerator.num_processes != world:
        raise ValueError(
            f"fp8plug.Accelerator: DeepSpeed was launched on {world} processes but accelerate's process state "
            f"counts {accelerator.num_processes} (it was set up before this Accelerator without a process-group "
            "backend); build fp8plug.Accelerator before anything else sets that state up, or set it up over gloo "
            "(PartialState(backend='gloo'); with transformers, TrainingArguments(ddp_backend='gloo'))."
        )


def is_partitioned(model: nn.Module) -> bool:
    """Whether `model`'s parameters were partitioned when it was built, under
    `deepspeed.zero.Init` (accelerate's `zero3_init_flag`): each rank holds only its shard."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


@contextlib.contextmanager
def clearer_init_errors(fp8_on: bool):
    """Around accelerate.Accelerator.__init__: where a DeepSpeed config enables fp16, accelerate
    refuses the bf16 fp8plug asks for and names bf16; say instead what the user asked and why."""
    try:
        yield
    except ValueError as exc:
        if fp8_on and "when `fp16` is set in the DeepSpeed config" in str(exc):
            raise ValueError(
                "mixed_precision 'fp8' under DeepSpeed: the DeepSpeed config enables fp16, but fp8plug "
                "runs everything outside the FP8 GEMMs in bf16 (fp16 would need loss scaling around "
                "the FP8 scales); set \"fp16\": {\"enabled\": false} (or remove the fp16 section) "
                "in the DeepSpeed config."
            ) from exc
        raise


def check_models(accelerator, models: Iterable[nn.Module]) -> None:
    """Refuse, before conversion, what the FP8 engine cannot do under this DeepSpeed setup."""
    stage = zero_stage(accelerator)
    engine = accelerator.fp8_engine
    for model in models:
        problem = _problem(engine, stage, partitioned=is_partitioned(model))
        if problem:
            raise ValueError(
                f"fp8plug.Accelerator: the {engine.title} engine cannot train {type(model).__name__} under "
                f"DeepSpeed ZeRO stage {stage}: {problem}"
            )


def check_engine(accelerator) -> None:
    """Refuse, when the Accelerator is built, an engine that cannot run under this ZeRO stage at all."""
    stage = zero_stage(accelerator)
    engine = accelerator.fp8_engine
    problem = _problem(engine, stage, partitioned=False)
    if problem:
        raise ValueError(
            f"fp8plug.Accelerator: the {engine.title} engine cannot run under DeepSpeed ZeRO stage {stage}: "
            f"{problem}"
        )
    logger.info("fp8plug: FP8 with the %s engine under DeepSpeed ZeRO stage %d", engine.name, stage)


def _problem(engine, stage: int, partitioned: bool):
    """Why `engine` cannot train under ZeRO `stage`, where it says (its `deepspeed_problem`), else None."""
    return engine.deepspeed_problem(stage, partitioned) if offers(engine, "deepspeed_problem") else None


def hook_engine_steps(accelerator, prepared: Iterable[object]) -> None:
    """Run the FP8 engine's end-of-step work once per applied DeepSpeed optimizer step, for every
    DeepSpeed engine in `prepared` whose module fp8plug converted."""
    for obj in prepared:
        module = getattr(obj, "module", None)
        if not _is_deepspeed_engine(obj) or not any(module is m for m in accelerator.fp8_models):
            continue
        if getattr(obj, _STEP_HOOKED, False):
            continue
        _wrap_step(obj, accelerator.fp8_engine, module)


def _wrap_step(ds_engine, fp8_engine, model: nn.Module) -> None:
    original = ds_engine.step

    @functools.wraps(original)
    def step(*args, **kwargs):
        before = ds_engine.global_steps
        result = original(*args, **kwargs)
        if ds_engine.global_steps != before:  # an optimizer step ran (not a mid-accumulation call)
            end_step([model], [fp8_engine])
        return result

    ds_engine.step = step
    setattr(ds_engine, _STEP_HOOKED, True)


def _is_deepspeed_engine(obj) -> bool:
    try:
        from deepspeed import DeepSpeedEngine
    except ImportError:  # pragma: no cover - DeepSpeed runs, so it imports
        return False
    return isinstance(obj, DeepSpeedEngine)


__all__: List[str] = [
    "check_engine", "check_models", "check_processes", "clearer_init_errors", "hook_engine_steps",
    "is_deepspeed", "is_partitioned", "zero_stage",
]
