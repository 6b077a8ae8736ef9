"""The `native` engine: fp8plug's own FP8 Linear (backends.native.linear), needing nothing but torch.

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
from torch import nn

from fp8plug.backends.base import Engine, Probe
from fp8plug.backends.native import fsdp_fp8, fused_norm, granular, tensor_parallel
from fp8plug.backends.native.frozen_base import FrozenFP8Linear
from fp8plug.backends.native.linear import STATE_BUFFERS, NativeFP8Linear
from fp8plug.backends.native.scaling import NOT_RECORDED
from fp8plug.backends.native.steps import _TRACKED, sync_delayed_scaling, track_for_sync, untrack_for_sync
from fp8plug.backends.region import fp8_region
from fp8plug.layers.rules import (
    ConversionReport,
    Eligibility,
    ignore_in_ddp,
    linear_alignment_problem,
    local_features,
    plain_linear,
    planned_modules,
    replace_module,
    swap_modules,
)
from fp8plug.recipe.kwargs import DEFAULTS
from fp8plug.recipe.layer_scaling import HIGH_PRECISION, bf16_filter, word_for
from fp8plug.recipe.plans import DelayedScalingPlan, Settings
from fp8plug.recipe.scalings import DELAYED_FIELDS, delayed_values

native_fp8_autocast = fp8_region  # the native engine's autocast: the shared FP8 region


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
