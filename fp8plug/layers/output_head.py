"""Which module of a model is its output head (lm_head): the Linear that turns the last hidden
states into the vocabulary's logits.

Why it is singled out: FP8 rounding there lands directly on the logits, and the head's input and
output dimensions (hidden size x vocabulary) make it the one Linear that measured costly in FP8. A
162M Llama trained 3000 steps on real text ended 1.44% above bf16's loss with every Linear in FP8,
and within bf16's own run-to-run spread with only the head left in bf16 (docs/numerics.md). So the
conversion keeps the head in high precision by default (FP8RecipeKwargs.fp8_output_head), as
torchtitan, Megatron-LM and Accelerate's torchao path do; the conversion rules
(fp8plug.layers.rules.decide_modules) ask this module which module that is.

How it is found: a transformers model says which module its head is (`get_output_embeddings()`).
The model and every submodule with that method are asked, so a PEFT wrapper or a transformers
model held inside another module is covered, and the answer is matched by identity against the
model's own modules (its fully-qualified name as `model.named_modules()` gives it). Only Linear
layers count (or FP8 Linears an engine already made of them); a LoRA-wrapped head counts through
its base layer. Where no module answers, a Linear whose name ends in `lm_head` (what most decoders
call it) is taken instead.
"""

from __future__ import annotations

from typing import FrozenSet, List

from torch import nn

from fp8plug.layers.gemm_counts import has_gemm_counter

HEAD_NAME = "lm_head"  # the fallback: the head's usual attribute name


def output_head_fqns(model: nn.Module) -> FrozenSet[str]:
    """The fully-qualified names of `model`'s output head(s); empty where it has none."""
    named = list(model.named_modules())
    by_identity = {id(module): fqn for fqn, module in named}
    found = set()
    for _, module in named:
        for head in _answers(module):
            head = _linear_of(head)
            if head is not None and id(head) in by_identity:
                found.add(by_identity[id(head)])
    if not found:
        found = {fqn for fqn, module in named
                 if fqn.rsplit(".", 1)[-1] == HEAD_NAME and _linear_of(module) is module}
    return frozenset(found)


def _answers(module: nn.Module) -> List[nn.Module]:
    """What `module.get_output_embeddings()` names, where it has the method and it answers with a
    module (a model without a head raises or returns None: nothing)."""
    ask = getattr(type(module), "get_output_embeddings", None)
    if not callable(ask):
        return []
    try:
        head = module.get_output_embeddings()
    except Exception:  # noqa: BLE001 - a model's own method: any failure means "no head named here"
        return []
    return [head] if isinstance(head, nn.Module) else []


def _linear_of(module: nn.Module):
    """`module` where it is a Linear (plain, subclassed, or already an engine's FP8 Linear); the
    base layer of a PEFT LoRA wrapper; else None."""
    if isinstance(module, nn.Linear) or has_gemm_counter(module):
        return module
    base = getattr(module, "base_layer", None)
    if isinstance(base, nn.Module) and (isinstance(base, nn.Linear) or has_gemm_counter(base)):
        return base
    return None


__all__ = ["HEAD_NAME", "output_head_fqns"]
