"""The native engine's FP8 Linear: an nn.Linear whose three GEMMs run in FP8 with per-tensor
scaling (dynamic, or delayed with TransformerEngine's DelayedScaling semantics), or finer scaling
(backends.native.granular), needing nothing but torch.

A module of its own so that engine.py holds the engine (its plan, conversion and state) and this
file the layer it converts to: the casts (backends.native.cast), the GEMMs' autograd Function
(backends.native.fp8_matmul) and the scaling state's buffers meet here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fp8plug.backends import get_backend
from fp8plug.backends.native import fsdp_fp8, fused_cast, granular, tensor_parallel, transposed_cast
from fp8plug.backends.native.cast import cast_operand as _cast  # the rule for one operand (the name tests patch)
from fp8plug.backends.native.fp8_matmul import GemmConfig, _FP8Linear
from fp8plug.backends.native.scaling import E4M3, E5M2, FP8_MAX, NOT_RECORDED, DelayedSettings, record_amax
from fp8plug.backends.native.steps import track_for_sync
from fp8plug.backends.padding import pad_tokens, token_count
from fp8plug.backends.region import fp8_now
from fp8plug.layers.rules import ALIGNMENT, local_shape
from fp8plug.recipe.scalings import DelayedScaling, delayed_values

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
# The scaling state of a NativeFP8Linear, all non-persistent buffers (the state dict stays the
# plain Linear's); fp8plug's checkpoint helpers carry them beside the weights.
STATE_BUFFERS = ("fp8_amax_history", "fp8_scale", "fp8_step", "fp8_amax_recorded")


class NativeFP8Linear(nn.Linear):
    """An nn.Linear whose GEMMs run in FP8 with per-tensor scaling.

    It keeps nn.Linear's parameters (the very same Parameter objects when converted, so optimizers
    stay valid) and state-dict keys. FP8 runs in training mode, or as an enclosing
    `native_fp8_autocast` says; otherwise the layer runs in high precision. Any token count runs
    in FP8: the rows are zero-padded to the GEMM's alignment of 16 and the padding sliced off.
    Under tensor parallelism (a DTensor weight and input) the GEMMs run on this rank's shards and
    the output is the DTensor the plan expects (backends.native.tensor_parallel).

    Delayed scaling (fp8plug.backends.native.scaling): during a step the layer records amaxes and
    casts with the scales set at the end of the previous step; the end of every optimizer step
    (NativeEngine.end_step, through fp8plug.backends.steps) reduces the recorded amaxes across
    ranks and updates history and scales. Before a slot's first update it scales from the current
    amax, so the first step cannot overflow.
    Its settings are keyword arguments (`margin`, `interval`, `amax_history_len`, `amax_compute_algo`,
    `reduce_amax`: fp8plug.recipe.scalings.DelayedScaling's fields, with its defaults and checks), kept
    as `delayed_scaling` and as attributes of the same names.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, scaling="delayed",
                 fp8_format="HYBRID", override_linear_precision=(False, False, False), **delayed_scaling):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_fp8(scaling, fp8_format, override_linear_precision, **delayed_scaling)

    def _setup_fp8(self, scaling, fp8_format="HYBRID", override_linear_precision=(False, False, False),
                   **delayed_scaling):
        # One mode for all three tensors, or a (input, weight, grad_output) tuple of modes; a finer
        # granularity (backends.native.granular) scales every tensor from its current values.
        self.granular = scaling if isinstance(scaling, str) and scaling in granular.GRANULAR else None
        modes = ("dynamic",) * 3 if self.granular else (scaling,) * 3 if isinstance(scaling, str) else tuple(scaling)
        if len(modes) != 3 or any(mode not in ("delayed", "dynamic") for mode in modes):
            raise ValueError(
                f"NativeFP8Linear: scaling {scaling!r} is not 'delayed', 'dynamic', one of "
                f"{', '.join(granular.GRANULAR)}, nor a tuple of three of the first two (input, weight, grad_output)."
            )
        self.scaling = scaling if isinstance(scaling, str) else modes
        self.scaling_modes = modes
        self.delayed_slots = tuple(mode == "delayed" for mode in modes)  # (input, weight, grad_output)
        self.delayed = any(self.delayed_slots)
        self.fp8_format = fp8_format
        self.fwd_dtype = E4M3
        self.bwd_dtype = E5M2 if fp8_format == "HYBRID" else E4M3
        self.override_linear_precision = tuple(override_linear_precision)
        self.delayed_scaling = DelayedScaling(**delayed_scaling)
        for name, value in delayed_values(self.delayed_scaling).items():  # as attributes too: self.margin, ...
            setattr(self, name, value)
        self._fresh_fp8_state(self.amax_history_len if self.delayed else 1, self.weight.device)
        if self.delayed:  # a layer built directly is synced like a converted model, by the engine's end of step
            track_for_sync(self, get_backend("native"))
        fused_cast.load()  # the eager CUDA cast, built here: never inside torch.compile
        if self.granular:
            transposed_cast.load()  # likewise whether the transposed casts' kernels can run

    def _fresh_fp8_state(self, length: int, device) -> None:
        """(Re)make the scaling buffers as a new layer has them: no history, scale 1, no update
        yet, nothing recorded."""
        self.register_buffer("fp8_amax_history", torch.zeros(length, 3, device=device), persistent=False)
        self.register_buffer("fp8_scale", torch.ones(3, device=device), persistent=False)
        self.register_buffer("fp8_step", torch.zeros(3, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("fp8_amax_recorded", torch.full((3,), NOT_RECORDED, device=device), persistent=False)

    def materialise_fp8_state(self) -> None:
        """Give a layer converted on the meta device real scaling state once its weight is real.

        Large models are built on `meta`, converted, and only then given memory: `to_empty()`
        (handled in `_apply`) or weights assigned one by one (`load_state_dict(assign=True)`,
        accelerate's `init_empty_weights` + `set_module_tensor_to_device`, transformers'
        low-memory loading), which leaves these non-persistent buffers on `meta`. Called before
        anything reads the state (forward, the end-of-step update, fp8_state); a no-op otherwise,
        and a static check under torch.compile."""
        if self.fp8_scale.is_meta and not self.weight.is_meta:
            self._fresh_fp8_state(self.fp8_amax_history.shape[0], self.weight.device)

    def delayed_settings(self) -> DelayedSettings:
        fp8_max = (FP8_MAX[self.fwd_dtype], FP8_MAX[self.fwd_dtype], FP8_MAX[self.bwd_dtype])
        return DelayedSettings(fp8_max, self.delayed_scaling)

    def _apply(self, fn, recurse=True):
        """Keep the scaling state in float32 when the module is cast (`.to(torch.bfloat16)`):
        scales and amaxes must not be rounded, and `_scaled_mm` takes float32 scales only. State
        coming off the meta device (`to_empty()`) is whatever memory held: it starts afresh."""
        kept = {name: self._buffers[name] for name in ("fp8_amax_history", "fp8_scale", "fp8_amax_recorded")}
        was_meta = self.fp8_scale.is_meta
        super()._apply(fn, recurse)
        if was_meta and not self.fp8_scale.is_meta:
            self._fresh_fp8_state(self.fp8_amax_history.shape[0], self.fp8_scale.device)
            return self
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

    def fp8_active(self) -> bool:
        return fp8_now(self.training)

    def runs_fp8(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> bool:
        """Whether a call on `x` (with `weight`, this layer's by default) runs its GEMMs in FP8 (the
        test `forward` makes): in FP8's region, with tokens, and features aligned on this rank's
        shards where tensor parallelism splits them (backends.native.tensor_parallel)."""
        weight = self.weight if weight is None else weight
        return (self.fp8_active() and token_count(x) > 0 and not local_shape(x)[-1] % ALIGNMENT
                and not local_shape(weight)[0] % ALIGNMENT)

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.materialise_fp8_state()
        if tensor_parallel.is_distributed(self.weight, x):  # tensor parallelism: the GEMMs on this rank's shards
            return tensor_parallel.sharded_forward(self, x)
        return self.local_forward(x, self.weight, self.bias)

    def local_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The layer on plain tensors: x @ weight.T + bias, in FP8 where `runs_fp8` says so. `weight`
        and `bias` are the layer's own, or this rank's shards of them under tensor parallelism."""
        if not self.runs_fp8(x, weight):
            return F.linear(x, weight, bias)
        if self.granular:  # per-row or per-tile scales (backends.native.granular)
            out_dtype = self._out_dtype(x)
            forward = lambda rows: granular.granular_forward(self, rows, out_dtype, weight, bias)  # noqa: E731
            return pad_tokens(forward, x, granular.token_multiple(self.granular))
        # any token count: rows zero-padded to 16 and the padding sliced off (backends.padding)
        return pad_tokens(lambda rows: self._fp8_forward(rows, weight, bias), x, ALIGNMENT)

    def _fp8_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        # the input's transposed copy feeds only the weight gradient: none for a frozen weight
        wgrad = weight.requires_grad and torch.is_grad_enabled()
        *x_cast, x_amax = self._cast_operand(INPUT, x2, transposed=wgrad, source=x)
        *w_cast, w_amax = self._cast_operand(WEIGHT, weight)
        grad_record = None
        if self.delayed and self.training:  # only delayed tensors keep a history
            delayed = self.delayed_slots
            with torch.no_grad():
                if delayed[INPUT] and delayed[WEIGHT]:
                    record_amax(self.fp8_amax_recorded[:2], torch.stack([x_amax, w_amax]))
                elif delayed[INPUT] or delayed[WEIGHT]:
                    slot, amax = (INPUT, x_amax) if delayed[INPUT] else (WEIGHT, w_amax)
                    record_amax(self.fp8_amax_recorded[slot], amax)
            if delayed[GRAD_OUTPUT]:
                grad_record = self.fp8_amax_recorded[GRAD_OUTPUT:]
        grad_mode = self.scaling_modes[GRAD_OUTPUT]
        grad_scale = self.fp8_scale[GRAD_OUTPUT]
        if grad_mode == "delayed":  # 0 until the slot's first update: backward then uses the current amax
            grad_scale = torch.where(self.fp8_step[GRAD_OUTPUT] > 0, grad_scale, torch.zeros_like(grad_scale))
        out_dtype = self._out_dtype(x)
        config = GemmConfig(out_dtype, self.bwd_dtype, self.override_linear_precision, grad_mode, self.margin)
        out = _FP8Linear.apply(x2, weight, tuple(x_cast), tuple(w_cast), grad_scale, grad_record, config)
        if bias is not None:
            out = out + bias.to(out_dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def _cast_operand(self, slot: int, t: torch.Tensor, transposed: bool = True, source=None):
        """(FP8, transposed FP8 or None, scale, amax) of forward operand `slot` (INPUT or WEIGHT):
        scaled by its own amax (dynamic, or delayed before the slot's first update), else by the
        scale set at the end of the last step. `source`: as _cast's."""
        delayed = self.delayed_slots[slot]
        gathered = fsdp_fp8.gathered_cast(t, transposed) if slot == WEIGHT else None
        if gathered is not None:  # all-gathered by FSDP2 in FP8 already (backends.native.fsdp_fp8)
            return gathered
        return _cast(t, self.fwd_dtype, delayed, self.fp8_scale[slot], self.fp8_step[slot] > 0 if delayed else None,
                     self.margin, transposed, source)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, scaling={self.scaling}, format={self.fp8_format}, "
                f"history={self.fp8_amax_history.shape[0]}")


__all__ = ["GRAD_OUTPUT", "INPUT", "STATE_BUFFERS", "WEIGHT", "NativeFP8Linear"]
