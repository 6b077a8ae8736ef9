"""A NativeFP8Linear whose weight and input are DTensors on a tensor-parallel mesh.

Why a module of its own: tensor parallelism (torch's `parallelize_module`, a transformers model
loaded with `tp_plan`, Accelerate's `ParallelismConfig(tp_size=N)`) hands the layer DTensors, and
the FP8 casts and GEMMs take plain tensors. Each rank's GEMM is a plain GEMM on its shards, so the
layer unwraps them (`to_local`), runs its own FP8 path on them (`NativeFP8Linear.local_forward`,
any scaling: per tensor, delayed, rowwise, blockwise) and wraps the result as the DTensor that
`F.linear` would have given, which the plan's output hook then redistributes:

    layout     weight     input       output      input gradient
    colwise    Shard(0)   Replicate   Shard(-1)   Partial (summed by the input's redistribution)
    rowwise    Shard(1)   Shard(-1)   Partial     Shard(-1)
    replicate  Replicate  Replicate   Replicate   Replicate

A colwise bias is sharded like the output and added to the local output; a rowwise bias is a
Replicate DTensor added to the Partial output as a DTensor op, so it counts once in the sum. Every
scale comes from this rank's shard (a finer scaling than one for the whole tensor; delayed
scaling's end-of-step all-reduce then gives every rank the max over all shards). Under FSDP2 on a
[dp_shard, tp] mesh the layer sees the weight FSDP2 unsharded, a DTensor on the tp mesh, as here.
The DTensor calls (`to_local`, `from_local`) are ones torch.compile traces.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover - torch built without distributed: nothing is ever a DTensor
    DTensor = ()


def is_distributed(*tensors) -> bool:
    """Whether any of `tensors` is a DTensor (then the layer takes the sharded path)."""
    return any(isinstance(t, DTensor) for t in tensors)


def _shard_dim(placement, ndim: int) -> Optional[int]:
    """The dimension a Shard placement splits, made non-negative; None for any other placement."""
    if not placement.is_shard():
        return None
    return placement.dim % ndim


def layout(module: nn.Module, x: torch.Tensor) -> str:
    """'colwise', 'rowwise' or 'replicate': how `module`'s weight and its input `x` are laid out on
    the mesh (the table in the module doc); a ValueError naming the layer and the fix for any other
    layout."""
    weight = module.weight
    name = f"{type(module).__name__}(in_features={module.in_features}, out_features={module.out_features})"
    if not isinstance(weight, DTensor) or not isinstance(x, DTensor):
        which = "its input" if isinstance(weight, DTensor) else "its weight"
        raise ValueError(
            f"{name}: {which} is a plain tensor while the other is a DTensor; a tensor-parallel Linear takes both "
            "as DTensors on one mesh (its plan's input hook makes the input one). Shard the layer with its plan "
            "(parallelize_module / tp_plan) before converting it, or leave it out of the plan entirely.")
    mesh = weight.device_mesh
    if mesh.ndim != 1 or x.device_mesh.ndim != 1:
        raise ValueError(
            f"{name}: its weight is on a {mesh.ndim}-D mesh and its input on a {x.device_mesh.ndim}-D one; the FP8 "
            "Linear runs on a 1-D tensor-parallel mesh (FSDP2 gives it the tp mesh's weight once it unshards a "
            "[dp_shard, tp] parameter); apply tensor parallelism on the tp sub-mesh (mesh['tp']).")
    w_dim = _shard_dim(weight.placements[0], 2)
    x_dim = _shard_dim(x.placements[0], x.ndim)
    if w_dim == 0 and x.placements[0].is_replicate():
        return "colwise"
    if w_dim == 1 and x_dim == x.ndim - 1:
        return "rowwise"
    if weight.placements[0].is_replicate() and x.placements[0].is_replicate():
        return "replicate"
    raise ValueError(
        f"{name}: weight {weight.placements[0]} with input {x.placements[0]} is not a layout the FP8 Linear runs; "
        "it runs colwise (weight Shard(0), input Replicate), rowwise (weight Shard(1), input Shard(-1)) and "
        "replicated (both Replicate): use ColwiseParallel / RowwiseParallel (or tp_plan's 'colwise' / "
        "'rowwise'), or leave the layer out of the FP8 conversion (modules_to_ignore).")


def _contiguous(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


def sharded_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module`'s forward on DTensors: its local FP8 forward on this rank's shards, rewrapped as the
    DTensor F.linear would give (the module doc's table)."""
    kind = layout(module, x)
    weight, bias = module.weight, module.bias
    mesh = weight.device_mesh
    # colwise: every rank's input gradient is its shard's part of the sum, reduced where the input
    # was made Replicate (the plan's input hook); otherwise the gradient has the input's placement
    x_local = x.to_local(grad_placements=[Partial()]) if kind == "colwise" else x.to_local()
    w_local = weight.to_local()
    local_bias = None
    if bias is not None and kind != "rowwise":  # colwise: sharded like the output; replicate: whole
        local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
    out = module.local_forward(x_local, w_local, local_bias)
    shape = (*x.shape[:-1], weight.shape[0])
    placement = {"colwise": Shard(out.ndim - 1), "rowwise": Partial(), "replicate": Replicate()}[kind]
    out = DTensor.from_local(out, mesh, [placement], run_check=False, shape=torch.Size(shape),
                             stride=_contiguous(shape))
    if bias is not None and kind == "rowwise":  # once, on the sum: a DTensor add of the Replicate bias
        out = out + (bias if isinstance(bias, DTensor) else DTensor.from_local(bias, mesh, [Replicate()],
                                                                                run_check=False))
    return out


_LOGGED = []


def log_converted(count: int) -> None:
    """The `fp8plug` log line saying how many converted Linears run on tensor-parallel shards (once
    per process, on rank 0)."""
    import logging

    import torch.distributed as dist

    if count and not _LOGGED and (not dist.is_initialized() or dist.get_rank() == 0):
        _LOGGED.append(True)
        logging.getLogger("fp8plug").info(
            "fp8plug: native engine: %d converted Linear layers are tensor-parallel (DTensor weights): each runs its "
            "FP8 GEMMs on this rank's shards, scaled from them, and keeps its plan's hooks", count)
