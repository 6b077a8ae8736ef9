"""FP8 all-gather for the native engine under FSDP2: each rank casts its shard of a weight to FP8
before the all-gather, so the collective moves one byte an element (half of bf16's) plus a scale.

Every rank must cast its shard with the same scale, or the gathered weight would not be one FP8
tensor. The scales of all gathered weights are worked out together after each optimizer step
(`precompute_weight_scales`, from the native engine's end_step): one all-reduce (max) of the
stacked amaxes of the local shards, as torchao's precompute does. Dynamic weight scaling scales
from that amax; delayed scaling takes the layer's own weight scale (fp8_scale, set by the
end-of-step update that runs just before), falling back to that amax before the slot's first
update, as a delayed cast does. A weight changed in place since (a checkpoint loaded into it, an
optimizer step without the engine's end_step) loses its scale, and its next all-gather works one
out for itself (one small all-reduce per weight).

Two tensor subclasses do it, both invisible outside FSDP2's all-gather:

- `FP8AllGatherWeight`, the parameter FSDP2 shards: it holds the high-precision tensor and runs
  every op on it (optimizer states, gradients and state-dict values come out plain; a state-dict
  hook unwraps the parameter itself), and gives FSDP2 its `fsdp_pre_all_gather` /
  `fsdp_post_all_gather` hooks.
- `GatheredFP8Weight`, the unsharded weight the layer sees: the gathered FP8 bytes, their scale and
  the weight's amax (delayed scaling records it). NativeFP8Linear's weight cast takes it as it is
  (`gathered_cast`); any other op on it (eval outside FP8, a high-precision override) sees the
  dequantized weight.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn

from fp8plug.backends.native import tile_cast, transposed_cast
from fp8plug.backends.native.scaling import FP8_MAX, delayed_scale, quantize, scale_from_amax

WEIGHT = 1  # the weight's slot in a NativeFP8Linear's scaling buffers (linear.WEIGHT)

# Ops whose result is the same weight seen differently (FSDP2's sharding: chunk, pad, copy, view;
# to_empty, pinning): the result stays wrapped. Every other op's result is plain.
_KEEP_WRAPPED = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.slice.Tensor, torch.ops.aten.copy_.default, torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default, torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor, torch.ops.aten.clone.default, torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}
# Ops that show the gathered FP8 bytes differently without reading them (FSDP2's unsharded view,
# Parameter's detach)
_GATHERED_VIEWS = {
    torch.ops.aten.as_strided.default, torch.ops.aten.detach.default, torch.ops.aten.view.default,
    torch.ops.aten.alias.default,
}


class WeightCastState:
    """What all the wrappers of one weight share: its layer (weakly), its FP8 dtype, and the scale
    (and amax) its next all-gather casts with, None when it must be worked out."""

    __slots__ = ("layer", "dtype", "scale", "amax", "__weakref__")

    def __init__(self, layer: nn.Module, dtype: torch.dtype):
        self.layer = weakref.ref(layer)
        self.dtype = dtype
        self.scale: Optional[torch.Tensor] = None
        self.amax: Optional[torch.Tensor] = None


def _wrapper(cls, like: torch.Tensor, dtype: torch.dtype):
    return torch.Tensor._make_wrapper_subclass(
        cls, like.size(), strides=like.stride(), storage_offset=like.storage_offset(), dtype=dtype,
        layout=like.layout, device=like.device, requires_grad=like.requires_grad)


class FP8AllGatherWeight(torch.Tensor):
    """A high-precision weight that FSDP2 all-gathers in FP8 (see the module doc)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, state: WeightCastState):
        return _wrapper(cls, tensor, tensor.dtype)

    def __init__(self, tensor: torch.Tensor, state: WeightCastState):
        self._tensor = tensor
        self._state = state

    def __repr__(self):
        return f"FP8AllGatherWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        states = []

        def unwrap(t):
            states.append(t._state)
            return t._tensor

        args, kwargs = pytree.tree_map_only(FP8AllGatherWeight, unwrap, (args, kwargs or {}))
        if func._schema.is_mutable:  # changed in place: its precomputed scale no longer holds
            for state in states:
                state.scale = state.amax = None
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPED:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: FP8AllGatherWeight(t, states[0]), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._state

    @staticmethod
    def __tensor_unflatten__(inner, state, outer_size, outer_stride):
        return FP8AllGatherWeight(inner["_tensor"], state)

    # FSDP2's all-gather extension ---------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard in FP8 (padded to FSDP2's padded shard size), and (scale, amax) as
        the metadata every rank holds alike."""
        state = self._state
        if state.scale is None:  # not precomputed since the weight last changed: this weight alone
            _set_scales([state], [self._tensor], _groups_of(mesh))
        data = _shard_cast(self._tensor, state.scale, state.dtype)
        rows = -(-outer_size[0] // mesh.size()) if len(outer_size) else 0
        if data.dim() and data.shape[0] != rows:  # an uneven last shard: FSDP2 gathers equal sizes
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data,), (state.scale, state.amax)

    def fsdp_post_all_gather(self, outputs: Tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                             *, out: Optional[torch.Tensor] = None):
        (data,), (scale, amax) = outputs, metadata
        if out is not None:  # later all-gathers refill the same storage: only the scale is new
            target = out._local_tensor if hasattr(out, "_local_tensor") else out
            target._scale, target._amax = scale, amax
            return None
        return GatheredFP8Weight(data, scale, amax, param_dtype), (data,)


class GatheredFP8Weight(torch.Tensor):
    """An all-gathered weight in FP8: the bytes, the scale they were cast with (FP8 = real x
    scale) and the weight's amax; its dtype is the high precision the layer computes in."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
        return _wrapper(cls, data, dtype)

    def __init__(self, data, scale, amax, dtype):
        self._data, self._scale, self._amax = data, scale, amax

    def __repr__(self):
        return f"GatheredFP8Weight({tuple(self.shape)}, {self._data.dtype}, dtype={self.dtype})"

    def dequantized(self) -> torch.Tensor:
        return (self._data.float() * self._scale.reciprocal()).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GATHERED_VIEWS and isinstance(args[0], GatheredFP8Weight):
            first = args[0]
            data = func(first._data, *args[1:], **kwargs)
            return GatheredFP8Weight(data, first._scale, first._amax, first.dtype)
        args, kwargs = pytree.tree_map_only(GatheredFP8Weight, lambda t: t.dequantized(), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_scale", "_amax"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return GatheredFP8Weight(inner["_data"], inner["_scale"], inner["_amax"], dtype)


def gathered_cast(weight: torch.Tensor, transposed: bool = True):
    """NativeFP8Linear's weight cast for a weight FSDP2 gathered in FP8: (FP8, its transpose (None
    unless `transposed`), 1 / scale, amax), as cast_operand returns them; None for any other weight."""
    if not isinstance(weight, GatheredFP8Weight):
        return None
    data = weight._data
    if not transposed:
        data_t = None
    elif tile_cast.usable(data):  # eagerly on CUDA: the rule every eager Triton cast follows
        data_t = transposed_cast.transposed(data)
    else:  # compiled: the compiler writes the transposing kernel
        data_t = data.t().contiguous()
    return data, data_t, weight._scale.reciprocal(), weight._amax


def _shard_cast(shard: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A rank's shard in FP8 before the all-gather: quantize's bytes, in one pass on CUDA (FSDP2
    runs this outside any compiled code, twice a step with activation checkpointing or resharding,
    where quantize's torch ops read the float32 shard five times)."""
    if dtype == tile_cast.E4M3 and shard.numel() and tile_cast.usable(shard):
        return tile_cast.cast_scaled(shard, scale)
    return quantize(shard, scale, dtype)


# --- wrapping, state dicts, scales -------------------------------------------------------------------


_WRAPPED = []  # True once any weight was wrapped in this process


def wrapped_any() -> bool:
    return bool(_WRAPPED)


def log_all_gather(count: int) -> None:
    """The `fp8plug` log line saying which all-gather FSDP2 will run (once per process)."""
    from fp8plug.coverage import is_main_process, logger

    if count and not _LOGGED and is_main_process():
        _LOGGED.append(True)
        logger.info("fp8plug: native engine: FSDP2 will all-gather %d weights in FP8 (one scale each, "
                    "precomputed after every optimizer step), not in bf16 (enable_fsdp_float8_all_gather=True)", count)


_LOGGED = []


def wrap_weight(layer: nn.Module) -> None:
    """Make `layer.weight` (a NativeFP8Linear's, before FSDP2 shards it) all-gather in FP8, and
    keep `layer.state_dict()` plain. A new Parameter object (callers rebind optimizers)."""
    weight = layer.weight
    if isinstance(weight, FP8AllGatherWeight) or _local(weight) is not weight:
        return
    state = WeightCastState(layer, layer.fwd_dtype)
    _WRAPPED[:] = [True]
    layer.weight = nn.Parameter(FP8AllGatherWeight(weight.data, state), requires_grad=weight.requires_grad)
    layer.register_state_dict_post_hook(_plain_weight_in_state_dict)


def unwrap_weight(layer: nn.Module) -> nn.Parameter:
    """The plain Parameter of a wrapped (and not sharded) weight, for unconverting."""
    weight = layer.weight
    if isinstance(weight, FP8AllGatherWeight):
        return nn.Parameter(weight._tensor, requires_grad=weight.requires_grad)
    return weight


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def plain(value):
    """`value` without the FP8AllGatherWeight wrapper, a DTensor around one included."""
    local = _local(value)
    if not isinstance(local, FP8AllGatherWeight):
        return value
    if local is value:
        return local._tensor
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local._tensor, value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def _plain_weight_in_state_dict(module, state_dict, prefix, local_metadata):
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = plain(state_dict[key])


def _groups_of(mesh) -> List:
    return [mesh.get_group(dim) for dim in range(mesh.ndim)] if mesh is not None else []


def _amax_over(amax: torch.Tensor, groups) -> torch.Tensor:
    """Max over every rank holding a part (or a copy) of the weights: one all-reduce per mesh
    dimension (one for FSDP2's usual 1-D mesh)."""
    import torch.distributed as dist

    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


@torch.no_grad()
def _set_scales(states: List[WeightCastState], shards: List[torch.Tensor], groups) -> None:
    """Work out the next all-gather's scale of each weight from the max |w| over its whole tensor,
    in a handful of launches for all of them (after every step, for every weight of the model,
    where one weight's ops at a time cost the host about eight launches a weight): the shards'
    maxima in one foreach kernel, one all-reduce, then the scales of each kind of weight (delayed
    or dynamic, its format and margin) in one set of elementwise ops."""
    kinds = {}  # (fp8 max, margin, delayed) -> [(state, shard, layer)]
    for state, shard in zip(states, shards):
        layer = state.layer()
        delayed = layer is not None and layer.delayed_slots[WEIGHT]
        if delayed:
            layer.materialise_fp8_state()
        key = (FP8_MAX[state.dtype], layer.margin if delayed else 0, delayed)
        kinds.setdefault(key, []).append((state, shard, layer))
    ordered = [member for members in kinds.values() for member in members]
    amax = _amax_over(_shard_maxima([shard for _, shard, _ in ordered]), groups)
    start = 0
    for (fp8_max, margin, delayed), members in kinds.items():
        part = amax[start:start + len(members)]
        start += len(members)
        if delayed:
            prev = torch.stack([layer.fp8_scale[WEIGHT] for _, _, layer in members])
            used = torch.stack([layer.fp8_step[WEIGHT] for _, _, layer in members]) > 0
            scale = delayed_scale(prev, used, part, fp8_max, margin)
        else:
            scale = scale_from_amax(part, fp8_max)
        for i, (state, _, _) in enumerate(members):
            state.scale, state.amax = scale[i], part[i]


def _shard_maxima(shards: List[torch.Tensor]) -> torch.Tensor:
    """float32 [len(shards)]: each shard's max |w| (0 for an empty one), NaN where it holds one."""
    filled = [s for s in shards if s.numel()]
    maxima = iter(torch._foreach_norm(filled, float("inf")) if filled else [])
    device = shards[0].device
    return torch.stack([next(maxima).float() if s.numel() else torch.zeros((), device=device) for s in shards])


def gathered_weights(models) -> List[Tuple[WeightCastState, torch.Tensor, Any]]:
    """(state, local shard, device mesh) of every FP8-all-gathered weight in `models`, sharded or not."""
    found, seen = [], set()
    for model in models:
        for module in model.modules():
            weight = getattr(module, "weight", None)
            local = _local(weight) if isinstance(weight, torch.Tensor) else None
            if isinstance(local, FP8AllGatherWeight) and id(local._state) not in seen:
                seen.add(id(local._state))
                found.append((local._state, local._tensor, getattr(weight, "device_mesh", None)))
    return found


def precompute_weight_scales(models) -> None:
    """After an optimizer step: the scale each FP8-all-gathered weight of `models` is cast with at
    its next all-gather, for all of them in one all-reduce per device mesh."""
    by_mesh = {}
    for state, shard, mesh in gathered_weights(models):
        if mesh is None or shard.is_meta:
            continue  # not sharded (yet): nothing is all-gathered
        by_mesh.setdefault(id(mesh), (mesh, []))[1].append((state, shard))
    for mesh, members in by_mesh.values():
        _set_scales([s for s, _ in members], [t for _, t in members], _groups_of(mesh))
