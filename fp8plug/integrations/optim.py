"""Low-precision optimizer states for every engine, through torchao's low-bit Adam and AdamW.

Adam keeps two fp32 moments, 8 bytes a parameter. MS-AMP's opt_level O2 shrank them but does not
install on current stacks; torchao's Adam/AdamW keep them block-quantized ("fp8", "8bit", "4bit").
Opt-in only (`FP8RecipeKwargs.optimizer_states`), and only an exact torch Adam or AdamW is
replaced, keeping its param groups (an LR scheduler built on it drives the replacement); what
cannot carry over is refused. Details and caveats: docs/msamp.md.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from fp8plug.recipe.kwargs import OPTIMIZER_STATES

# (optimizer_states, decoupled weight decay) -> torchao.optim class name
_TORCHAO_CLASSES: Dict[tuple, str] = {
    ("fp8", True): "AdamWFp8",
    ("fp8", False): "AdamFp8",
    ("8bit", True): "AdamW8bit",
    ("8bit", False): "Adam8bit",
    ("4bit", True): "AdamW4bit",
    ("4bit", False): "Adam4bit",
}
# torch.optim options the replacement cannot honour when set: name -> value that is fine
_REFUSED = {"maximize": False, "capturable": False, "differentiable": False}
# carried over to the replacement; foreach and fused only choose a kernel, which torchao's compiled
# per-parameter step replaces
_CARRIED = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def convert_optimizer(optimizer: torch.optim.Optimizer, recipe) -> torch.optim.Optimizer:
    """The optimizer to train with: `optimizer` itself unless `recipe.optimizer_states` asks for
    low-precision states, then a torchao low-bit Adam/AdamW over the same param groups.

    Call it before the first step (a stepped optimizer's states are not carried over) and before
    accelerate wraps the optimizer. torch.optim.Adam becomes torchao's Adam* (L2 weight decay),
    AdamW (or Adam with decoupled_weight_decay=True) its AdamW*.
    """
    kind = getattr(recipe, "optimizer_states", None)
    if kind is None:
        return optimizer
    if kind not in OPTIMIZER_STATES:
        raise ValueError(
            f"FP8RecipeKwargs.optimizer_states: {kind!r} is not allowed; use one of {', '.join(OPTIMIZER_STATES)}."
        )
    if _already(optimizer, kind):
        return optimizer
    decoupled = _check_convertible(optimizer, kind)
    target = _torchao_class(kind, decoupled)
    defaults = {name: optimizer.defaults[name] for name in _CARRIED if name in optimizer.defaults}
    # The same group dicts: torch.optim.Optimizer keeps the dicts it is given, so anything holding
    # the old optimizer's param_groups (an LR scheduler) now steers the new one.
    return target(optimizer.param_groups, **defaults)


def _already(optimizer, kind: str) -> bool:
    """Whether `optimizer` is already one of torchao's low-bit optimizers for `kind`."""
    return optimizer_states_of(optimizer) == kind


def _check_convertible(optimizer, kind: str) -> bool:
    """Refuse what cannot be replaced faithfully; return whether weight decay is decoupled."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        inner = getattr(optimizer, "optimizer", None)
        hint = " (an accelerate-wrapped optimizer: convert before accelerator.prepare wraps it)" if inner else ""
        raise TypeError(f"FP8RecipeKwargs.optimizer_states={kind!r}: {name} is not a torch.optim.Optimizer{hint}.")
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(
            f"FP8RecipeKwargs.optimizer_states={kind!r} replaces torch.optim.Adam or AdamW only, not "
            f"{type(optimizer).__module__}.{name}; use one of those, or leave optimizer_states None "
            "to keep this optimizer (with full-precision states)."
        )
    if optimizer.state:
        raise ValueError(
            f"FP8RecipeKwargs.optimizer_states={kind!r}: this {name} has stepped already and its states "
            "would be lost; convert it before the first step (load a checkpoint into the new one)."
        )
    for index, group in enumerate(optimizer.param_groups):
        for option, fine in _REFUSED.items():
            if group.get(option, fine) != fine:
                raise ValueError(
                    f"FP8RecipeKwargs.optimizer_states={kind!r}: param group {index} sets {option}="
                    f"{group[option]!r}, which torchao's low-bit {name} does not support; drop it or "
                    "leave optimizer_states None."
                )
    if type(optimizer) is torch.optim.AdamW:
        return True
    decoupled = {bool(group.get("decoupled_weight_decay", False)) for group in optimizer.param_groups}
    if len(decoupled) > 1:
        raise ValueError(
            f"FP8RecipeKwargs.optimizer_states={kind!r}: the Adam param groups mix decoupled_weight_decay "
            "True and False, but one torchao optimizer applies one kind; use the same in every group."
        )
    return decoupled.pop() if decoupled else False


def _torchao_class(kind: str, decoupled: bool):
    try:
        import torchao.optim as ao_optim
    except ImportError as exc:
        raise ImportError(
            f"FP8RecipeKwargs.optimizer_states={kind!r} needs torchao's low-bit optimizers: "
            f"pip install torchao ({exc})"
        ) from exc
    return getattr(ao_optim, _TORCHAO_CLASSES[(kind, decoupled)])


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by `optimizer`'s per-parameter states, counting what quantized states really
    store (codes, scales, lookup tables) rather than the size they appear to have."""
    seen = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _tensor_bytes(value, seen)
    return total


def _tensor_bytes(t: torch.Tensor, seen: set) -> int:
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, name), seen) for name in names)
    key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype) if t.numel() else None
    if key is not None and key in seen:
        return 0
    if key is not None:
        seen.add(key)
    return t.numel() * t.element_size()


def optimizer_states_of(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """"fp8", "8bit" or "4bit" when `optimizer` is one of torchao's low-bit Adam/AdamW, else None."""
    cls = type(optimizer)
    if not cls.__module__.startswith("torchao.optim"):
        return None
    for (kind, _), name in _TORCHAO_CLASSES.items():
        if cls.__name__ == name:
            return kind
    return None


__all__ = ["convert_optimizer", "optimizer_states_of", "state_bytes"]
