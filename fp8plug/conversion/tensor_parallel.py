"""Tensor parallelism (Accelerate's `ParallelismConfig(tp_size=N)`, a transformers model loaded with
`tp_plan="auto"`, torch's `parallelize_module`) and fp8plug: which engine may convert such a model.

Under tensor parallelism every Linear's weight is a DTensor shard and the sharding plan's hooks
(or transformers' replaced `forward`) sit on the Linear module itself. Conversion carries those
over to the FP8 module (fp8plug.layers.carry_over); whether the FP8 module then runs on DTensor
shards is the engine's to say (`Engine.tensor_parallel_problem`: the native engine's does,
backends/native/tensor_parallel.py). Every conversion plan asks (fp8plug.conversion.plan), and
fp8plug.Accelerator.prepare() asks again before converting anything, with its ParallelismConfig;
where the engine cannot, they refuse, naming the engine and the fix.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from fp8plug.layers.rules import ConversionError


def tensor_parallel_size(accelerator, model: nn.Module) -> Optional[int]:
    """The tensor-parallel degree `model` trains with: the Accelerator's ParallelismConfig tp_size
    where above 1 (`accelerator` None: none), else what transformers recorded when it sharded the model, else 2 or more
    where a Linear's weight is a DTensor before any FSDP sharding (a user's parallelize_module);
    None without tensor parallelism."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and getattr(config, "tp_enabled", False):
        return int(config.tp_size)
    size = _transformers_tp_size(model)
    if size and size > 1:
        return size
    from torch.distributed.tensor import DTensor

    # FSDP2's shards are DTensors too; fully_shard gives a module a class of its own ("FSDP...")
    def fsdp(m: nn.Module) -> bool:
        return type(m).__name__.startswith("FSDP")

    model_sharded = fsdp(model)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and isinstance(weight, DTensor) and not (model_sharded or fsdp(module)):
            mesh = weight.device_mesh
            return int(mesh.size()) if mesh.size() > 1 else None
    return None


def _transformers_tp_size(model: nn.Module) -> Optional[int]:
    try:
        from accelerate.utils.other import get_model_tp_size
    except ImportError:  # pragma: no cover - older accelerate
        return getattr(model, "tp_size", None)
    try:
        return get_model_tp_size(model)
    except Exception:  # noqa: BLE001 - a model it cannot read has no TP size it knows
        return None


def check_tensor_parallel(accelerator, model: nn.Module, engine, plan, where: str = "") -> None:
    """Refuse to convert `model` for FP8 training under tensor parallelism (tensor_parallel_size;
    `accelerator` None: from the model alone) where `engine` cannot run it under `plan`
    (Engine.tensor_parallel_problem), naming the engine and the fix."""
    size = tensor_parallel_size(accelerator, model)
    if size is None:
        return
    problem = engine.tensor_parallel_problem(plan)
    if problem:
        raise ConversionError(f"{where}tensor parallelism (tp_size={size}) in FP8: {problem}. "
                              "See docs/tensor_parallel.md.")
