"""The `native` engine: fp8plug's own FP8 Linear, needing nothing but torch.

Per-tensor scaling, dynamic (scale from the tensor's own amax) or delayed with TransformerEngine's
DelayedScaling semantics: an amax history per tensor (input, weight, grad_output), reduced by
"max" or "most_recent", scale = fp8_max / amax / 2**margin, recomputed every `interval` steps.
The three GEMMs (fprop, dgrad, wgrad) go through `torch._scaled_mm`, on CUDA sm_89+ and on the
CPU; forward saves the FP8 copies of input and weight for backward instead of the high-precision
ones. Scaling state lives in non-persistent buffers, so the state dict keeps the plain Linear's
keys. All of it is branch-free tensor code, so it compiles with fullgraph=True.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..convert import ConversionReport, linear_alignment_problem, plan_conversion, swap_modules
from .base import Backend, Probe

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
ALIGN = 16


class _Region:
    """Whether an FP8 autocast region is open: None outside any region (modules then follow
    their own training flag), True or False inside one."""

    enabled: Optional[bool] = None


def fp8_region_enabled() -> Optional[bool]:
    return _Region.enabled


class native_fp8_autocast:
    """Run native FP8 Linears in FP8 (enabled) or in high precision (disabled) inside the block.

    A plain class rather than a generator so torch.compile can trace it without a graph break."""

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)
        self.previous = None

    def __enter__(self):
        self.previous = _Region.enabled
        _Region.enabled = self.enabled
        return self

    def __exit__(self, *exc):
        _Region.enabled = self.previous
        return False


# --- scaling ---------------------------------------------------------------------------------------


def amax_of(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a float32 scalar. Reduced row by row first: a row reduction walks the tensor the
    way the FP8 cast does, so the compiler can compute both in one read (delayed scaling)."""
    t = t.detach().abs()
    if t.dim() >= 2:
        t = t.amax(dim=-1)
    return t.amax().float()


def scale_from_amax(amax: torch.Tensor, fp8_max: float, margin: int = 0, fallback=None) -> torch.Tensor:
    """TransformerEngine's formula, scale = fp8_max / amax / 2**margin, keeping `fallback` (or 1)
    where amax is zero or not finite."""
    scale = fp8_max / amax / (2.0**margin)
    keep = fallback if fallback is not None else torch.ones_like(scale)
    return torch.where((amax > 0) & torch.isfinite(amax), scale, keep)


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scale, saturate to the format's range, and cast to FP8."""
    limit = FP8_MAX[dtype]
    return (t.float() * scale).clamp(-limit, limit).to(dtype)


def delayed_scale_update(
    history: torch.Tensor,
    scale: torch.Tensor,
    step: torch.Tensor,
    amax: torch.Tensor,
    fp8_max: float,
    margin: int,
    interval: int,
    algo: str,
    first: bool,
) -> torch.Tensor:
    """One delayed-scaling step for one tensor, in place; returns the scale to use now.

    On the first step (`first`, a Python flag the module keeps) the scale comes from the current
    amax, an amax-initialised start so the first step cannot overflow. On a later step that is a
    multiple of `interval`, the scale is recomputed from the history of past amaxes (its newest
    entry for "most_recent", its maximum for "max"); otherwise it is kept. Then the current amax
    enters the history, which rolls, dropping its oldest entry.

    After the first step the scale never depends on the current tensor, so the compiler can fuse
    the amax reduction into the cast: one read of the tensor instead of two. That is what delayed
    scaling is for, and why the first step is a Python flag rather than a tensor condition.
    """
    if first:
        new_scale = scale_from_amax(amax, fp8_max, margin)
    else:
        reduced = history[0] if algo == "most_recent" else history.amax(dim=0)
        recomputed = scale_from_amax(reduced, fp8_max, margin, fallback=scale)
        new_scale = torch.where(step % interval == 0, recomputed, scale)
    scale.copy_(new_scale)
    history.copy_(torch.cat([amax.reshape(1), history[:-1]]))
    step.add_(1)
    return new_scale


# --- the FP8 linear ------------------------------------------------------------------------------------


def _scaled_mm(a, b, scale_a, scale_b, out_dtype, fast_accum):
    return torch._scaled_mm(
        a, b, scale_a=scale_a.reciprocal(), scale_b=scale_b.reciprocal(), out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


class _FP8Linear(torch.autograd.Function):
    """y = x @ w.T with FP8 operands; backward GEMMs in FP8 too unless overridden."""

    @staticmethod
    def forward(ctx, x, weight, x_scale, w_scale, state, config):
        out_dtype, fwd_dtype, bwd_dtype, override, delayed, margin, interval, algo, first = config
        x_fp8 = quantize(x, x_scale, fwd_dtype)
        w_fp8 = quantize(weight, w_scale, fwd_dtype)
        if override[0]:
            out = F.linear(x.to(out_dtype), weight.to(out_dtype))
        else:
            out = _scaled_mm(x_fp8, w_fp8.t(), x_scale, w_scale, out_dtype, True)
        # Backward needs both operands with the token dimension (wgrad) or out_features (dgrad)
        # contiguous. Transposing here, right after the cast, lets the compiler write both layouts
        # from one read of the high-precision tensor; only the transposed copies are kept.
        x_t = x_fp8.t().contiguous()
        w_t = w_fp8.t().contiguous()
        if override[1] or override[2]:
            ctx.save_for_backward(x_t, w_t, x_scale, w_scale, x, weight, *state)
        else:
            ctx.save_for_backward(x_t, w_t, x_scale, w_scale, *state)
        ctx.config = config
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.high_precision = override[1] or override[2]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out_dtype, fwd_dtype, bwd_dtype, override, delayed, margin, interval, algo, first = ctx.config
        saved = ctx.saved_tensors
        x_t, w_t, x_scale, w_scale = saved[:4]
        if ctx.high_precision:
            x_hp, w_hp = saved[4:6]
            state = saved[6:]
        else:
            state = saved[4:]
        g_amax = amax_of(grad_out)
        fp8_max = FP8_MAX[bwd_dtype]
        if delayed:
            history, scale, step = state
            g_scale = delayed_scale_update(history, scale, step, g_amax, fp8_max, margin, interval, algo, first)
        else:
            g_scale = scale_from_amax(g_amax, fp8_max)
        g_fp8 = quantize(grad_out, g_scale, bwd_dtype)
        x_dtype, w_dtype = ctx.dtypes
        if override[1]:
            grad_x = grad_out.to(out_dtype) @ w_hp.to(out_dtype)
        else:
            grad_x = _scaled_mm(g_fp8, w_t.t(), g_scale, w_scale, out_dtype, False)
        if override[2]:
            grad_w = grad_out.to(out_dtype).t() @ x_hp.to(out_dtype)
        else:
            grad_w = _scaled_mm(g_fp8.t().contiguous(), x_t.t(), g_scale, x_scale, out_dtype, False)
        return grad_x.to(x_dtype), grad_w.to(w_dtype), None, None, None, None


class NativeFP8Linear(nn.Linear):
    """An nn.Linear whose GEMMs run in FP8 with per-tensor scaling.

    It keeps nn.Linear's parameters (the very same Parameter objects when converted, so optimizers
    stay valid) and state-dict keys. FP8 runs in training mode, or as an enclosing
    `native_fp8_autocast` says; otherwise, and for inputs an FP8 GEMM cannot take (token count or
    features not divisible by 16), the layer runs in high precision.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, scaling="delayed",
                 fp8_format="HYBRID", margin=0, interval=1, amax_history_len=1024,
                 amax_compute_algo="most_recent", override_linear_precision=(False, False, False)):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_fp8(scaling, fp8_format, margin, interval, amax_history_len, amax_compute_algo,
                        override_linear_precision)

    def _setup_fp8(self, scaling, fp8_format, margin, interval, amax_history_len, amax_compute_algo,
                   override_linear_precision):
        # One mode for all three tensors, or a (input, weight, grad_output) tuple of modes.
        modes = (scaling,) * 3 if isinstance(scaling, str) else tuple(scaling)
        if len(modes) != 3 or any(mode not in ("delayed", "dynamic") for mode in modes):
            raise ValueError(
                f"NativeFP8Linear: scaling {scaling!r} is not 'delayed' or 'dynamic', nor a tuple of "
                "three of them (input, weight, grad_output)."
            )
        self.scaling = scaling if isinstance(scaling, str) else modes
        self.scaling_modes = modes
        self.fp8_format = fp8_format
        self.fwd_dtype = E4M3
        self.bwd_dtype = E5M2 if fp8_format == "HYBRID" else E4M3
        self.margin = int(margin)
        self.interval = int(interval)
        self.amax_compute_algo = amax_compute_algo
        self.override_linear_precision = tuple(override_linear_precision)
        device = self.weight.device
        length = int(amax_history_len) if "delayed" in modes else 1
        # Non-persistent: the model's state dict stays the plain Linear's. fp8plug's checkpoint
        # helpers carry these separately (save_state) so a resumed run continues identically.
        self.register_buffer("fp8_amax_history", torch.zeros(length, 3, device=device), persistent=False)
        self.register_buffer("fp8_scale", torch.ones(3, device=device), persistent=False)
        self.register_buffer("fp8_step", torch.zeros(3, dtype=torch.int64, device=device), persistent=False)
        # Whether an FP8 step has run: a Python flag so the compiled steady state has no
        # first-step branch (one recompile after the first step). load_fp8_state restores it.
        self.fp8_started = False

    def _apply(self, fn, recurse=True):
        """Keep the scaling state in float32 when the module is cast (`.to(torch.bfloat16)`):
        scales and amaxes must not be rounded, and `_scaled_mm` takes float32 scales only."""
        kept = {name: self._buffers[name] for name in ("fp8_amax_history", "fp8_scale")}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != torch.float32:
                self._buffers[name] = before.to(device=after.device)
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, **fp8_options) -> "NativeFP8Linear":
        """Wrap an existing nn.Linear, sharing its Parameter objects."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        new._setup_fp8(**fp8_options)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear sharing this layer's Parameter objects."""
        plain = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(plain)
        plain.in_features, plain.out_features = self.in_features, self.out_features
        plain.weight, plain.bias = self.weight, self.bias
        plain.train(self.training)
        return plain

    def fp8_active(self) -> bool:
        region = _Region.enabled
        return self.training if region is None else region

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not self.fp8_active() or rows % ALIGN or rows == 0 or x.shape[-1] % ALIGN or self.out_features % ALIGN:
            return super().forward(x)
        x2 = x.reshape(-1, x.shape[-1])
        out_dtype = self._out_dtype(x)
        first = not self.fp8_started
        x_amax = amax_of(x2)
        w_amax = amax_of(self.weight)
        x_scale = self._scale(INPUT, x_amax, self.fwd_dtype, first)
        w_scale = self._scale(WEIGHT, w_amax, self.fwd_dtype, first)
        grad_delayed = self.scaling_modes[GRAD_OUTPUT] == "delayed"
        if grad_delayed:
            state = (self.fp8_amax_history[:, GRAD_OUTPUT], self.fp8_scale[GRAD_OUTPUT], self.fp8_step[GRAD_OUTPUT])
        else:
            state = ()
        config = (out_dtype, self.fwd_dtype, self.bwd_dtype, self.override_linear_precision,
                  grad_delayed, self.margin, self.interval, self.amax_compute_algo, first)
        out = _FP8Linear.apply(x2, self.weight, x_scale, w_scale, state, config)
        if first:
            self.fp8_started = True
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _scale(self, slot: int, amax: torch.Tensor, dtype: torch.dtype, first: bool) -> torch.Tensor:
        """The scale for tensor `slot` (INPUT or WEIGHT) now, by that tensor's scaling mode."""
        if self.scaling_modes[slot] == "delayed":
            with torch.no_grad():
                return delayed_scale_update(
                    self.fp8_amax_history[:, slot], self.fp8_scale[slot], self.fp8_step[slot], amax,
                    FP8_MAX[dtype], self.margin, self.interval, self.amax_compute_algo, first,
                )
        return scale_from_amax(amax, FP8_MAX[dtype])

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, scaling={self.scaling}, format={self.fp8_format}, "
                f"history={self.fp8_amax_history.shape[0]}")


# --- the engine --------------------------------------------------------------------------------------


class NativeBackend(Backend):
    """fp8plug's own engine: always importable, runs on the CPU and on CUDA sm_89+."""

    name = "native"
    title = "fp8plug native (torch._scaled_mm)"
    install_hint = "pip install fp8plug  (needs only torch >= 2.5)"
    runs_on_cpu = True
    scalings = ("delayed", "dynamic")

    def probe(self) -> Probe:
        if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
            return Probe(False, reason=f"torch {torch.__version__} has no torch._scaled_mm / float8 dtypes")
        return Probe(True, version=f"torch {torch.__version__}")

    def options(self, recipe) -> dict:
        return dict(
            scaling=self.scaling_name(recipe), fp8_format=recipe.fp8_format, margin=recipe.margin,
            interval=recipe.interval, amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo,
            override_linear_precision=recipe.override_linear_precision,
        )

    def convert(self, model: nn.Module, recipe) -> ConversionReport:
        options = self.options(recipe)
        targets, report = plan_conversion(
            model, self.name, {nn.Linear: linear_alignment_problem}, self.is_converted,
            recipe.modules_to_ignore, recipe.module_filter_fn,
        )
        return swap_modules(model, targets, lambda m: NativeFP8Linear.from_linear(m, **options), report)

    def unconvert(self, model: nn.Module) -> nn.Module:
        from ..convert import replace_module

        for fqn, module in list(model.named_modules()):
            if isinstance(module, NativeFP8Linear):
                replace_module(model, fqn, module.to_linear())
        return model

    def is_converted(self, module: nn.Module) -> bool:
        return isinstance(module, NativeFP8Linear)

    def autocast(self, recipe, enabled: bool = True):
        return native_fp8_autocast(enabled)

    _STATE_BUFFERS = ("fp8_amax_history", "fp8_scale", "fp8_step")

    def fp8_state(self, model: nn.Module) -> dict:
        """Each NativeFP8Linear's scaling buffers (non-persistent, so not in the state dict), on CPU."""
        return {
            fqn: {name: getattr(module, name).detach().cpu().clone() for name in self._STATE_BUFFERS}
            for fqn, module in model.named_modules()
            if isinstance(module, NativeFP8Linear)
        }

    def load_fp8_state(self, model: nn.Module, state: dict) -> None:
        modules = {fqn: m for fqn, m in model.named_modules() if isinstance(m, NativeFP8Linear)}
        if set(modules) != set(state):
            raise ValueError(
                "native FP8 state: the checkpoint's converted modules "
                f"{sorted(set(state) - set(modules))} are not in this model and this model's "
                f"{sorted(set(modules) - set(state))} are not in the checkpoint; convert the model "
                "with the same recipe (modules_to_ignore, module_filter_fn) as when it was saved."
            )
        for fqn, buffers in state.items():
            for name in self._STATE_BUFFERS:
                target, saved = getattr(modules[fqn], name), buffers[name]
                if target.shape != saved.shape:
                    raise ValueError(
                        f"native FP8 state: {fqn}.{name} has shape {tuple(saved.shape)} in the checkpoint "
                        f"but {tuple(target.shape)} here; use the same amax_history_len and scaling "
                        "as when it was saved."
                    )
                target.copy_(saved)
            modules[fqn].fp8_started = bool(modules[fqn].fp8_step.max() > 0)
