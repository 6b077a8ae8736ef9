"""A frozen Linear whose weight stays in FP8 in memory: the base layers of LoRA on an FP8 release.

Why: a model released in FP8 (a `save_fp8_checkpoint` directory, or any per-tensor / 128x128
block `quant_method: "fp8"` checkpoint) is usually dequantized to bf16 for fine-tuning, doubling
the base's memory, and then FP8 training casts the same weights back to FP8 on every step. Under
LoRA the base never changes, so its FP8 codes can feed the FP8 GEMMs as they are: one byte per
weight, no weight cast, no weight-gradient GEMM.

`FrozenFP8Linear` is an `nn.Linear` (PEFT wraps it as a LoRA base layer, `decide_modules`
recognises it through the native engine's `is_converted`) holding
- `weight`: a float8_e4m3fn Parameter, requires_grad False, row-major [out, in];
- `weight_scale`: a float32 scalar buffer, the multiplier (weight ~= fp8 x scale), persistent, so
  the state dict is the per-tensor checkpoint layout itself.

In FP8 (training mode or an enabled FP8 region, widths multiples of 16) the input is cast by the
native engine's rule (`cast.cast_operand`, dynamic per-tensor E4M3) and multiplied with the stored
codes; backward casts grad_output to E5M2 and runs the input-gradient GEMM against the stored codes
(a transient column-major copy of the 1-byte weight, never a high-precision one). Otherwise (eval,
odd widths) the weight is dequantized for that call only. `compute_dtype` tells PEFT which dtype
the adapters take (PEFT reads it, as it does for bitsandbytes layers; without it PEFT would cast the
adapters to the base weight's float8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp8plug.backends.gemm import scaled_mm, writable_dtype
from fp8plug.backends.native import compiled_ops, fused_cast, shared_input
from fp8plug.backends.native.cast import cast_operand
from fp8plug.backends.native.scaling import E4M3, E5M2
from fp8plug.backends.padding import pad_tokens, token_count
from fp8plug.backends.region import fp8_now

ALIGNMENT = 16  # _scaled_mm's: both widths and the token count (padded) multiples of 16


def _cast(t: torch.Tensor, dtype: torch.dtype, source=None):
    """(t in FP8, the inverse scale): the native engine's dynamic per-tensor cast, row-major only
    (`source`: cast_operand's, an input other layers read too)."""
    t_fp8, _, inv, _ = cast_operand(t, dtype, False, None, None, 0, transposed=False, source=source)
    return t_fp8, inv


def _frozen_forward(x2: torch.Tensor, source, weight: torch.Tensor, weight_scale: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    x_fp8, x_inv = _cast(x2, E4M3, source)
    return scaled_mm(x_fp8, weight.t(), x_inv, weight_scale, out_dtype, use_fast_accum=True)


def _frozen_backward(grad_out: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     dgrad_dtype: torch.dtype) -> torch.Tensor:
    """grad_output @ W from the stored codes. _scaled_mm takes its second operand column-major, so
    the [out, in] codes are transposed here (1 byte per weight) and freed after the GEMM. Compiled,
    this runs inside an operator (`_frozen_op_backward`), so torch.compile cannot hoist the
    transposed copy into the forward and keep one per layer alive until backward (a weight-only
    value, cheap to save by its partitioner's measure: 0.2 GB a layer at 8B)."""
    g_fp8, g_inv = _cast(grad_out, E5M2)
    return scaled_mm(g_fp8, weight.t().contiguous().t(), g_inv, weight_scale, dgrad_dtype, use_fast_accum=False)


class _FrozenFP8Matmul(torch.autograd.Function):
    """y = x @ (fp8 * scale).T with the stored FP8 weight; backward: the input gradient only. Run
    eagerly (compiled: the operators below).

    Nothing is saved but the weight Parameter and its scale (references, no copies): the input
    needs no FP8 copy, since no weight gradient is computed."""

    @staticmethod
    def forward(ctx, x2, source, weight, weight_scale, out_dtype):
        ctx.save_for_backward(weight, weight_scale)
        ctx.dtypes = (x2.dtype, out_dtype)
        return _frozen_forward(x2, source, weight, weight_scale, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        weight, weight_scale = ctx.saved_tensors
        x_dtype, out_dtype = ctx.dtypes
        shared_input.forget()
        grad_x = _frozen_backward(grad_out, weight, weight_scale, writable_dtype(x_dtype, out_dtype))
        return grad_x.to(x_dtype), None, None, None, None


# Compiled: two operators (backends.native.compiled_ops says why: here, so that activation
# checkpointing recomputes the frozen GEMMs instead of keeping their outputs). The input's cast
# stays outside, traced, where the compiler fuses it into the norm before it and makes it once
# for q, k and v; x2 comes in only to carry the gradient (nothing of it is saved).
@torch.library.custom_op("fp8plug::frozen_fp8_linear", mutates_args=())
def _frozen_op(x2: torch.Tensor, x_fp8: torch.Tensor, x_inv: torch.Tensor, weight: torch.Tensor,
               weight_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return scaled_mm(x_fp8, weight.t(), x_inv, weight_scale, out_dtype, use_fast_accum=True)


@_frozen_op.register_fake
def _(x2, x_fp8, x_inv, weight, weight_scale, out_dtype):
    return x2.new_empty((x2.shape[0], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("fp8plug::frozen_fp8_linear_backward", mutates_args=())
def _frozen_op_backward(grad_out: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        x_dtype: torch.dtype) -> torch.Tensor:
    return _frozen_backward(grad_out, weight, weight_scale, x_dtype).to(x_dtype)


@_frozen_op_backward.register_fake
def _(grad_out, weight, weight_scale, x_dtype):
    return grad_out.new_empty((grad_out.shape[0], weight.shape[1]), dtype=x_dtype)


def _frozen_op_setup(ctx, inputs, output):
    x2, _, _, weight, weight_scale, _ = inputs
    ctx.save_for_backward(weight, weight_scale)
    ctx.x_dtype = x2.dtype


def _frozen_op_autograd(ctx, grad_out):
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None
    weight, weight_scale = ctx.saved_tensors
    return _frozen_op_backward(grad_out.contiguous(), weight, weight_scale, ctx.x_dtype), None, None, None, None, None


_frozen_op.register_autograd(_frozen_op_autograd, setup_context=_frozen_op_setup)


class FrozenFP8Linear(nn.Linear):
    """A frozen nn.Linear whose weight is stored in float8_e4m3fn with one float32 scale
    (module docstring). Build it with `from_fp8(fp8, scale, bias, compute_dtype)`."""

    frozen_fp8 = True  # what fp8plug's loaders and exporters look for (no engine question)

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight = nn.Parameter(self.weight.detach().to(E4M3), requires_grad=False)
        self.register_buffer("weight_scale", torch.ones((), device=self.weight.device))
        self.compute_dtype = dtype or torch.get_default_dtype()
        fused_cast.load()  # the eager CUDA cast of the input, built here: never inside torch.compile

    @classmethod
    def from_fp8(cls, fp8: torch.Tensor, scale: torch.Tensor, bias=None, compute_dtype=torch.bfloat16,
                 name: str = "FrozenFP8Linear") -> "FrozenFP8Linear":
        """A layer holding `fp8` ([out, in] float8_e4m3fn) and `scale` (a float32 scalar multiplier)
        as they are (no copy where they already have those dtypes), with `bias` (high precision)."""
        if fp8.dtype != E4M3 or fp8.dim() != 2:
            raise ValueError(f"{name}: expected a 2-d float8_e4m3fn weight, got {fp8.dtype} of shape "
                             f"{tuple(fp8.shape)}")
        if scale.numel() != 1:
            raise ValueError(f"{name}: expected one per-tensor scale, got shape {tuple(scale.shape)} "
                             "(block scales are requantized to one scale per tensor by fp8plug.load_fp8_base)")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.out_features, new.in_features = fp8.shape
        new.weight = nn.Parameter(fp8, requires_grad=False)
        new.bias = None if bias is None else nn.Parameter(bias.to(compute_dtype), requires_grad=False)
        new.register_buffer("weight_scale", scale.detach().reshape(()).to(device=fp8.device, dtype=torch.float32))
        new.compute_dtype = compute_dtype
        fused_cast.load()
        return new

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in `dtype` (fp8 x scale, in float32 first): a transient copy of this layer's
        weight only."""
        return (self.weight.float() * self.weight_scale).to(dtype)

    def runs_fp8(self, x: torch.Tensor) -> bool:
        """Whether a call on `x` runs its GEMMs in FP8 (the native engine's GEMM counter asks)."""
        return (fp8_now(self.training) and token_count(x) > 0 and not self.in_features % ALIGNMENT
                and not self.out_features % ALIGNMENT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad:
            raise RuntimeError(
                "FrozenFP8Linear: its FP8 weight was set to require a gradient, but an FP8 base layer is frozen (no "
                "high-precision master copy to update). For full fine-tuning load the checkpoint with "
                "fp8plug.load_fp8_base(path, trainable=True), which gives ordinary Linears in high precision.")
        out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        if not self.runs_fp8(x):
            weight = self.dequantized_weight(out_dtype)
            bias = None if self.bias is None else self.bias.to(out_dtype)
            return F.linear(x.to(out_dtype), weight, bias)
        return pad_tokens(lambda rows: self._fp8_forward(rows, out_dtype), x, ALIGNMENT)

    def _fp8_forward(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if compiled_ops.compiling():
            x_fp8, x_inv = _cast(x2, E4M3)
            out = _frozen_op(x2, x_fp8, x_inv, self.weight, self.weight_scale, out_dtype)
        else:
            out = _FrozenFP8Matmul.apply(x2, x, self.weight, self.weight_scale, out_dtype)
        if self.bias is not None:
            out = out + self.bias.to(out_dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):
        """Moves keep the FP8 codes and the float32 scale: a dtype cast of the model
        (`model.to(torch.bfloat16)`, `.half()`) would otherwise turn the 1-byte weight into a
        high-precision one. The round trip through the cast is exact (every E4M3 value is a
        float16, bfloat16 and float32 value) and one layer at a time."""
        super()._apply(fn, recurse)
        if self.weight.dtype != E4M3:
            self.weight.data = self.weight.data.to(E4M3)
        if self.weight_scale.dtype != torch.float32:
            self._buffers["weight_scale"] = self.weight_scale.float()
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        weight = state_dict.get(prefix + "weight")
        if weight is not None and weight.dtype != E4M3:
            error_msgs.append(
                f"{prefix}weight: a FrozenFP8Linear takes float8_e4m3fn codes with their {prefix}weight_scale, got "
                f"{weight.dtype}; load an FP8 checkpoint with fp8plug.load_fp8_base, or quantize with "
                "fp8plug.checkpoints.export_formats.quantize_per_tensor.")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight=float8_e4m3fn (frozen, per-tensor scale)"
