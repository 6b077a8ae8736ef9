"""Finding the Linear layers whose weight a fused loss reads directly, so conversion leaves them alone.

Why: two common patches replace a causal LM's forward with one that, in training, hands
`lm_head.weight` to a fused op computing the logits chunk by chunk and the loss (or per-token
log-probabilities) without materialising the logits, and never calls `lm_head`'s forward:

- liger-kernel's `apply_liger_kernel_to_<model>(fused_linear_cross_entropy=True)` (its default,
  and what transformers' `TrainingArguments(use_liger_kernel=True)` applies): the forward is
  `lce_forward` from `liger_kernel.transformers.model.<model>`, which calls
  LigerFusedLinearCrossEntropy with `self.lm_head.weight` when labels are given in training;
- TRL's `add_fused_lm_head` (trl >= 1.x; its SFT, DPO, GRPO, KTO and RLOO trainers add it in
  their constructor and call the model with `fused_lm_head=True`): the forward is TRL's
  `_fused_forward`, which passes `get_output_embeddings().weight` to its chunked log-prob op.

An FP8 module put at the head would never run: the head would train in high precision while the
conversion report, the GEMM counters and the memory of FP8 weights said otherwise. So the head is
left unconverted and reported by name (fp8plug.layers.rules.plan_conversion). Everything else these
patches touch stays convertible: LigerSwiGLUMLP keeps gate_proj / up_proj / down_proj as
nn.Linear and calls them as modules (only the SiLU-and-multiply between them is Liger's kernel),
and LigerRMSNorm and Liger's RoPE hold no GEMM.

Found by the signal itself, never by importing liger_kernel or trl (liger needs triton, which
most machines lack): a module whose forward, bound on the instance (`apply_...(model=m)`, the
trainers) or on its class (`apply_...()`), is a function defined in one of those packages (by its
`__module__`, or its globals' module where functools.wraps copied another `__module__`, as TRL's
does), and which holds an output head (`lm_head`, else what `get_output_embeddings()` returns).
Wrappers that keep `__wrapped__` or `__func__` (functools.wraps, bound methods) are looked through.
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
    """(package, function name) of the fused-loss forward `module` runs (FUSERS), or None."""
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
