"""FP8 for any token count: zero-pad the token dimension up to what an FP8 GEMM needs.

The token count M is the inner dimension of the weight-gradient GEMM, so engines ask for M
divisible by 16 (8 for TransformerEngine, 32 for MXFP8); with dynamic padding most batches have
some other M, and running those in high precision would make an "FP8" run mostly bf16. Zero rows
change nothing on the real rows (each output row depends on its own input row only, a zero row
adds nothing to the weight and bias gradients, and zeros never raise an amax, so every scale is
the real rows'). The cost: one copy of the input and of the output gradient.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def token_count(x: torch.Tensor) -> int:
    """M: the number of rows the GEMM sees (every dimension but the last, multiplied)."""
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def pad_tokens(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, multiple: int) -> torch.Tensor:
    """`forward(x)`, with x's token dimension zero-padded up to a multiple of `multiple` on the
    way in and the padding rows sliced off the output (`forward` maps (M, K) rows to (M, N))."""
    rows = token_count(x)
    extra = -rows % multiple if multiple > 1 else 0
    if extra == 0:
        return forward(x)
    flat = x.reshape(rows, x.shape[-1])
    out = forward(F.pad(flat, (0, 0, 0, extra)))
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])
