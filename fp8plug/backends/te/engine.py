"""The `te` engine: NVIDIA TransformerEngine 2.x (`transformer_engine.pytorch`).

Swaps nn.Linear, nn.LayerNorm and nn.RMSNorm for TE's modules under fp8plug's shared rules, the
new modules holding the very same Parameter objects; builds TE's recipe object from the engine's
plan; keeps checkpoints plain (TE's `_extra_state` dropped, and supplied on load) and saves the
delayed-scaling state as plain tensors. TransformerEngine is imported only when this engine is
asked for or chosen. Its helpers: te/recipes.py (recipe planning), te/imports.py (TE's import and
API names, cuDNN sharing; FP8 attention's way in too) and te/layers.py (TELinear). See docs/te.md.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from torch import nn

from fp8plug.backends.base import Engine, Probe, probe_import
from fp8plug.backends.te.imports import TE_MODULE, TEApi, import_te, share_torch_cudnn, te_version
from fp8plug.backends.te.layers import (
    accept_plain_state_dict,
    drop_extra_state,
    gemm_alignment,
    load_plain_state_dict,
    microbatch,
    te_linear_class,
    te_module_types,
)
from fp8plug.backends.te.recipes import (
    RECIPE_CLASSES,
    IntervalScaling,
    TERecipeSpec,
    recipe_kind,
    scaling_hardware_problem,
    te_recipe_spec,
    warn_once,
)
from fp8plug.layers.rules import (
    ALIGNMENT,
    ConversionReport,
    Eligibility,
    linear_alignment_problem,
    plain_linear,
    planned_modules,
    replace_module,
    swap_modules,
)
from fp8plug.recipe.plans import DelayedScalingPlan, Settings, ignored_message
from fp8plug.recipe.scalings import DELAYED_FIELDS, delayed_values
from fp8plug.tuning.hardware import DeviceInfo

TE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the recipe fields that go into a TE recipe object (delayed scaling reads them all)
SCALING_FIELDS = frozenset({"fp8_format", *DELAYED_FIELDS})


@dataclass(frozen=True, kw_only=True)
class TEPlan(DelayedScalingPlan):
    """What the TE recipe object is built from (besides the shared Plan): the fields TE honours
    under the plan's scaling (the others keep FP8RecipeKwargs' defaults and are not used);
    fp8_format None keeps the TE recipe's own. `given`: a TE recipe object passed as it is
    (contextual_fp8_autocast), used instead of building one."""

    fp8_format: Optional[str] = None
    given: Any = field(default=None, compare=False)

    def recipe_key(self) -> tuple:
        """What the TE recipe object depends on: plans equal in it share one object."""
        return (self.scaling, self.fp8_format, tuple(self.override_linear_precision),
                *delayed_values(self).values())


def __getattr__(name):
    # `fp8plug.backends.te.engine.TELinear` resolves (e.g. for unpickling) once TE imports.
    if name == "TELinear":
        return te_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- the engine -------------------------------------------------------------------------------------------


def _share_parameters(new: nn.Module, old: nn.Module, names) -> None:
    for name in names:
        setattr(new, name, getattr(old, name))


def _build_kwargs(module: nn.Module) -> dict:
    return {"device": module.weight.device}


@contextlib.contextmanager
def _keep_rng(device: torch.device):
    """Building a TE module initialises weights we then replace; keep the RNG streams untouched
    so a converted run draws the same random numbers as an unconverted one."""
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        yield


class TEEngine(Engine):
    """NVIDIA TransformerEngine. See docs/te.md for behaviour and quirks.

    Gradient accumulation: wrap each micro-batch's forward in `engine.microbatch(is_first)`
    (True for the first micro-batch after an optimizer step, False for the rest) so TE quantizes
    each weight once per step; outside it TE quantizes on every forward, which is always correct.
    """

    name = "te"
    title = "TransformerEngine"
    install_hint = 'pip install --no-build-isolation "transformer_engine[pytorch]"'
    scalings = ("delayed", "current", "block", "mxfp8", "nvfp4")
    honours = frozenset({"override_linear_precision", "use_autocast_during_eval"})
    honours_by_scaling = {
        "delayed": SCALING_FIELDS,
        "current": frozenset({"fp8_format"}),
        "block": frozenset({"fp8_format"}),
        "mxfp8": frozenset({"fp8_format", "margin"}),
        "nvfp4": frozenset(),  # E2M1 values with E4M3 block scales, whatever the format
    }
    plan_class = TEPlan

    def __init__(self):
        self._recipes: Dict[Any, Any] = {}

    # availability -------------------------------------------------------------------------------
    def probe(self) -> Probe:
        share_torch_cudnn()
        return probe_import(TE_MODULE, lambda m: __import__("transformer_engine").__version__)

    def supports(self, device):
        ok, why = super().supports(device)
        if not ok or device.type != "cuda" or not torch.cuda.is_available():
            return ok, why
        try:
            check = getattr(import_te(), "is_fp8_available", None)
            if check is None:
                return True, ""
            result = check(return_reason=True)
        except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
            return False, f"TransformerEngine could not check FP8 support: {type(exc).__name__}: {exc}"
        available, reason = result if isinstance(result, tuple) else (bool(result), "")
        return (True, "") if available else (False, f"TransformerEngine says FP8 is unavailable: {reason}")

    def require(self):
        """transformer_engine.pytorch, or BackendUnavailableError saying why not and how to install it."""
        if TE_MODULE in sys.modules:
            return sys.modules[TE_MODULE]
        super().require()
        return import_te()

    # recipes --------------------------------------------------------------------------------------
    def recipe_fields(self) -> Dict[str, frozenset]:
        """The installed TE's recipe classes and their dataclass fields."""
        import dataclasses

        module = importlib.import_module("transformer_engine.common.recipe")
        out = {}
        for class_name in RECIPE_CLASSES.values():
            cls = getattr(module, class_name, None)
            if cls is not None and dataclasses.is_dataclass(cls):
                out[class_name] = frozenset(f.name for f in dataclasses.fields(cls))
        return out

    def check_hardware(self, scaling: str, device: DeviceInfo) -> None:
        """Refuse a scaling `device` (or TE on it) cannot run, with a clear message."""
        if device.type != "cuda":
            return
        problem = scaling_hardware_problem(scaling, device.capability, device.cuda_version, device.name)
        if problem is None:
            te_check = {
                "block": "is_fp8_block_scaling_available", "mxfp8": "is_mxfp8_available", "nvfp4": "is_nvfp4_available",
            }.get(scaling, "is_fp8_available")
            check = getattr(self.require(), te_check, None)
            if check is not None:
                available, reason = check(return_reason=True)
                if not available:
                    problem = f"FP8RecipeKwargs.scaling={scaling!r} cannot run here: TransformerEngine says {reason}"
        if problem:
            raise ValueError(problem)

    def scaling_name(self, scaling) -> str:
        """TE's names, plus the words every engine shares: "blockwise" is TE's Float8BlockScaling
        ("block"); "rowwise" TE does not offer on Hopper (an error naming the engines that do)."""
        if scaling == "blockwise":
            return "block"
        if scaling in ("rowwise", "rowwise_with_gw_hp"):
            raise ValueError(
                f"FP8RecipeKwargs.scaling: {scaling!r} is not a TransformerEngine recipe (TE has no per-row FP8 "
                "scaling on Hopper; its finer ones are 'block' = 'blockwise', and 'mxfp8' on Blackwell); use "
                "backend='native' or 'ao' for rowwise, or backend=None to choose one that has it."
            )
        return super().scaling_name(scaling)

    def acts_as(self, name: str, scaling: str):
        if scaling == "nvfp4" and name == "fp8_format":
            return "E4M3"  # NVFP4's block scales are E4M3
        return super().acts_as(name, scaling)

    def why_ignored(self, name: str, scaling: str) -> str:
        if scaling == "nvfp4" and name == "fp8_format":
            return "NVFP4 stores E2M1 values with E4M3 block scales, whatever the format"
        return super().why_ignored(name, scaling)

    def make_plan(self, settings: Settings) -> TEPlan:
        """The fields TE honours under the scaling, after checking the device can run it. Block
        and MXFP8 scaling keep TE's own format unless fp8_format is passed as an argument."""
        s = settings
        self.check_hardware(s.scaling, s.device)
        honoured = self.honoured(s.scaling)
        values = {name: getattr(s, name) for name in honoured & SCALING_FIELDS}
        if "fp8_format" in values and s.scaling in ("block", "mxfp8"):
            values["fp8_format"] = s.argument("fp8_format")
        return TEPlan(override_linear_precision=s.override_linear_precision, **values)

    def te_recipe(self, plan=None):
        """The TE recipe object for a plan (or a recipe, made into one; or a given TE recipe's own),
        built once per distinct setting and device so TE sees the same object every step."""
        plan = self.plan_of(plan)
        if plan.given is not None:
            return plan.given
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        key = (plan.recipe_key(), device)
        built = self._recipes.get(key)
        if built is None:
            spec = te_recipe_spec(plan, self.recipe_fields(), te_version())
            for name, value, why in spec.notes:
                warn_once(ignored_message(self, name, value, plan.scaling, why))
            built = self._recipes[key] = self.build_recipe(spec)
        return built

    def build_recipe(self, spec: TERecipeSpec):
        module = importlib.import_module("transformer_engine.common.recipe")
        kwargs = spec.kwargs_dict()
        if "fp8_format" in kwargs:
            kwargs["fp8_format"] = module.Format[kwargs["fp8_format"]]
        if spec.interval > 1:
            kwargs["scaling_factor_compute_algo"] = IntervalScaling(spec.interval)
        return getattr(module, spec.class_name)(**kwargs)

    def engine_recipe(self, te_recipe) -> TEPlan:
        """Accept a TransformerEngine recipe object as is (contextual_fp8_autocast does this)."""
        base = getattr(importlib.import_module("transformer_engine.common.recipe"), "Recipe", None)
        if base is not None and not isinstance(te_recipe, base):
            raise TypeError(
                "fp8_recipe: give an fp8plug.FP8RecipeKwargs or a TransformerEngine recipe "
                f"(transformer_engine.common.recipe.DelayedScaling, ...), not {type(te_recipe).__name__}."
            )
        return TEPlan(given=te_recipe)

    # conversion -------------------------------------------------------------------------------------
    def eligibility(self, scaling: str, convert_linear: bool, convert_norm: bool) -> dict:
        """The shared rules' `eligible` map: module type -> why it cannot be converted (or None)."""
        feature_multiple = gemm_alignment(scaling)[1] if scaling in ("mxfp8", "nvfp4") else ALIGNMENT

        def dtype_problem(module):
            dtype = module.weight.dtype
            if dtype not in TE_DTYPES:
                return f"parameters are {dtype}; TransformerEngine takes float32, bfloat16 or float16"
            return None

        def linear(module):
            problem = linear_alignment_problem(module)
            if problem is None and feature_multiple != ALIGNMENT:
                features = (("in_features", module.in_features), ("out_features", module.out_features))
                bad = [f"{n}={v}" for n, v in features if v % feature_multiple]
                if bad:
                    problem = f"{' and '.join(bad)} not divisible by {feature_multiple} ({scaling} blocks)"
            return problem or dtype_problem(module)

        def layer_norm(module):
            if module.weight is None:
                return ("no affine weight (elementwise_affine=False): te.LayerNorm always has a learnable "
                        "weight and bias, so converting would add parameters")
            if module.bias is None:
                return "no bias (bias=False): te.LayerNorm always has a learnable bias, so converting would add one"
            return dtype_problem(module)

        def rms_norm(module):
            if module.weight is None:
                return ("no affine weight (elementwise_affine=False): te.RMSNorm always has a learnable "
                        "weight, so converting would add a parameter")
            return dtype_problem(module)

        eligible = {}
        if convert_linear:
            eligible[nn.Linear] = linear
        if convert_norm:
            eligible[nn.LayerNorm] = layer_norm
            if hasattr(nn, "RMSNorm"):
                eligible[nn.RMSNorm] = rms_norm
        return eligible

    def eligible(self, model: nn.Module, plan, linear: bool = True, norm: bool = True) -> Eligibility:
        """Linear (`linear`) and LayerNorm / RMSNorm (`norm`) modules TE can take, under the plan's
        filter (`eligibility`, for the scaling the plan runs)."""
        self.require()
        scaling = recipe_kind(plan.given) if plan.given is not None else plan.scaling
        return Eligibility(self.eligibility(scaling, linear, norm), module_filter_fn=plan.module_filter_fn)

    def convert_listed(self, model: nn.Module, plan, modules, report: ConversionReport) -> None:
        """Swap the listed Linear and LayerNorm / RMSNorm modules for TE's, in place, sharing their
        parameters. Builds the TE recipe first, so a recipe this TE cannot build fails before the
        model is touched."""
        te = self.require()
        if plan.given is None and torch.cuda.is_available():
            self.te_recipe(plan)  # refuse a recipe this TE cannot build, before touching the model
        listed = planned_modules(model, modules)
        linear = any(isinstance(module, nn.Linear) for _, module in listed)
        linear_cls = te_linear_class() if linear else None

        def build(module: nn.Module) -> nn.Module:
            with _keep_rng(module.weight.device):
                if isinstance(module, nn.Linear):
                    new = linear_cls(module.in_features, module.out_features, bias=module.bias is not None,
                                     params_dtype=module.weight.dtype, **_build_kwargs(module))
                    new.weight = module.weight
                    if module.bias is not None:
                        new.bias = module.bias
                elif isinstance(module, nn.LayerNorm):
                    new = te.LayerNorm(tuple(module.normalized_shape), eps=module.eps,
                                       dtype=module.weight.dtype, **_build_kwargs(module))
                    _share_parameters(new, module, ("weight", "bias"))
                else:
                    eps = module.eps if module.eps is not None else torch.finfo(module.weight.dtype).eps
                    new = te.RMSNorm(tuple(module.normalized_shape), eps=eps,
                                     dtype=module.weight.dtype, **_build_kwargs(module))
                    _share_parameters(new, module, ("weight",))
                    new._fp8plug_torch_eps = module.eps
            new.train(module.training)
            accept_plain_state_dict(new)
            return new

        swap_modules(model, [(decision.fqn, module) for decision, module in listed], build, report)

    def unconvert(self, model: nn.Module) -> nn.Module:
        """Swap TE Linear / LayerNorm / RMSNorm modules back for torch ones sharing their
        parameters. A TE module with no exact torch equivalent (split, parallel or
        zero-centred-gamma layouts) is left in place, with a warning."""
        te = sys.modules.get(TE_MODULE)
        if te is None:
            return model
        kinds = [(getattr(te, name, None), build) for name, build in (
            ("Linear", _plain_linear),
            ("LayerNorm", lambda m: _plain_norm(m, nn.LayerNorm)),
            ("RMSNorm", lambda m: _plain_norm(m, nn.RMSNorm)),
        )]
        kept = []
        for fqn, module in list(model.named_modules()):
            build = next((b for cls, b in kinds if isinstance(cls, type) and isinstance(module, cls)), None)
            if build is None:
                continue
            plain = build(module) if fqn else None  # the root cannot be swapped in place
            if plain is None:
                kept.append(fqn or "<root>")
            else:
                plain.train(module.training)
                replace_module(model, fqn, plain)
        if kept:
            warn_once(f"unconvert: left TransformerEngine module(s) {kept} in place: their layout has no exact "
                      "torch equivalent.")
        return model

    def is_converted(self, module: nn.Module) -> bool:
        types = te_module_types()
        return bool(types) and isinstance(module, types)

    def runs_fp8(self, module: nn.Module, input) -> bool:
        """Whether this TELinear call runs in FP8 (TE's autocast is on and the input can be padded)."""
        fp8_call = getattr(module, "fp8_call", None)
        return bool(fp8_call(input)) if fp8_call is not None else False

    def grouped_gemm(self, plan=None, device=None) -> str:
        """Why a transformers model's experts stay in high precision under te (docs/moe.md): TE's
        GroupedLinear holds one weight Parameter per expert (weight0 ... weight{E-1}) and takes
        split sizes on the host, while a transformers MoE block holds all its experts in one 3-D
        Parameter; using it would copy every expert weight each step (or replace the model's
        Parameters, which the optimizer and the checkpoint names hold)."""
        return ("TransformerEngine's GroupedLinear needs one weight Parameter per expert and cannot take the "
                "model's 3-D expert Parameters without copies; use the native engine for FP8 experts")

    # running ------------------------------------------------------------------------------------------
    def autocast(self, plan=None, enabled: bool = True):
        """TE's autocast for one forward: FP8 with the plan's TE recipe when enabled, high
        precision otherwise."""
        api = TEApi(self.require())
        if not enabled:
            try:
                te_recipe = self.te_recipe(plan)
            except ValueError:  # a recipe this GPU cannot run is irrelevant when FP8 is off
                te_recipe = None
            return api.autocast(enabled=False, recipe=te_recipe)
        return api.autocast(enabled=True, recipe=self.te_recipe(plan))

    def microbatch(self, is_first: Optional[bool]):
        return microbatch(is_first)

    # checkpoints ------------------------------------------------------------------------------------
    def plain_entries(self, state_dict):
        return drop_extra_state(state_dict)

    def load_plain_state_dict(self, model: nn.Module, state_dict, strict: bool = True):
        return load_plain_state_dict(model, state_dict, strict)

    def fp8_state(self, model: nn.Module) -> dict:
        """Each TE module's delayed-scaling state (scales and amax histories, forward and
        backward) as CPU tensors, by module name; modules with none (not run in FP8 yet, or a
        stateless recipe) are left out."""
        out = {}
        for fqn, module in model.named_modules():
            meta = getattr(module, "fp8_meta", None)
            if not isinstance(meta, dict) or not _delayed_state(meta):
                continue
            entry = {}
            for direction, key in (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd")):
                entry[f"scale_{direction}"] = meta[key].scale.detach().cpu().clone()
                entry[f"amax_history_{direction}"] = meta[key].amax_history.detach().cpu().clone()
            recipe = meta.get("recipe")
            entry["fp8_format"] = getattr(getattr(recipe, "fp8_format", None), "name", "HYBRID")
            out[fqn] = entry
        return out

    def load_fp8_state(self, model: nn.Module, state: dict) -> None:
        """Put `fp8_state`'s tensors back, initialising a module's FP8 metadata first if it has not
        run in FP8 yet (so the very next forward uses the saved scales)."""
        recipe_module = None
        for fqn, entry in state.items():
            module = model.get_submodule(fqn) if fqn else model
            meta = getattr(module, "fp8_meta", None)
            if not isinstance(meta, dict):
                raise ValueError(
                    f"load_fp8_state: {fqn!r} is a {type(module).__name__}, not a TransformerEngine module; "
                    "load the FP8 state into a model converted the same way (backend='te')."
                )
            if not _delayed_state(meta):
                recipe_module = recipe_module or importlib.import_module("transformer_engine.common.recipe")
                placeholder = recipe_module.DelayedScaling(
                    fp8_format=recipe_module.Format[entry.get("fp8_format", "HYBRID")],
                    amax_history_len=entry["amax_history_fwd"].shape[0],
                )
                meta.setdefault("num_gemms", 1)
                module.init_fp8_meta_tensors(placeholder)
            with torch.no_grad():
                for direction, key in (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd")):
                    for name in ("scale", "amax_history"):
                        target = getattr(meta[key], name)
                        saved = entry[f"{name}_{direction}"]
                        if target.shape != saved.shape:
                            raise ValueError(
                                f"load_fp8_state: {fqn} {name} ({direction}) has shape {tuple(target.shape)} but "
                                f"the saved state has {tuple(saved.shape)}; use the same amax_history_len."
                            )
                        target.copy_(saved)


def _delayed_state(meta: dict) -> bool:
    """Whether a TE module's fp8_meta holds delayed-scaling tensors (scale and amax history)."""
    for key in ("scaling_fwd", "scaling_bwd"):
        state = meta.get(key)
        if not all(isinstance(getattr(state, name, None), torch.Tensor) for name in ("scale", "amax_history")):
            return False
    return True


def _plain_linear(module) -> Optional[nn.Linear]:
    """The plain nn.Linear for a te.Linear, or None for layouts torch has no Linear for. A
    te.Linear(bias=False) holds an empty tensor as `bias`; the plain one gets None."""
    if (getattr(module, "weight_names", ["weight"]) != ["weight"] or getattr(module, "return_bias", False)
            or getattr(module, "parallel_mode", None) is not None or getattr(module, "tp_size", 1) != 1):
        return None
    return plain_linear(module, module.weight, module.bias if getattr(module, "use_bias", True) else None)


def _plain_norm(module, cls) -> Optional[nn.Module]:
    if getattr(module, "zero_centered_gamma", False):
        return None
    shape = tuple(module.weight.shape)
    if cls is nn.RMSNorm:
        eps = getattr(module, "_fp8plug_torch_eps", module.eps)
        plain = nn.RMSNorm(shape, eps=eps, device="meta", dtype=module.weight.dtype)
        plain.weight = module.weight
    else:
        plain = nn.LayerNorm(shape, eps=module.eps, device="meta", dtype=module.weight.dtype)
        plain.weight, plain.bias = module.weight, module.bias
    return plain
