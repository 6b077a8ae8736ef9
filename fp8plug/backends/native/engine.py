"""The `native` engine: fp8plug's own FP8 Linear, needing nothing but torch.

Per-tensor scaling, dynamic or delayed with TransformerEngine's DelayedScaling semantics
(backends.native.scaling), or finer: per row or per tile and block (backends.native.granular);
the three GEMMs through `torch._scaled_mm` on CUDA sm_89+ and its exact emulation on the CPU
(backends.gemm); on tensor-parallel DTensor shards too (backends.native.tensor_parallel). Scaling
state lives in non-persistent buffers, so the state dict is the plain Linear's, and the forward is
branch-free tensor code that compiles with fullgraph=True. Eagerly on CUDA it also does what
torch.compile would: Llama-style RMSNorms fused (backends.native.fused_norm) and one cast per
shared input (backends.native.shared_input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fp8plug.backends.base import Engine, Probe
from fp8plug.backends.native import fsdp_fp8, fused_cast, fused_norm, granular, tensor_parallel, transposed_cast
from fp8plug.backends.native.cast import cast_operand as _cast  # the rule for one operand (the name tests patch)
from fp8plug.backends.native.fp8_matmul import GemmConfig, _FP8Linear
from fp8plug.backends.native.frozen_base import FrozenFP8Linear
from fp8plug.backends.native.scaling import E4M3, E5M2, FP8_MAX, NOT_RECORDED, DelayedSettings, record_amax
from fp8plug.backends.native.steps import (  # noqa: F401  (the end-of-step update)
    _TRACKED,
    sync_delayed_scaling,
    track_for_sync,
    untrack_for_sync,
)
from fp8plug.backends.padding import pad_tokens, token_count
from fp8plug.backends.region import fp8_now, fp8_region
from fp8plug.layers.rules import (
    ALIGNMENT,
    ConversionReport,
    Eligibility,
    ignore_in_ddp,
    linear_alignment_problem,
    local_features,
    local_shape,
    plain_linear,
    planned_modules,
    replace_module,
    swap_modules,
)
from fp8plug.recipe.kwargs import DEFAULTS
from fp8plug.recipe.layer_scaling import HIGH_PRECISION, bf16_filter, word_for
from fp8plug.recipe.plans import DelayedScalingPlan, Settings
from fp8plug.recipe.scalings import DELAYED_FIELDS, DelayedScaling, delayed_values

native_fp8_autocast = fp8_region  # the native engine's autocast: the shared FP8 region

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
# The scaling state of a NativeFP8Linear, all non-persistent buffers (the state dict stays the
# plain Linear's); fp8plug's checkpoint helpers carry them beside the weights.
STATE_BUFFERS = ("fp8_amax_history", "fp8_scale", "fp8_step", "fp8_amax_recorded")


# --- the FP8 linear ------------------------------------------------------------------------------------


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
        if self.delayed:
            track_for_sync(self, _direct_layers_engine())  # a layer built directly is synced like a converted model
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


# --- the engine --------------------------------------------------------------------------------------


_DIRECT = []  # the engine directly built layers are tracked under, made on first use


def _direct_layers_engine() -> "NativeEngine":
    if not _DIRECT:
        _DIRECT.append(NativeEngine())
    return _DIRECT[0]


@dataclass(frozen=True, kw_only=True)
class NativePlan(DelayedScalingPlan):
    """What NativeFP8Linear is built with (besides the shared Plan): the FP8 format, delayed
    scaling's settings (unused by dynamic scaling), which GEMMs stay in high precision, and
    whether amaxes are reduced across ranks. `tensor_scalings` ("delayed" or "dynamic" for input,
    weight, grad_output), where the recipe's `scaling` gave one mode per tensor, replaces the one
    `scaling` for all three. `fsdp_float8_all_gather`: FSDP2 all-gathers the converted weights in
    FP8 (backends.native.fsdp_fp8; FP8RecipeKwargs.enable_fsdp_float8_all_gather passed as an
    argument); off by default: FSDP2 then all-gathers them in their training dtype (bf16 under
    FSDP2's mixed precision) and each layer casts after the gather. Defaults: FP8RecipeKwargs'."""

    fp8_format: str = DEFAULTS["fp8_format"]
    tensor_scalings: Optional[Tuple[str, str, str]] = None
    fsdp_float8_all_gather: bool = False
    layer_scaling: Optional[Tuple[Tuple[str, str], ...]] = None  # (pattern, word): fp8plug.recipe.layer_scaling

    def describe_scaling(self) -> str:
        text = "/".join(self.tensor_scalings) if self.tensor_scalings else self.scaling
        return f"{text}, per layer {dict(self.layer_scaling)}" if self.layer_scaling else text

    def scaling_for(self, word: Optional[str] = None):
        """The scaling of a layer whose own scaling is `word` (layer_scaling's, where it names the
        layer; None: the plan's): a word, or a mode per tensor (tensor_scalings)."""
        return word or self.tensor_scalings or self.scaling or NativeEngine.scalings[0]

    def layer_options(self, word: Optional[str] = None) -> dict:
        """NativeFP8Linear's keyword options, for a layer whose own scaling is `word` (scaling_for)."""
        return dict(scaling=self.scaling_for(word), fp8_format=self.fp8_format,
                    override_linear_precision=self.override_linear_precision, **delayed_values(self))


class NativeEngine(Engine):
    """fp8plug's own engine: always importable, runs on the CPU and on CUDA sm_89+."""

    name = "native"
    title = "fp8plug native (torch._scaled_mm)"
    install_hint = "pip install fp8plug  (needs only torch >= 2.5)"
    runs_on_cpu = True
    scalings = ("delayed", "dynamic", *granular.GRANULAR)
    honours = frozenset({"override_linear_precision", "use_autocast_during_eval", "enable_fsdp_float8_all_gather",
                         "layer_scaling"})
    # dynamic scaling has no history, margin or interval; the finer ones are E4M3 throughout too
    honours_by_scaling = {"delayed": frozenset({"fp8_format", *DELAYED_FIELDS}), "dynamic": frozenset({"fp8_format"})}
    plan_class = NativePlan

    def probe(self) -> Probe:
        if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
            return Probe(False, reason=f"torch {torch.__version__} has no torch._scaled_mm / float8 dtypes")
        return Probe(True, version=f"torch {torch.__version__}")

    def scaling_name(self, scaling) -> str:
        """The scaling that decides which recipe fields apply: a mode per tensor (input, weight,
        grad_output; a recipe's `scaling` may be such a tuple, as fp8plug.integrations.float8's torchao-shaped
        configs give it) counts as delayed where any tensor is, else dynamic."""
        per_tensor = ("delayed", "dynamic")  # the finer scalings are one word for the whole layer
        if isinstance(scaling, tuple) and len(scaling) == 3 and all(mode in per_tensor for mode in scaling):
            return "delayed" if "delayed" in scaling else "dynamic"
        return super().scaling_name(scaling)

    def acts_as(self, name: str, scaling: str):
        if scaling in granular.GRANULAR and name == "fp8_format":
            return "E4M3"
        return super().acts_as(name, scaling)

    def why_ignored(self, name: str, scaling: str) -> str:
        if scaling in granular.GRANULAR and name == "fp8_format":
            return f"{scaling} scaling casts every operand to E4M3, gradients included (as torchao and DeepSeek-V3 do)"
        if scaling in granular.GRANULAR and name in DELAYED_FIELDS:
            return (f"{scaling} scaling is dynamic: every row or tile is scaled from its current values, so delayed "
                    "scaling's settings (margin, history, interval) do not apply; use scaling='delayed' for them")
        return super().why_ignored(name, scaling)

    def make_plan(self, settings: Settings) -> NativePlan:
        delayed = {name: getattr(settings, name) for name in self.honoured(settings.scaling) & set(DELAYED_FIELDS)}
        given = settings.values["scaling"]  # the recipe's own value: a tuple gives one mode per tensor
        rules = settings.layer_scaling
        # FSDP2's FP8 all-gather only where asked for as an argument: `accelerate launch` exports the
        # field as true by default (for torchao), and native's default stays the bf16 all-gather
        all_gather = bool(settings.argument("enable_fsdp_float8_all_gather"))
        for word in {settings.scaling, *(w for _, w in rules or ())} - {HIGH_PRECISION}:
            problem = granular.device_problem(word, settings.device)
            if problem:
                raise ValueError(f"FP8RecipeKwargs.scaling={word!r} cannot run here: {problem}.")
            if word not in self.scalings:
                raise ValueError(f"FP8RecipeKwargs.layer_scaling: {word!r} is not a {self.title} scaling; use one "
                                 f"of {', '.join(self.scalings)} or 'bf16'.")
            if all_gather and word in granular.GRANULAR:
                raise ValueError(f"FP8RecipeKwargs.enable_fsdp_float8_all_gather: gathers per-tensor FP8 weights, "
                                 f"while {word} scaling casts each weight from high precision; drop one of them.")
        fp8_format = settings.fp8_format if "fp8_format" in self.honoured(settings.scaling) else "E4M3"
        return NativePlan(fp8_format=fp8_format, override_linear_precision=settings.override_linear_precision,
                          tensor_scalings=tuple(given) if isinstance(given, tuple) else None,
                          fsdp_float8_all_gather=all_gather, layer_scaling=rules or None, **delayed)

    def eligible(self, model: nn.Module, plan, linear: bool = True, norm: bool = True) -> Eligibility:
        """Linear layers (`linear`), each under the scaling layer_scaling gives it (or bf16, kept out
        by the filter), and transformers' Llama-style RMSNorms (`norm`), whose fused kernels hand
        their output's amax to the cast of the layers reading them (backends.native.fused_norm)."""
        norms = tuple(fused_norm.llama_style_norms(model)) if norm else ()
        checks = dict.fromkeys(norms, fused_norm.norm_problem)
        if linear:
            names = {id(m): fqn for fqn, m in model.named_modules()}

            def linear_problem(m):
                scaling = plan.scaling_for(word_for(plan.layer_scaling, names.get(id(m), "")))
                return linear_alignment_problem(m) or (
                    granular.feature_problem(scaling, *local_features(m)) if isinstance(scaling, str) else None)
            checks[nn.Linear] = linear_problem
        return Eligibility(checks, unfiltered=norms, module_filter_fn=bf16_filter(plan.layer_scaling,
                                                                                  plan.module_filter_fn),
                           scaling_of=lambda fqn: word_for(plan.layer_scaling, fqn))

    def convert_listed(self, model: nn.Module, plan, modules, report: ConversionReport) -> None:
        """NativeFP8Linear for each listed Linear (its own scaling where layer_scaling names one),
        FusedRMSNorm for each listed norm; delayed scaling's state kept out of DDP's broadcasts,
        FSDP2's FP8 all-gather where the plan asks for it, and the model tracked for the end of
        every optimizer step."""
        listed = planned_modules(model, modules)
        words = {id(module): decision.scaling for decision, module in listed}
        swap_modules(model, [(decision.fqn, module) for decision, module in listed],
                     lambda m: NativeFP8Linear.from_linear(m, **plan.layer_options(words[id(m)]))
                     if isinstance(m, nn.Linear) else fused_norm.FusedRMSNorm(m), report)
        # Per-rank recorded amaxes must never be overwritten by DDP's broadcast of rank 0's buffers
        # (the scales are identical on every rank anyway once reduced).
        linears = set(report.linears)
        tensor_parallel.log_converted(sum(tensor_parallel.is_distributed(module.weight) for _, module in listed
                                          if isinstance(module, nn.Linear)))
        ignore_in_ddp(model, [f"{fqn}.{name}" for fqn in report.converted if fqn in linears for name in STATE_BUFFERS])
        if plan.fsdp_float8_all_gather:  # FSDP2, once it shards the model, all-gathers these weights in FP8
            layers = [m for m in model.modules() if isinstance(m, NativeFP8Linear)]
            for module in layers:
                fsdp_fp8.wrap_weight(module)
            fsdp_fp8.log_all_gather(len(layers))
        track_for_sync(model, self)

    def tensor_parallel_problem(self, plan) -> Optional[str]:
        """None: NativeFP8Linear runs colwise, rowwise and replicated DTensor layers
        (backends.native.tensor_parallel), under every scaling; except with FSDP2's FP8 all-gather,
        whose wrapped weight is a plain tensor's."""
        if self.plan_of(plan).fsdp_float8_all_gather:
            return ("FP8RecipeKwargs.enable_fsdp_float8_all_gather=True all-gathers plain weights in FP8, not "
                    "tensor-parallel DTensor shards; drop it (the bf16 all-gather then casts after the gather)")
        return None

    def unconvert(self, model: nn.Module) -> nn.Module:
        untrack_for_sync(model)  # no FP8 layers left to guard or to end steps for
        for fqn, module in list(model.named_modules()):
            if isinstance(module, NativeFP8Linear):
                replace_module(model, fqn, plain_linear(module, fsdp_fp8.unwrap_weight(module), module.bias))
            elif isinstance(module, fused_norm.FusedRMSNorm):
                replace_module(model, fqn, module.unfused())
            elif isinstance(module, FrozenFP8Linear):  # an FP8 base (load_fp8_base): dequantized, still frozen
                weight = nn.Parameter(module.dequantized_weight(module.compute_dtype), requires_grad=False)
                replace_module(model, fqn, plain_linear(module, weight, module.bias))
        return model

    def frozen_fp8_layer(self, fp8, scale, bias=None, compute_dtype=torch.bfloat16, name: str = "FrozenFP8Linear"):
        """A FrozenFP8Linear holding `fp8` and `scale` as they are (backends.native.frozen_base)."""
        return FrozenFP8Linear.from_fp8(fp8, scale, bias, compute_dtype, name=name)

    def is_converted(self, module: nn.Module) -> bool:
        return isinstance(module, (NativeFP8Linear, fused_norm.FusedRMSNorm, FrozenFP8Linear))

    def rescale_layer(self, model: nn.Module, fqn: str, scaling: str) -> nn.Module:
        """Move one converted Linear (`fqn`) to `scaling` (one of `scalings`) or to high precision
        ("bf16": a plain nn.Linear), between steps, keeping its Parameter objects (the optimizer
        stays valid). Its FP8 scaling state starts afresh (a finer scaling has none; delayed
        scaling scales from the current amax until its first update). A compiled model
        recompiles that layer's graph on its next call. Returns the module now at `fqn`. The
        caller records the decision where it must survive a restart (the recipe's layer_scaling
        converts a fresh model the same way)."""
        module = model.get_submodule(fqn)
        if not isinstance(module, NativeFP8Linear):
            raise ValueError(f"rescale_layer: {fqn!r} is a {type(module).__name__}, not a native FP8 Linear.")
        word = str(scaling).strip().lower()
        if word == HIGH_PRECISION:
            new = plain_linear(module, fsdp_fp8.unwrap_weight(module), module.bias)
            replace_module(model, fqn, new)
            return new
        if word not in self.scalings:
            raise ValueError(f"rescale_layer: {scaling!r} is not a native scaling; use one of "
                             f"{', '.join(self.scalings)} or 'bf16'.")
        problem = granular.feature_problem(word, module.in_features, module.out_features)
        if problem:
            raise ValueError(f"rescale_layer: {fqn!r} cannot run {word}: {problem}.")
        options = dict(override_linear_precision=module.override_linear_precision,
                       fp8_format=module.fp8_format, **delayed_values(module.delayed_scaling))
        module._setup_fp8(word, **options)
        untrack_for_sync(module)  # tracked with the model it is in, whose list of delayed layers is renewed
        track_for_sync(model, self)
        return module

    def autocast(self, plan=None, enabled: bool = True):
        return fp8_region(enabled)

    def runs_fp8(self, module: nn.Module, input) -> bool:
        return isinstance(input, torch.Tensor) and module.runs_fp8(input)

    def grouped_gemm(self, plan=None, device=None):
        """The grouped FP8 GEMM of a mixture-of-experts projection (backends.native.grouped: dynamic
        rowwise scaling, torch._scaled_grouped_mm on sm_90, exact emulation on the CPU), or why it
        cannot run on `device`."""
        from fp8plug.backends.native import grouped

        return grouped.grouped_gemm_problem(device) or grouped.grouped_fp8_linear

    def operand_scales(self, module: nn.Module) -> dict:
        """The scale each delayed slot casts with now (set at the end of the last step); None for a
        dynamic slot or one not updated yet, which scale from the current amax."""
        if not isinstance(module, NativeFP8Linear):
            return {}
        module.materialise_fp8_state()
        names = ("input", "weight", "grad_output")
        return {name: module.fp8_scale[slot].detach().clone()
                if module.delayed_slots[slot] and bool(module.fp8_step[slot] > 0) else None
                for slot, name in enumerate(names)}

    def end_step(self, models, group=None) -> None:
        """Delayed scaling's update: amaxes reduced across ranks, histories and scales updated; then,
        under FSDP2 with FP8 all-gather, the scales of the next all-gather (one all-reduce)."""
        sync_delayed_scaling(models, group=group)
        fsdp_fp8.precompute_weight_scales(list(models) or list(_TRACKED))

    def has_storageless_weights(self) -> bool:
        """Whether a weight was wrapped for FSDP2's FP8 all-gather (a wrapper subclass without
        storage of its own, backends.native.fsdp_fp8), which accelerate's FSDP2 preparation must
        look through."""
        return fsdp_fp8.wrapped_any()

    def fp8_state(self, model: nn.Module) -> dict:
        """Each NativeFP8Linear's scaling buffers (non-persistent, so not in the state dict), on CPU."""
        modules = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, NativeFP8Linear)]
        for _, module in modules:
            module.materialise_fp8_state()
        return {fqn: {name: getattr(module, name).detach().cpu().clone() for name in STATE_BUFFERS}
                for fqn, module in modules}

    def load_fp8_state(self, model: nn.Module, state: dict) -> None:
        modules = {fqn: m for fqn, m in model.named_modules() if isinstance(m, NativeFP8Linear)}
        if set(modules) != set(state):
            raise ValueError(
                "native FP8 state: the checkpoint's converted modules "
                f"{sorted(set(state) - set(modules))} are not in this model and this model's "
                f"{sorted(set(modules) - set(state))} are not in the checkpoint; convert the model "
                "with the same recipe (modules_to_ignore, module_filter_fn, fp8_output_head) as when it was saved."
            )
        for fqn, buffers in state.items():
            module = modules[fqn]
            module.materialise_fp8_state()
            for name in STATE_BUFFERS:
                target = getattr(module, name)
                saved = buffers.get(name)
                if saved is None and name == "fp8_amax_recorded":  # saved before fp8plug recorded amaxes
                    saved = torch.full_like(target, NOT_RECORDED)
                if saved is None or target.shape != saved.shape:
                    found = "is missing" if saved is None else f"has shape {tuple(saved.shape)}"
                    raise ValueError(
                        f"native FP8 state: {fqn}.{name} {found} in the checkpoint but has shape "
                        f"{tuple(target.shape)} here; use the same amax_history_len and scaling "
                        "as when it was saved."
                    )
                target.copy_(saved)
