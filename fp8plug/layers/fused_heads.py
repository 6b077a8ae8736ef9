"""Finding the Linear layers whose weight a fused loss reads directly, so conversion leaves them alone.

Liger's fused linear cross-entropy (`apply_liger_kernel_to_<model>`, also through
`TrainingArguments(use_liger_kernel=True)`) and TRL's fused LM head (`add_fused_lm_head`, in its
trainers) replace a causal LM's forward with one that hands `lm_head.weight` to a fused op and
never calls `lm_head`. An FP8 module there would never run while the report and the GEMM counters
said FP8, so the head is left unconverted and reported by name (fp8plug.layers.rules). Found from
the forward function's own module, never by importing liger_kernel or trl. See docs/liger.md.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from torch import nn

# the kinds (one-line summary groups) and the per-module reasons, in ConversionReport's words
LIGER_KIND = "Linear layers whose weight Liger's fused linear cross-entropy reads directly"
LIGER_REASON = (
    "its weight is read directly by Liger's fused linear cross-entropy ({owner}'s forward is Liger's "
    "{function}, which computes the logits and the loss in one op without calling this module); "
    "it stays in high precision"
)
TRL_KIND = "Linear layers whose weight TRL's fused LM head reads directly"
TRL_REASON = (
    "its weight is read directly by TRL's fused LM head ({owner}'s forward is TRL's {function}, added by "
    "trl's add_fused_lm_head, which computes the per-token log-probabilities chunk by chunk without "
    "calling this module); it stays in high precision"
)
# package -> (does this function of it read the head directly, kind, reason)
FUSERS = {
    "liger_kernel": (lambda name: True, LIGER_KIND, LIGER_REASON),  # its model forwards: lce_forward & co
    "trl": (lambda name: "fused" in name, TRL_KIND, TRL_REASON),  # _fused_forward, not TRL's other wrappers
}


def _origins(fn) -> Tuple[str, ...]:
    module = getattr(fn, "__module__", None) or ""
    defined = (getattr(fn, "__globals__", None) or {}).get("__name__") or ""
    return tuple(dict.fromkeys(m for m in (module, defined) if m))


def fused_forward(module: nn.Module) -> Optional[Tuple[str, str]]:
    """(package, function name) of the fused-loss forward `module` runs (FUSERS), or None.

    The forward is looked up bound on the instance (`apply_...(model=m)`, the trainers), then on the
    class (`apply_...()`); its package is read from its `__module__`, or from its globals' module
    where functools.wraps copied another `__module__` (as TRL's does), through bound methods and
    `__wrapped__` layers."""
    for fn in (module.__dict__.get("forward"), getattr(type(module), "forward", None)):
        for _ in range(16):  # unwrap bound methods and functools.wraps layers
            if fn is None:
                break
            code = getattr(fn, "__code__", None)
            name = code.co_name if code is not None else getattr(fn, "__name__", "forward")
            for origin in _origins(fn):
                package = origin.split(".", 1)[0]
                if package in FUSERS and FUSERS[package][0](name):
                    return package, name
            fn = getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
    return None


def liger_forward(module: nn.Module) -> Optional[str]:
    """The name of the liger_kernel function `module` runs as its forward, or None."""
    found = fused_forward(module)
    return found[1] if found and found[0] == "liger_kernel" else None


def _output_head(module: nn.Module) -> Optional[nn.Module]:
    head = getattr(module, "lm_head", None)
    if isinstance(head, nn.Module):
        return head
    get = getattr(module, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except (AttributeError, NotImplementedError, TypeError):
            return None
        return head if isinstance(head, nn.Module) else None
    return None


def fused_heads(model: nn.Module) -> Dict[str, Tuple[str, str]]:
    """fqn -> (kind, reason), for every nn.Linear that a fused-loss forward in `model` reads
    directly: the output head of each module whose forward is one (FUSERS), and any Linear inside
    it (a PEFT wrapper's base_layer, whose weight is the one read). Empty for a model without one."""
    heads = {}
    for module in model.modules():
        found = fused_forward(module)
        head = _output_head(module) if found else None
        if head is not None:
            package, function = found
            _, kind, reason = FUSERS[package]
            heads[id(head)] = (kind, reason.format(owner=type(module).__name__, function=function))
    if not heads:
        return {}
    found_heads: Dict[str, Tuple[str, str]] = {}
    inside: Dict[str, Tuple[str, str]] = {}  # subtree prefix -> (kind, reason)
    for fqn, module in model.named_modules():
        if id(module) in heads:
            inside[fqn] = heads[id(module)]
        prefix = next((p for p in inside if fqn == p or fqn.startswith(p + ".")), None)
        if prefix is not None and isinstance(module, nn.Linear):
            found_heads[fqn] = inside[prefix]
    return found_heads


def liger_fused_heads(model: nn.Module) -> Dict[str, str]:
    """fqn -> reason, for the Linear layers Liger's fused linear cross-entropy reads directly."""
    return {fqn: reason for fqn, (kind, reason) in fused_heads(model).items() if kind == LIGER_KIND}
