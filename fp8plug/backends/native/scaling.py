"""Per-tensor FP8 scaling: amax, scale, quantize, and delayed scaling's once-per-step update.

Delayed scaling follows TransformerEngine's DelayedScaling: during a step a module only records
the largest amax of each tensor it casts (over every call, recomputed forwards included) and casts
with the scale the previous step decided. Once per optimizer step the recorded amaxes are reduced
across data-parallel ranks in one collective for the whole model and folded into each history, so
every rank casts with one scale. A non-finite amax (a skipped step) changes no history or scale
(`forget_bad_step`), and scales stay inside float32's normal range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from fp8plug.recipe.scalings import DelayedScaling

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
# The largest scale kept: 2**126, so that the reciprocal `torch._scaled_mm` is given stays a
# normal float32 (2**-126); a scale of float32's max would hand it a subnormal, which GPU kernels
# may flush to zero. TransformerEngine clamps at float32's max for the same reason (no inf).
SCALE_MAX = 2.0**126
# What an amax slot holds when nothing was recorded in the step (a real amax is >= 0).
NOT_RECORDED = -1.0
_INF = float("inf")


def amax_of(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a float32 scalar (NaN if `t` holds a NaN). `t` comes detached: a cast detaches its
    input once, before this and `quantize`, so that neither is part of autograd's graph. Reduced
    row by row first: a row reduction walks the tensor the way the FP8 cast does, so the compiler
    can compute both in one read (delayed scaling)."""
    t = t.abs()
    if t.dim() >= 2:
        t = t.amax(dim=-1)
    return t.amax().float()


def scale_from_amax(amax: torch.Tensor, fp8_max, margin: int = 0, fallback=None) -> torch.Tensor:
    """TransformerEngine's formula, scale = fp8_max / amax / 2**margin, at most SCALE_MAX; where
    amax is zero, negative (not recorded) or not finite, `fallback` (or 1) is kept instead."""
    scale = fp8_max / amax
    if margin:
        scale = scale / (2.0**margin)
    scale = scale.clamp(max=SCALE_MAX)
    # `amax < inf` is False for NaN too; a Python 1.0 rather than ones_like: every op written here
    # is an op torch.compile traces, lowers and schedules for each cast of each layer (the time to
    # the first step), so the rules are spelled in the fewest ops
    usable = (amax > 0) & (amax < _INF)
    return torch.where(usable, scale, fallback if fallback is not None else 1.0)


def delayed_scale(prev_scale: torch.Tensor, use_prev: torch.Tensor, amax: torch.Tensor, fp8_max,
                  margin: int = 0) -> torch.Tensor:
    """The scale a delayed-scaling cast uses: `prev_scale`, set at the end of the last step, where
    `use_prev` (a bool tensor: the slot has had an update); before that, the current `amax`'s, so
    the first step cannot overflow. A tensor `where`, not a Python branch, so a compiled model
    keeps one graph when the first update lands. The native engine's one-pass cast
    (backends.native.fused_cast) works the same rule out inside its kernel, in the same float32 steps;
    tests/gpu/test_fused_cast.py holds the two to the same scale and bytes."""
    return torch.where(use_prev, prev_scale, scale_from_amax(amax, fp8_max, margin))


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scale, saturate finite values to the format's range, and cast to FP8.

    A value that is not finite once scaled (inf or NaN in `t`) becomes NaN, not the largest FP8
    value: a bad batch must give a non-finite output and loss, as it does in bf16, or the usual
    `isfinite(loss)` check never fires and the batch is trained on. NaN for inf too, since E4M3
    has no inf (and the one-pass CUDA cast, backends.native.fused_cast, writes the same bytes)."""
    limit = FP8_MAX[dtype]
    scaled = t.float() * scale
    # `scaled - scaled` is +0 where `scaled` is finite and NaN where it is not, so subtracting it
    # keeps a clamped finite value (the sign of a zero too) and turns inf into NaN: two ops, where
    # a `where` on `isfinite` takes four (every op here is traced, lowered and scheduled for each
    # cast of each layer: the time to the first step). Not a NaN constant either: the compiler's
    # common-subexpression pass never merges nodes holding one (NaN != NaN), so two layers
    # casting the same input (q, k and v) would each keep their own FP8 copy for backward
    return (scaled.clamp(-limit, limit) - (scaled - scaled)).to(dtype)


def record_amax(recorded: torch.Tensor, amax: torch.Tensor) -> None:
    """Fold this call's amax into the step's recorded amax, in place (max; NaN sticks, so a bad
    step is recognised when the step ends)."""
    recorded.copy_(torch.maximum(recorded, amax))


def forget_bad_step(recorded: Sequence[torch.Tensor]) -> None:
    """Where any of a model's recorded amaxes (one tensor per layer) is NaN or inf since the last
    end-of-step update, set them all back to NOT_RECORDED, in place; otherwise leave them.

    Run at the start of each training forward: a non-finite amax there means the step it came
    from was skipped (its loss was not finite), and everything that step recorded, in every
    layer, must go, or the next good step's scale would not be the one a run without the bad batch
    has. Branch-free (no host sync); one group of kernels per device."""
    groups: dict = {}
    for t in recorded:
        groups.setdefault(t.device, []).append(t)
    flags = {device: ~torch.isfinite(torch.stack(ts)).all() for device, ts in groups.items()}
    first = next(iter(flags.values()), None)
    if first is None:
        return
    bad = first
    for flag in list(flags.values())[1:]:
        bad = bad | flag.to(first.device)
    for device, ts in groups.items():
        stacked = torch.stack(ts)
        write_back(ts, torch.where(bad.to(device), torch.full_like(stacked, NOT_RECORDED), stacked))


@dataclass(frozen=True)
class DelayedSettings:
    """What one delayed-scaling update needs: each slot's FP8 maximum (input, weight, grad_output)
    and the layer's delayed-scaling settings. Modules with equal settings are updated together in
    one batch."""

    fp8_max: tuple
    recipe: DelayedScaling


def fold_delayed_scaling(history, scale, step, amax, settings: DelayedSettings):
    """One end-of-step update for a batch of modules' states, returning new tensors.

    history: (n, L, 3) amax histories, newest first; scale: (n, 3); step: (n, 3) int64 count of
    good steps per slot; amax: (n, 3) this step's reduced amaxes, negative where there is nothing
    to fold (not recorded, or NaN/inf somewhere). A slot with a good amax pushes it into its
    history; its scale is recomputed from the history on its first good step and then every
    `interval` good steps (the newest entry for "most_recent", the maximum for "max").
    """
    good = amax >= 0
    rolled = torch.cat([amax.unsqueeze(1), history[:, :-1]], dim=1)
    history = torch.where(good.unsqueeze(1), rolled, history)
    step = step + good.long()
    recipe = settings.recipe
    reduced = history[:, 0] if recipe.amax_compute_algo == "most_recent" else history.amax(dim=1)
    recomputed = scale_from_amax(reduced, _constant(settings.fp8_max, amax.device), recipe.margin, fallback=scale)
    due = good & ((step == 1) | (step % recipe.interval == 0))
    scale = torch.where(due, recomputed, scale)
    return history, scale, step


_CONSTANTS: dict = {}


def _constant(values: tuple, device: torch.device) -> torch.Tensor:
    """`values` as a float32 tensor on `device`, made once: building it from Python every step
    would be a blocking host-to-device copy, which stalls the CPU until the GPU has drained."""
    key = (values, str(device))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _CONSTANTS[key]


def encode_for_reduction(recorded: torch.Tensor) -> torch.Tensor:
    """Recorded amaxes with NaN/inf turned into NOT_RECORDED, so that a max across ranks ignores
    a rank whose step went bad (as TransformerEngine's amax reduction ignores NaN) and a slot bad
    on every rank stays negative, which the fold skips."""
    return torch.where(torch.isfinite(recorded), recorded, torch.full_like(recorded, NOT_RECORDED))


def reduce_across_ranks(amaxes: torch.Tensor, group=None) -> torch.Tensor:
    """Max of `amaxes` over the ranks of `group` (the default group when None), in place: one
    collective, whatever the number of modules. A no-op in a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    return amaxes


def write_back(targets: Sequence[torch.Tensor], rows: torch.Tensor) -> None:
    """Copy row i of `rows` into targets[i] in place, with as few kernel launches as torch allows."""
    sources: List[torch.Tensor] = list(rows.unbind(0))
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(list(targets), sources)
    else:  # pragma: no cover - older torch
        for target, source in zip(targets, sources):
            target.copy_(source)



