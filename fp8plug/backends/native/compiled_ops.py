"""Why the native engine's granular, grouped and frozen FP8 layers enter a compiled graph as
operators with a registered autograd formula, rather than as their autograd.Functions.

torch 2.11's dynamo, tracing those autograd.Functions (casts that detach their operands, then an
FP8 GEMM), measured on an H200:
- gave their backward a zero gradient: the traced backward read `aten.zeros` where the tangent
  belonged, so a compiled rowwise, blockwise or grouped-expert layer's input and weight gradients
  were exactly zero under aot_eager and inductor alike (a compiled Llama never left its first loss);
- left their ops out of activation checkpointing: torch.utils.checkpoint inside a compiled model
  tags the ops it traces for recomputation, and in 2.11 not those inside an autograd.Function
  (2.13 tags them), so the partitioner kept every frozen FP8 GEMM's output alive until backward,
  about 7 GiB for LoRA on an 8B model.
An operator is one node to dynamo: tagged like any op, and its backward is called by AOT autograd
with the real gradient. The granular and frozen layers make their casts outside their operators,
traced, so the compiler still fuses them into the ops around them (and makes q, k and v's input
cast once); the grouped layer casts inside its operator, with the fused kernels it uses eagerly.
Eagerly the autograd.Functions stay: they cost no operator dispatch.

Operators cannot return None, so an output nobody needs (the gradient of a frozen weight) is an
empty tensor here, turned back into None by the autograd formula. Outputs are contiguous, as
their fake implementations say (inductor plans the kernels after them from those strides).
"""

from __future__ import annotations

from typing import Optional

import torch


def compiling() -> bool:
    """Whether the layer is being traced by torch.compile: then it calls its operator."""
    return torch.compiler.is_compiling()


def absent(like: torch.Tensor) -> torch.Tensor:
    """The empty tensor an operator returns for an output that is not needed."""
    return like.new_empty(0)


def or_absent(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return absent(like) if t is None else t.contiguous()


def or_none(t: torch.Tensor, wanted: bool) -> Optional[torch.Tensor]:
    """An operator's output back as autograd wants it: None where it was not needed."""
    return t if wanted else None
