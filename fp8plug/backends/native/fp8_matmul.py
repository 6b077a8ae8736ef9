"""The native engine's FP8 matmul: y = x @ w.T from operands already cast, and its backward.

Why a file of its own: this is the one autograd Function behind every NativeFP8Linear (its three
GEMMs, which of them a frozen weight or an input without gradient skips, and delayed scaling's
grad_output amax record); the layer around it (backends.native.linear) decides the casts.
`_cast` and `scaled_mm` are module names so tests can count the casts and GEMMs backward makes.

Compiled, the Function stays (dynamo traces it), where the finer scalings' GEMMs are an operator
(backends.native.compiled_ops): as an operator it would take the layer's high-precision input as
an input, which the compiler must then write out, where traced it fuses the norm before it into
the input's cast and never writes the normalised activation (tests/support/fusion.py). Tried on
the benchmark Llama (one H200): dynamo traced 1.5 s less, and the peak grew by 0.78 GB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn.functional as F

from fp8plug.backends.gemm import scaled_mm, writable_dtype
from fp8plug.backends.native import shared_input
from fp8plug.backends.native.cast import cast_operand as _cast  # the rule for one operand (the name tests patch)
from fp8plug.backends.native.scaling import record_amax


def _scaled_mm(a, b, inv_scale_a, inv_scale_b, out_dtype, fast_accum):
    """a @ b from FP8 operands and their inverse scales (what _cast returns: the factor back to
    real values, which is what the GEMM takes)."""
    return scaled_mm(a, b, inv_scale_a, inv_scale_b, out_dtype, use_fast_accum=fast_accum)


@dataclass(frozen=True)
class GemmConfig:
    """What _FP8Linear needs besides tensors, by name: the GEMMs' output dtype, grad_output's FP8
    dtype, which GEMMs run in high precision (`override`: fprop, dgrad, wgrad), grad_output's
    scaling mode ("delayed" or "dynamic") and the margin of its scale. Frozen, so torch.compile
    treats it as a constant of the graph, as it did the tuple it replaces."""

    out_dtype: torch.dtype
    bwd_dtype: torch.dtype
    override: Tuple[bool, bool, bool]
    grad_mode: str
    margin: int


class _FP8Linear(torch.autograd.Function):
    """y = x @ w.T with FP8 operands; backward GEMMs in FP8 too unless overridden.

    Forward is given x and w already cast (as is and transposed, by `_cast`) and saves only the
    transposed copies backward needs. A frozen weight (LoRA's base layers) gets no gradient: its
    layer's input comes without the transposed copy (x_t None), and backward runs neither the
    weight-gradient GEMM nor grad_output's transposed cast; likewise an input that needs no
    gradient (the first layer's) gets no input-gradient GEMM. `grad_record` is the module's
    recorded grad_output amax. It is kept on ctx rather than saved with save_for_backward: several
    calls of one layer before one backward all write into it, and a saved tensor written in place
    would fail autograd's version check."""

    @staticmethod
    def forward(ctx, x, weight, x_cast, w_cast, grad_scale, grad_record, config: GemmConfig):
        x_fp8, x_t, x_inv = x_cast
        w_fp8, w_t, w_inv = w_cast
        override = config.override
        if override[0]:
            out = F.linear(x.to(config.out_dtype), weight.to(config.out_dtype))
        else:
            out = _scaled_mm(x_fp8, w_fp8.t(), x_inv, w_inv, config.out_dtype, True)
        high = (x, weight) if override[1] or override[2] else ()
        ctx.save_for_backward(x_t, w_t, x_inv, w_inv, grad_scale, *high)
        ctx.grad_record = grad_record
        ctx.config = config
        ctx.dtypes = (x.dtype, weight.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        config: GemmConfig = ctx.config
        out_dtype, override = config.out_dtype, config.override
        x_t, w_t, x_inv, w_inv, grad_scale, *high = ctx.saved_tensors
        if not torch.compiler.is_compiling():
            shared_input.forget()  # forward's kept input cast: backward never reads its row-major copy
        # delayed: the scale set at the end of the last step (grad_scale > 0); before the first,
        # the current amax's
        delayed = config.grad_mode == "delayed"
        g_fp8, g_t, g_inv, g_amax = _cast(grad_out, config.bwd_dtype, delayed, grad_scale,
                                             grad_scale > 0 if delayed else None, config.margin,
                                             transposed=ctx.needs_input_grad[1])
        if ctx.grad_record is not None:
            record_amax(ctx.grad_record, g_amax)
        x_dtype, w_dtype = ctx.dtypes
        if not ctx.needs_input_grad[0]:
            grad_x = None
        elif override[1]:
            grad_x = grad_out.to(out_dtype) @ high[1].to(out_dtype)
        else:
            # eagerly in the input's own dtype (an fp32 residual stream under autocast), saving a copy
            # kernel; compiled, the compiler folds that conversion into the kernel reading the gradient
            dgrad_dtype = out_dtype if torch.compiler.is_compiling() else writable_dtype(x_dtype, out_dtype)
            grad_x = _scaled_mm(g_fp8, w_t.t(), g_inv, w_inv, dgrad_dtype, False)
        if not ctx.needs_input_grad[1]:
            grad_w = None
        elif override[2]:
            grad_w = grad_out.to(out_dtype).t() @ high[0].to(out_dtype)
        else:  # written in the weight's own dtype (fp32 master weights): no extra cast pass over it
            grad_w = _scaled_mm(g_t, x_t.t(), g_inv, x_inv, writable_dtype(w_dtype, out_dtype), False)
        grad_x = None if grad_x is None else grad_x.to(x_dtype)
        grad_w = None if grad_w is None else grad_w.to(w_dtype)
        return grad_x, grad_w, None, None, None, None, None
