"""The `msamp` engine: Microsoft MS-AMP, driven through `msamp.initialize(model, optimizer, opt_level)`.

MS-AMP is legacy: as released it does not install on a current stack (scripts/build_msamp_kit.sh
builds it for one). It converts model and optimizer together inside `msamp.initialize`, so
converting only marks each Linear fp8plug's rules leave alone with MS-AMP's own opt-out
(`use_fp32_linear`), and `prepare()` initializes. What differs from the other engines (eval in
FP8, DDP gradient sync, clipping, plain checkpoints, no "O3") is in docs/msamp.md. For FP8
optimizer states without MS-AMP see fp8plug.integrations.optim.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Tuple

import torch
from torch import nn

from fp8plug.backends.base import Engine, Probe, probe_import
from fp8plug.layers.rules import (
    ConversionReport,
    Eligibility,
    check_convertible,
    linear_alignment_problem,
    planned_modules,
    replace_module,
)
from fp8plug.recipe.engines import BACKENDS, listed
from fp8plug.recipe.kwargs import DEFAULTS, OPT_LEVELS
from fp8plug.recipe.plans import Plan, Settings
from fp8plug.tuning.hardware import DeviceInfo

OTHER_ENGINES = listed(name for name in BACKENDS if name != "msamp")  # what to use instead

CANNOT_INSTALL = (
    "MS-AMP as released does not install on current stacks: it is source-only, pins torch 2.1, "
    "TransformerEngine 1.1 and DeepSpeed 0.13.1, has been unmaintained upstream since 2024 and is "
    "deprecated by Accelerate. fp8plug's scripts/build_msamp_kit.sh builds it for torch 2.11 / CUDA 13 "
    f"(docs/msamp.md); otherwise use backend {OTHER_ENGINES} (with "
    "FP8RecipeKwargs.optimizer_states for low-precision optimizer states)"
)
SKIP_MARK = "use_fp32_linear"  # MS-AMP's LinearReplacer leaves a Linear carrying this as True
_OUR_MARK = "_fp8plug_msamp_skip"  # set beside SKIP_MARK where fp8plug (not the user) set it
_PLANNED = "_fp8plug_msamp_planned"
_PREPARED = "_fp8plug_msamp_prepared"


@dataclass(frozen=True, kw_only=True)
class MSAMPPlan(Plan):
    """What msamp.initialize gets besides the model and optimizer: MS-AMP's optimisation level."""

    opt_level: str = DEFAULTS["opt_level"]


def is_scaling_tensor(value) -> bool:
    """Whether `value` is an MS-AMP ScalingTensor (a quantized value plus its scaling meta; not a
    torch.Tensor)."""
    return not isinstance(value, torch.Tensor) and hasattr(value, "meta") and hasattr(value, "value") \
        and callable(getattr(value, "float", None))


def to_plain(value):
    """An MS-AMP ScalingTensor as an ordinary fp32 tensor (dequantized); anything else unchanged."""
    return value.float().detach() if is_scaling_tensor(value) else value


class MSAMPEngine(Engine):
    """MS-AMP: FP8 weights, gradients and communication (O1) and FP8/FP16 Adam states (O2)."""

    name = "msamp"
    title = "MS-AMP"
    install_hint = (
        "bash scripts/build_msamp_kit.sh, then bash .msampkit/build.sh on the GPU machine (current torch; "
        "docs/msamp.md); or, upstream's way, `python3 -m pip install . && make postinstall` in a checkout of "
        "https://github.com/Azure/MS-AMP inside a torch 2.1 container (NGC pytorch:23.10)"
    )
    scalings = ("delayed",)  # MS-AMP's own amax windows; not configurable through the recipe

    # availability -----------------------------------------------------------------------------
    def probe(self) -> Probe:
        probe = probe_import("msamp")
        if probe.available:
            return probe
        if probe.reason == "not installed":
            return Probe(False, reason=f"not installed. {CANNOT_INSTALL}")
        return Probe(False, reason=f"{probe.reason} (MS-AMP needs torch 2.1, TransformerEngine 1.1 and "
                                   "DeepSpeed 0.13.1)")

    def supports(self, device: DeviceInfo) -> Tuple[bool, str]:
        if device.type != "cuda":
            return False, ("MS-AMP runs only on CUDA GPUs (compute capability 8.9+ for FP8 GEMMs), "
                           f"not {device.describe()}")
        return super().supports(device)

    # MS-AMP's scaling windows and formats are its own: of the recipe it reads only the level
    honours = frozenset({"opt_level"})
    plan_class = MSAMPPlan

    def make_plan(self, settings: Settings) -> MSAMPPlan:
        """MS-AMP's refusals: opt_level 'O3' (DeepSpeed only), and optimizer_states (MS-AMP keeps its
        own low-precision optimizer states)."""
        if settings.optimizer_states is not None:
            raise ValueError(
                "FP8RecipeKwargs.optimizer_states: MS-AMP keeps its own low-precision optimizer states "
                "(opt_level='O2': FP8 first moment, FP16 second); leave optimizer_states None with "
                "backend='msamp'."
            )
        return MSAMPPlan(opt_level=_opt_level(settings.opt_level))

    def acts_as(self, name: str, scaling: str):
        if name == "use_autocast_during_eval":
            return True  # MS-AMP's FP8Linear runs FP8 in eval too
        return super().acts_as(name, scaling)

    def why_ignored(self, name: str, scaling: str) -> str:
        if name == "use_autocast_during_eval":
            return ("MS-AMP's FP8Linear has no high-precision mode, so eval runs FP8 GEMMs too; evaluate an "
                    "unconverted copy for high-precision metrics")
        return "MS-AMP has no such setting (its scaling is its own)"

    # conversion ---------------------------------------------------------------------------------
    def eligible(self, model: nn.Module, plan, linear: bool = True, norm: bool = True) -> Eligibility:
        """Linear layers (where `linear`; MS-AMP has no norms) with aligned features, but those
        the user marked with MS-AMP's own opt-out (`use_fp32_linear=True`)."""
        def problem(module):
            if getattr(module, SKIP_MARK, False) and not getattr(module, _OUR_MARK, False):
                return f"{SKIP_MARK}=True (MS-AMP's own opt-out)"
            return linear_alignment_problem(module)
        return Eligibility({nn.Linear: problem} if linear else {}, module_filter_fn=plan.module_filter_fn)

    def convert_listed(self, model: nn.Module, plan, modules, report: ConversionReport) -> None:
        """Convert nothing yet: MS-AMP converts inside msamp.initialize, which needs the optimizer
        too (see prepare). The listed Linears are reported as converted (MS-AMP will turn them into
        FP8); every other Linear is marked `use_fp32_linear`, so MS-AMP leaves it alone too.
        Called again, it marks anew."""
        _clear_our_marks(model)
        chosen = set()
        for decision, module in planned_modules(model, modules):
            chosen.add(id(module))
            report.converted.append(decision.fqn)
        for module in model.modules():
            # every other Linear, subclasses included, which MS-AMP would otherwise take
            if isinstance(module, nn.Linear) and id(module) not in chosen and not getattr(module, SKIP_MARK, False):
                setattr(module, SKIP_MARK, True)
                setattr(module, _OUR_MARK, True)
        setattr(model, _PLANNED, True)

    def unconvert(self, model: nn.Module) -> nn.Module:
        """Swap MS-AMP's FP8Linears back for nn.Linears holding the dequantized fp32 weights (new
        Parameters: for eval or export, not to keep training with MS-AMP's optimizer)."""
        for fqn, module in list(model.named_modules()):
            if self.is_converted(module):
                weight = to_plain(module.weight)
                plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                  device=weight.device, dtype=weight.dtype)
                with torch.no_grad():
                    plain.weight.copy_(weight)
                    if module.bias is not None:
                        plain.bias = module.bias
                plain.train(module.training)
                replace_module(model, fqn, plain)
        _clear_our_marks(model)
        return model

    def is_converted(self, module: nn.Module) -> bool:
        cls = type(module)
        return cls.__name__ == "FP8Linear" and cls.__module__.split(".")[0] == "msamp"

    # running ------------------------------------------------------------------------------------
    def autocast(self, plan=None, enabled: bool = True):
        """Nothing to enter: MS-AMP's FP8Linear always runs FP8 GEMMs, in eval too."""
        return contextlib.nullcontext()

    def deepspeed_problem(self, stage: int, partitioned: bool):
        return (
            "MS-AMP runs under DeepSpeed only through its own integration (msamp.deepspeed.initialize "
            "with an \"msamp\" section in the DeepSpeed config, for MS-AMP's pinned DeepSpeed 0.13.1), "
            f"not the stock deepspeed.initialize accelerate calls; use backend {OTHER_ENGINES} "
            "under DeepSpeed, or accelerate's own MS-AMP path."
        )

    def prepare(self, model: nn.Module, optimizer, plan):
        """msamp.initialize(model, optimizer, plan.opt_level) on the pair, after checking what MS-AMP
        would otherwise fail on obscurely; returns MS-AMP's (model, optimizer)."""
        if optimizer is None:
            raise ValueError(
                f"the msamp engine converts a model and its optimizer together (msamp.initialize(model, "
                f"optimizer, opt_level)), but no optimizer steps {type(model).__name__}'s parameters; pass "
                "the model and its torch.optim.Adam/AdamW to prepare() together."
            )
        plan = self.plan_of(plan)
        check_convertible(model, "the msamp engine must initialize the model before wrapping: ")
        if getattr(model, _PREPARED, False):
            raise ValueError(
                f"{type(model).__name__} went through msamp.initialize already; MS-AMP initializes a "
                "model once. Prepare a fresh model."
            )
        _check_optimizer(model, optimizer)
        if not getattr(model, _PLANNED, False):
            self.convert(model, plan)
        import msamp

        was_adamw = isinstance(optimizer, torch.optim.AdamW)
        frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
        new_model, new_optimizer = msamp.initialize(model, optimizer, opt_level=plan.opt_level)
        _refreeze(new_model, frozen)
        if was_adamw and getattr(new_optimizer, "use_adam", False):
            raise RuntimeError(
                f"msamp.initialize turned torch.optim.AdamW into {type(new_optimizer).__name__} (Adam with "
                f"L2 weight decay): on torch {torch.__version__} AdamW subclasses Adam, which MS-AMP checks "
                "first. Build MS-AMP with fp8plug's kit (scripts/build_msamp_kit.sh), whose patch tests AdamW "
                "first, or use it on the torch 2.1 it pins."
            )
        setattr(new_model, _PREPARED, True)
        _install_plain_checkpoints(new_model)
        new_optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.sync_gradients(new_model, opt))
        return new_model, new_optimizer

    def sync_gradients(self, model: nn.Module, optimizer) -> None:
        """MS-AMP's gradient all-reduce of the FP8 weights (`optimizer.all_reduce_grads(model)`),
        due once per optimizer step before it updates; MS-AMP makes it a no-op under its own DDP
        and in one process. prepare() hooks it onto the optimizer's step."""
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        module = getattr(model, "module", model)  # DistributedDataParallel
        inner.all_reduce_grads(module)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0):
        """MS-AMP's clip_grad_norm_, which reads ScalingTensor gradients (torch's cannot)."""
        import msamp

        return msamp.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    # checkpoints --------------------------------------------------------------------------------
    def plain_entries(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The same keys (MS-AMP adds none), with ScalingTensor weights as ordinary fp32 tensors."""
        return {key: to_plain(value) for key, value in state_dict.items()}


def _clear_our_marks(model: nn.Module) -> None:
    for module in model.modules():
        if getattr(module, _OUR_MARK, False):
            delattr(module, SKIP_MARK)
            delattr(module, _OUR_MARK)


def _opt_level(value) -> str:
    """The level msamp.initialize gets: the recipe's (FP8RecipeKwargs checked it is one of
    MS-AMP's OPT_LEVELS), refusing 'O3', which msamp.initialize does not take."""
    level = str(value or "O2").strip().upper()
    driven = ", ".join(name for name in OPT_LEVELS if name != "O3")
    if level == "O3":
        raise ValueError(
            "FP8RecipeKwargs.opt_level: 'O3' (FP8 weights with FP16 master weights) exists only inside "
            "MS-AMP's DeepSpeed integration (a 'msamp' section in the DeepSpeed config), which fp8plug does "
            f"not drive; use one of {driven}."
        )
    if level not in OPT_LEVELS:
        raise ValueError(f"FP8RecipeKwargs.opt_level: {level!r} is not an MS-AMP level; use one of {driven}.")
    return level


def _check_optimizer(model: nn.Module, optimizer) -> None:
    """MS-AMP takes torch.optim.Adam/AdamW (and DeepSpeed's FusedAdam) over the model's own params."""
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer) and isinstance(inner, torch.optim.Optimizer):
        raise ValueError(
            "the msamp engine needs the bare optimizer, not accelerate's wrapper: pass the model and its "
            "optimizer to prepare() together, before either is prepared."
        )
    cls = type(optimizer)
    fused_adam = cls.__name__ == "FusedAdam" and cls.__module__.startswith("deepspeed")
    if not (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or fused_adam):
        raise ValueError(
            f"the msamp engine supports torch.optim.Adam and AdamW only (MS-AMP replaces them by its "
            f"LBAdam/LBAdamW), not {cls.__module__}.{cls.__name__}; use AdamW, or another engine."
        )
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in own)
    if foreign:
        raise ValueError(
            f"the optimizer steps {foreign} tensor(s) that are not parameters of {type(model).__name__}; "
            "msamp.initialize maps the optimizer onto the model's parameters, so build the optimizer over "
            "model.parameters() only."
        )


def _refreeze(model: nn.Module, frozen) -> None:
    """Freeze again the weights that were frozen before msamp.initialize (a LoRA base, say).

    Why: MS-AMP's LinearReplacer gives every FP8Linear a new ScalingParameter, trainable by
    default (msamp/nn/linear.py), so a frozen Linear came back trainable and got a weight
    gradient every step. MS-AMP's backward reads `weight.requires_grad` and skips that GEMM when
    it is False (msamp/nn/functional.py), so the attribute is set, not `requires_grad_()`, which
    on a ScalingTensor sets a field backward does not read."""
    for name, param in model.named_parameters():
        if name in frozen and param.requires_grad:
            param.requires_grad = False


def _install_plain_checkpoints(model: nn.Module) -> None:
    """Make model.state_dict() give ScalingTensor weights as plain fp32 tensors, and
    model.load_state_dict() accept plain tensors for them (cast back with MS-AMP's Tensor.cast)."""

    def to_plain_hook(module, state_dict, prefix, local_metadata):
        for key in [k for k in state_dict if k.startswith(prefix)]:
            state_dict[key] = to_plain(state_dict[key])

    def from_plain_hook(module, state_dict, prefix, *args):
        for key, param in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            value = state_dict.get(key)
            if is_scaling_tensor(param) and isinstance(value, torch.Tensor):
                state_dict[key] = value.to(device=param.value.device, dtype=torch.float32).cast(param.qtype)

    register_post = getattr(model, "register_state_dict_post_hook", None) or model._register_state_dict_hook
    register_post(to_plain_hook)
    model._register_load_state_dict_pre_hook(from_plain_hook, with_module=True)
