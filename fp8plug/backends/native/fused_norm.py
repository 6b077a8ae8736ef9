"""The Llama family's RMSNorm in one Triton kernel each way, eagerly on CUDA, handing the amax of
its output to the FP8 cast that follows it.

Eagerly, transformers' LlamaRMSNorm is a dozen kernels each way over the residual stream, and the
cast of its output reads it again for the amax; compiled, inductor fuses all that itself. The
arithmetic is the module's own (float32 math, the same roundings); sums are reduced in another
order, so results agree to float32 rounding (tests/gpu/test_fused_norm.py). It takes over any
RMSNorm whose forward is LlamaRMSNorm's, line for line (docs/engines.md, "native").
"""

from __future__ import annotations

import inspect
from typing import Optional, Set

import torch
from torch import nn

from fp8plug.backends.native import fused_cast, shared_input, tensor_parallel

# Widest normalised dimension one program holds in registers (a row per program at a time).
MAX_WIDTH = 32768
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _reference_forward_source() -> Optional[str]:
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        return None
    return _forward_source(LlamaRMSNorm)


def _forward_source(cls: type) -> Optional[str]:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


_LLAMA_STYLE = {}  # class -> whether its forward is LlamaRMSNorm's


def llama_style_norms(model: nn.Module) -> Set[type]:
    """The classes of `model`'s modules whose forward is LlamaRMSNorm's exactly."""
    found = set()
    reference = None
    for module in model.modules():
        cls = type(module)
        if not cls.__name__.endswith("RMSNorm") or not cls.__module__.startswith("transformers."):
            continue
        if cls not in _LLAMA_STYLE:
            reference = reference or _reference_forward_source()
            _LLAMA_STYLE[cls] = reference is not None and _forward_source(cls) == reference
        if _LLAMA_STYLE[cls]:
            found.add(cls)
    return found


def norm_problem(module: nn.Module) -> Optional[str]:
    """Why a Llama-style RMSNorm is left as it is, or None if FusedRMSNorm can take it over."""
    if "forward" in vars(module):
        return "its forward is patched on the instance (Liger, accelerate hooks); left as patched"
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return "no 1-D weight Parameter"
    if tensor_parallel.is_distributed(weight):
        return "its weight is a DTensor (a tensor-parallel plan put it on a mesh); the fused kernel takes plain tensors"
    if not isinstance(getattr(module, "variance_epsilon", None), (int, float)):
        return "no numeric variance_epsilon"
    if set(dict(module.named_parameters(recurse=False))) != {"weight"} or list(module.buffers(recurse=False)):
        return "state beyond its weight, which the fused norm would not carry"
    return None


class FusedRMSNorm(nn.Module):
    """A Llama-style RMSNorm (see the module doc) whose eager CUDA forward and backward are one
    Triton kernel each, and which hands its output's amax to the FP8 cast of the layers reading
    it. It holds the converted module's very weight Parameter and the same state-dict key
    (`weight`); anywhere else it runs the original class's forward on itself."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self.weight = original.weight
        self.variance_epsilon = float(original.variance_epsilon)
        self.original_class = type(original)
        # its other plain attributes (a config's hidden size, transformers' init flags), for unfused()
        self.original_attributes = {k: v for k, v in vars(original).items()
                                    if not k.startswith("_") and k not in ("training", "variance_epsilon")}
        self.train(original.training)
        load()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not usable(hidden_states, self.weight):
            return self.original_class.forward(self, hidden_states)
        y, amax = _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)
        shared_input.remember_amax(y, amax)
        return y

    def unfused(self) -> nn.Module:
        """The original module class again, holding this weight."""
        plain = self.original_class.__new__(self.original_class)
        nn.Module.__init__(plain)
        vars(plain).update(self.original_attributes)
        plain.weight = self.weight
        plain.variance_epsilon = self.variance_epsilon
        plain.train(self.training)
        return plain

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused for {self.original_class.__name__}"


# --- the kernels ---------------------------------------------------------------------------------

_KERNELS = None  # (forward, backward) once built; False where they cannot be


def load() -> bool:
    """Build the kernels once per process where they can run (CUDA and Triton); whether they are
    there. Called when a norm is converted, never inside torch.compile."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _build() if fused_cast.triton_on_cuda() else False
    return bool(_KERNELS)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused norm runs on `x`: CUDA, the kernels built, no torch.compile tracing, float
    dtypes, and a normalised width that matches the weight and fits one program."""
    return (not torch.compiler.is_compiling() and bool(_KERNELS) and x.is_cuda and x.dim() >= 1
            and weight.device == x.device and weight.is_contiguous()
            and x.dtype in _FLOAT_DTYPES and weight.dtype in _FLOAT_DTYPES
            and x.shape[-1] == weight.numel() <= MAX_WIDTH and x.numel() > 0)


def _programs(rows: int, device: torch.device) -> int:
    """Programs a kernel launches: each walks rows a grid apart, so a few per SM keep it busy and
    the weight's partial sums (one row of them per program) stay small."""
    return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))


class _RMSNorm(torch.autograd.Function):
    """(the norm's output, max |output| as float32, inf where it holds a NaN)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        forward_kernel, _ = _KERNELS
        width = x.shape[-1]
        x2 = x.reshape(-1, width).contiguous()
        rows = x2.shape[0]
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
        y = torch.empty((rows, width), device=x.device, dtype=out_dtype)
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        amax = torch.zeros((), device=x.device, dtype=torch.float32)
        block = _block(width)
        with torch.cuda.device(x.device):  # Triton launches on the current device
            forward_kernel[(_programs(rows, x.device),)](x2, weight, y, rstd, amax, rows, width, eps, BLOCK=block,
                                                         num_warps=_warps(block))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        ctx.mark_non_differentiable(amax)
        return y.view(*x.shape[:-1], width), amax

    @staticmethod
    def backward(ctx, grad_y, _grad_amax):
        _, backward_kernel = _KERNELS
        x2, weight, rstd = ctx.saved_tensors
        rows, width = x2.shape
        grad_y = grad_y.reshape(rows, width).contiguous()
        grad_x = torch.empty_like(x2)
        want_dw = ctx.needs_input_grad[1]
        programs = _programs(rows, x2.device)
        partial = torch.empty((programs if want_dw else 1, width), device=x2.device, dtype=torch.float32)
        block = _block(width)
        with torch.cuda.device(x2.device):
            backward_kernel[(programs,)](x2, weight, rstd, grad_y, grad_x, partial, rows, width, BLOCK=block,
                                         WEIGHT_GRAD=want_dw, num_warps=_warps(block))
        grad_w = partial.sum(0).to(weight.dtype) if want_dw else None
        return grad_x.view(ctx.x_shape), grad_w, None


def _block(width: int) -> int:
    """The power of two (at least 16) one program's row of registers spans."""
    return 1 << max(4, (width - 1).bit_length())


def _warps(block: int) -> int:
    """Warps a program runs: more for wider rows, so no thread holds more than 64 values of one."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_forward(x_ptr, w_ptr, y_ptr, rstd_ptr, amax_ptr, rows, width, eps, BLOCK: tl.constexpr):
        """Each program: rows pid, pid + grid, ...; y = w * round_in((x * rstd)), rstd per row,
        and one atomic max of |y| (NaN as inf) for all its rows."""
        cols = tl.arange(0, BLOCK)
        inside = cols < width
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        running = tl.zeros((BLOCK,), dtype=tl.float32)
        for row in range(tl.program_id(0), rows, tl.num_programs(0)):
            offsets = tl.cast(row, tl.int64) * width + cols
            x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / width + eps)
            normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
            y = (w * normed).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + offsets, y, mask=inside)
            tl.store(rstd_ptr + row, rstd)
            a = tl.abs(y.to(tl.float32))
            running = tl.maximum(running, tl.where(a != a, float("inf"), a))
        tl.atomic_max(amax_ptr, tl.max(running, axis=0))

    @triton.jit
    def rms_norm_backward(x_ptr, w_ptr, rstd_ptr, gy_ptr, gx_ptr, partial_ptr, rows, width, BLOCK: tl.constexpr,
                          WEIGHT_GRAD: tl.constexpr):
        """grad_x per row, and this program's share of the weight gradient (sum over its rows of
        grad_y times the normalised value) into row pid of `partial`."""
        cols = tl.arange(0, BLOCK)
        inside = cols < width
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        for row in range(tl.program_id(0), rows, tl.num_programs(0)):
            offsets = tl.cast(row, tl.int64) * width + cols
            x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            g = tl.load(gy_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            normed = x * rstd
            if WEIGHT_GRAD:
                dw += g * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
            # d/d(normed): grad_y * w in the output's dtype, then in the input's (autograd's casts)
            gn = (g * w).to(gy_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty).to(tl.float32)
            gx = rstd * (gn - normed * (tl.sum(gn * normed, axis=0) / width))
            tl.store(gx_ptr + offsets, gx.to(gx_ptr.dtype.element_ty), mask=inside)
        if WEIGHT_GRAD:
            tl.store(partial_ptr + tl.program_id(0).to(tl.int64) * width + cols, dw, mask=inside)

    return rms_norm_forward, rms_norm_backward
