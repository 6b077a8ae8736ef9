"""Finding the Linear layers that Liger kernels read directly, so that conversion leaves them alone.

Why: liger-kernel's `apply_liger_kernel_to_<model>(fused_linear_cross_entropy=True)` (its
default, and what TRL's `use_liger_kernel=True` applies) replaces a causal LM's forward with its
own (`lce_forward`, from `liger_kernel.transformers.model.<model>`): in training, with labels, it
passes `self.lm_head.weight` straight to LigerFusedLinearCrossEntropy, which computes the logits
chunk by chunk with torch.mm and the loss in one op and never calls `lm_head`'s forward. An FP8
module put there would never run: the head would train in high precision while the conversion
report, the GEMM counters and the memory of FP8 weights said otherwise. So the head is left
unconverted and reported by name (fp8plug.convert.plan_conversion). Everything else Liger
patches stays convertible: LigerSwiGLUMLP keeps gate_proj / up_proj / down_proj as nn.Linear and
calls them as modules (only the SiLU-and-multiply between them is Liger's kernel), and
LigerRMSNorm and Liger's RoPE hold no GEMM.

Found by the signal itself, never by importing liger_kernel (it needs triton, and most users do
not have it): a module whose forward, bound on the instance (`apply_...(model=m)`, TRL) or on its
class (`apply_...()` before or after the model is built), is a function defined in liger_kernel,
and which holds an output head (`lm_head`, else what `get_output_embeddings()` returns, as for
Liger's PaliGemma forward that reads `language_model.lm_head`). Wrappers that keep `__wrapped__`
or `__func__` (functools.wraps, bound methods) are looked through.
"""

from __future__ import annotations

from typing import Dict, Optional

from torch import nn

LIGER_PACKAGE = "liger_kernel"
# the kind (one-line summary group) and the per-module reason, in ConversionReport's words
LIGER_KIND = "Linear layers whose weight Liger's fused linear cross-entropy reads directly"
LIGER_REASON = (
    "its weight is read directly by Liger's fused linear cross-entropy ({owner}'s forward is Liger's "
    "{function}, which computes the logits and the loss in one op without calling this module); "
    "it stays in high precision"
)


def liger_forward(module: nn.Module) -> Optional[str]:
    """The qualified name of the liger_kernel function `module` runs as its forward, or None."""
    candidates = [module.__dict__.get("forward"), getattr(type(module), "forward", None)]
    for fn in candidates:
        seen = 0
        while fn is not None and seen < 16:  # unwrap bound methods and functools.wraps layers
            origin = getattr(fn, "__module__", None) or ""
            if origin == LIGER_PACKAGE or origin.startswith(LIGER_PACKAGE + "."):
                return f"{origin}.{getattr(fn, '__qualname__', getattr(fn, '__name__', 'forward'))}"
            fn = getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
            seen += 1
    return None


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


def liger_fused_heads(model: nn.Module) -> Dict[str, str]:
    """fqn -> reason, for every nn.Linear that a Liger forward in `model` reads directly: the
    output head of each module whose forward is Liger's, and any Linear inside it (a PEFT wrapper's
    base_layer, whose weight is the one Liger reads). Empty for a model without Liger's forward."""
    owners = []
    for fqn, module in model.named_modules():
        function = liger_forward(module)
        if function is None:
            continue
        head = _output_head(module)
        if head is not None:
            owners.append((fqn, type(module).__name__, function.rsplit(".", 1)[-1], head))
    if not owners:
        return {}
    heads = {id(head): (owner, function) for _, owner, function, head in owners}
    found: Dict[str, str] = {}
    inside: Dict[str, tuple] = {}  # subtree prefix -> (owner, function)
    for fqn, module in model.named_modules():
        hit = heads.get(id(module))
        if hit is not None:
            inside[fqn] = hit
        prefix = next((p for p in inside if fqn == p or fqn.startswith(p + ".")), None)
        if prefix is not None and isinstance(module, nn.Linear):
            owner, function = inside[prefix]
            found[fqn] = LIGER_REASON.format(owner=owner, function=function)
    return found
