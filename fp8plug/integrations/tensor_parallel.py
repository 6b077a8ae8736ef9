"""Tensor parallelism (Accelerate's `ParallelismConfig(tp_size=N)`, a transformers model loaded with
`tp_plan="auto"`, torch's `parallelize_module`) and fp8plug: refused at prepare, with the fix.

Under tensor parallelism every Linear's weight is a shard (a DTensor, or a local shard with
transformers' hooks) and the sharding plan's forward hooks sit on the Linear module itself: its
input hook makes the input what the shard needs and a row-wise layer's output hook adds up the
partial sums. Converting replaces the Linear with an engine's FP8 module, which holds the same
weight but neither those hooks nor a GEMM that takes DTensor operands, so the step would either
crash inside the FP8 cast or return partial sums unreduced. No fp8plug engine carries a
tensor-parallel plan over yet, so prepare() stops first, naming what to do instead.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from fp8plug.layers.rules import ConversionError


def tensor_parallel_size(accelerator, model: nn.Module) -> Optional[int]:
    """The tensor-parallel degree `model` trains with: the Accelerator's ParallelismConfig tp_size
    where above 1, else what transformers recorded when it sharded the model, else 2 or more
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


def check_no_tensor_parallel(accelerator, model: nn.Module, engine, where: str = "") -> None:
    """Refuse to convert `model` for FP8 training under tensor parallelism (see the module doc)."""
    size = tensor_parallel_size(accelerator, model)
    if size is None:
        return
    raise ConversionError(
        f"{where}tensor parallelism (tp_size={size}) is not supported by the {engine.title} engine "
        f"(backend={engine.name!r}): its FP8 Linears would replace the tensor-parallel Linears and drop the "
        "plan's input/output hooks, and its FP8 casts take no DTensor weights. Train with tp_size=1 and shard "
        "with FSDP2 instead (ParallelismConfig(dp_shard_size=<number of GPUs>) or "
        "FullyShardedDataParallelPlugin(fsdp_version=2)); or keep tensor parallelism in bf16 "
        "(mixed_precision='bf16'). See docs/distributed.md, 'Tensor parallelism'."
    )
