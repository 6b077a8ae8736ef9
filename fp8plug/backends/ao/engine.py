"""The `ao` engine: torchao float8 training under fp8plug's shared conversion rules.

fp8plug decides which modules convert (fp8plug.layers.rules) and hands exactly those names to
torchao's `convert_to_float8_training`; the recipe becomes a torchao config where torchao has the
concept (AOPlan; configs built in fp8plug.backends.ao.config). Each converted module becomes
`AOFloat8Linear`, torchao's Float8Linear with fp8plug's forward: the eval policy of every engine,
FP8 at any token count (backends.padding), and no weight-gradient work for a frozen weight
(backends.ao.frozen). torchao is imported only when used. See docs/ao.md.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fp8plug.backends.ao.config import (
    MX_BLOCK,
    build_float8_config,
    float8_all_gather_problem,
    is_mx_training_config,
    needs_emulation,
    scaling_of,
)
from fp8plug.backends.base import Engine, Probe, probe_import
from fp8plug.backends.padding import pad_tokens, token_count
from fp8plug.backends.region import fp8_now, fp8_region
from fp8plug.backends.steps import track
from fp8plug.layers.rules import (
    ALIGNMENT,
    ConversionError,
    ConversionReport,
    Eligibility,
    linear_alignment_problem,
    module_paths,
    plain_linear,
    record_converted,
    replace_module,
)
from fp8plug.recipe.plans import Plan, Settings, ignored_message
from fp8plug.recipe.scalings import DELAYED_FIELDS  # what only delayed scaling reads, which torchao lacks

NO_OVERRIDE = (False, False, False)


# --- the module -----------------------------------------------------------------------------------


def _fp8_now(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `module` runs its FP8 path for input `x` (see AOFloat8Linear): the FP8 region's
    choice, else the training flag; an empty input runs in high precision."""
    return fp8_now(module.training) and token_count(x) > 0


def _high_precision_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight as a high-precision tensor: FSDP2's float8 all-gather hands Float8Linear an
    already-cast Float8TrainingTensor, which a plain F.linear cannot take."""
    if "torchao.float8.float8_training_tensor" in sys.modules:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        if isinstance(weight, Float8TrainingTensor):
            return weight.to_original_precision()
    return weight


@functools.lru_cache(maxsize=None)
def _float8_linear_class():
    """fp8plug's Float8Linear subclass, built on first use so torchao is imported only then."""
    from torchao.float8.float8_linear import Float8Linear

    from fp8plug.backends.ao.frozen import frozen_forward, takes_frozen_path

    class AOFloat8Linear(Float8Linear):
        """torchao's Float8Linear with fp8plug's choice of when to run FP8, and no weight-gradient
        work for a frozen weight.

        FP8 inside an enabled FP8 region, plain F.linear inside a disabled one, and outside any
        region FP8 in training mode only. The choice reads a flag and `self.training`, so
        torch.compile guards on it and recompiles, never breaks the graph. Token counts an FP8 GEMM
        cannot take are zero-padded, except where torchao needs no alignment (emulate) or pads
        itself (pad_inner_dim). A weight FSDP2's float8 all-gather has already cast keeps
        torchao's path. Its state (parameters, config, state-dict keys) is exactly torchao's; only
        `forward` differs.
        """

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if _fp8_now(self, input):
                align = 1 if self.config.pad_inner_dim or self.config.emulate else ALIGNMENT
                return pad_tokens(self._fp8_forward, _cpu_autocast_input(input), align)
            return F.linear(input, _high_precision_weight(self.weight), self.bias)

        def _fp8_forward(self, input: torch.Tensor) -> torch.Tensor:
            """torchao's FP8 forward; for a frozen weight, the same casts and GEMMs without the
            weight gradient's (backends.ao.frozen)."""
            if takes_frozen_path(self.weight):
                return frozen_forward(self, input)
            return super().forward(input)

    AOFloat8Linear.__module__ = __name__
    AOFloat8Linear.__qualname__ = "AOFloat8Linear"
    return AOFloat8Linear


class AOMXLinear(nn.Linear):
    """An nn.Linear whose parameters torchao wrapped for MXFP8 training (its
    MXFP8TrainingWeightWrapperTensor routes F.linear to MXFP8 GEMMs). fp8plug adds the eval
    policy, token padding to a multiple of 32, and the bias: torchao 0.18's MXFP8 linear
    override drops it, so it is added here."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _fp8_now(self, input):
            out = pad_tokens(lambda x: F.linear(x, self.weight), input, MX_BLOCK)
            return out if self.bias is None else out + self.bias.to(out.dtype)
        with torch._C.DisableTorchFunctionSubclass():
            return F.linear(input, self.weight, self.bias)


def _cpu_autocast_input(input: torch.Tensor) -> torch.Tensor:
    """torchao casts a float8 layer's input to the autocast dtype under CUDA autocast only; do the
    same under CPU autocast, or the high-precision gradient GEMMs meet mixed dtypes."""
    if input.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return input.to(torch.get_autocast_dtype("cpu"))
    return input


def __getattr__(name):
    # `fp8plug.backends.ao.engine.AOFloat8Linear` resolves (e.g. for unpickling) once torchao imports.
    if name == "AOFloat8Linear":
        return _float8_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- the engine ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AOPlan(Plan):
    """How the ao engine gets its torchao config (besides the shared Plan).

    `torchao_config`: a finished torchao config used as it is (an MXFP8 training config given as
    FP8RecipeKwargs.ao_config). Otherwise one is built from `base_config`
    (FP8RecipeKwargs.ao_config; None: torchao's recipe named `scaling`) with, on top:
    `fp8_format` and `override_linear_precision` (None keeps the base's casts), `pad_inner_dim`
    and `emulate` (None keeps the base's), and float8 all-gather where
    `enable_fsdp_float8_all_gather`; a config that cannot all-gather in float8 is then an error
    where it was asked for as an argument (`all_gather_asked`), else a warning.
    """

    torchao_config: Any = field(default=None, compare=False)
    base_config: Any = field(default=None, compare=False)
    fp8_format: Optional[str] = None
    override_linear_precision: Optional[Tuple[bool, bool, bool]] = None
    pad_inner_dim: Optional[bool] = None
    emulate: Optional[bool] = None
    enable_fsdp_float8_all_gather: bool = False
    all_gather_asked: bool = False


class AOEngine(Engine):
    """torchao float8 training (see the module doc)."""

    name = "ao"
    title = "torchao float8"
    install_hint = "pip install torchao"
    runs_on_cpu = True
    scalings = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    honours = frozenset({"fp8_format", "override_linear_precision", "pad_inner_dim", "enable_fsdp_float8_all_gather",
                         "ao_config", "use_autocast_during_eval"})
    plan_class = AOPlan

    def probe(self) -> Probe:
        return probe_import("torchao.float8", lambda m: __import__("torchao").__version__)

    def scaling_name(self, scaling) -> str:
        if scaling in ("delayed", "dynamic", "current"):
            hint = "; for delayed scaling use backend='native' or 'te'" if scaling == "delayed" else ""
            raise ValueError(
                f"FP8RecipeKwargs.scaling: {scaling!r} is not a torchao float8 recipe (torchao scales "
                f"every tensor dynamically); use one of {', '.join(self.scalings)}{hint}."
            )
        if scaling == "blockwise":
            raise ValueError(
                "FP8RecipeKwargs.scaling: 'blockwise' is not a torchao float8 recipe (torchao 0.18's blockwise "
                "training is a prototype, torchao.prototype.blockwise_fp8_training, outside Float8LinearConfig); "
                f"use one of {', '.join(self.scalings)}, or backend='native' or 'te' for blockwise (backend=None "
                "chooses one that has it)."
            )
        return super().scaling_name(scaling)

    def why_ignored(self, name: str, scaling: str) -> str:
        if name in DELAYED_FIELDS:
            return ("torchao removed delayed scaling in 0.10 and scales every tensor dynamically; for delayed "
                    "scaling use backend='native' or 'te'")
        return super().why_ignored(name, scaling)

    # recipe -> plan -> config ------------------------------------------------------------------------
    def make_plan(self, settings: Settings) -> AOPlan:
        """A named recipe (`scaling`) takes every field from the recipe, environment included;
        fp8_format applies to tensorwise always (HYBRID is its own default) and to the rowwise
        recipes, which are E4M3 throughout by design, only when passed as an argument. A whole
        `ao_config` keeps its own settings except those passed as arguments."""
        s = settings
        if is_mx_training_config(s.ao_config):  # torchao's MXFP8 training config, used as given
            given = [n for n in ("scaling", "fp8_format", "override_linear_precision", "pad_inner_dim",
                                 "enable_fsdp_float8_all_gather") if s.argument(n) is not None]
            if given:
                raise ValueError(f"FP8RecipeKwargs.{given[0]}: applies to torchao float8, not to an MXFP8 "
                                 "ao_config; leave it unset.")
            return AOPlan(torchao_config=s.ao_config, scaling=scaling_of(s.ao_config))
        if s.ao_config is not None:
            from torchao.float8 import Float8LinearConfig

            if not isinstance(s.ao_config, Float8LinearConfig):
                raise ValueError(
                    "FP8RecipeKwargs.ao_config: expected a torchao.float8.Float8LinearConfig (or torchao's MXFP8 "
                    f"training config), got {type(s.ao_config).__name__}."
                )
            if s.argument("scaling") is not None:
                raise ValueError(
                    "FP8RecipeKwargs: give either scaling (a torchao recipe name) or ao_config (a whole "
                    "Float8LinearConfig), not both."
                )
            chosen = s.argument  # only what the caller passed goes on top of a whole config
        else:
            chosen = functools.partial(getattr, s)  # env and defaults count for a named recipe
        all_gather = bool(chosen("enable_fsdp_float8_all_gather"))
        return AOPlan(
            scaling=scaling_of(s.ao_config) if s.ao_config is not None else "",  # a whole config: what it gives
            base_config=s.ao_config,
            fp8_format=s.fp8_format if s.ao_config is None and s.scaling == "tensorwise" else s.argument("fp8_format"),
            override_linear_precision=chosen("override_linear_precision") or NO_OVERRIDE,
            pad_inner_dim=chosen("pad_inner_dim"),
            emulate=needs_emulation() if s.ao_config is None else None,
            enable_fsdp_float8_all_gather=all_gather,
            all_gather_asked=all_gather and s.argument("enable_fsdp_float8_all_gather") is not None,
        )

    def float8_config(self, plan):
        """The torchao config `plan` (or a recipe, made into one) says (see AOPlan)."""
        from torchao.float8 import Float8LinearConfig

        plan = self.plan_of(plan)
        if plan.torchao_config is not None:
            return plan.torchao_config
        base = plan.base_config
        if base is None:
            base = Float8LinearConfig.from_recipe_name(plan.scaling)
        elif not isinstance(base, Float8LinearConfig):
            raise ValueError(
                f"FP8RecipeKwargs.ao_config: expected a torchao.float8.Float8LinearConfig, got {type(base).__name__}."
            )
        config = build_float8_config(
            base, fp8_format=plan.fp8_format, override_linear_precision=plan.override_linear_precision or NO_OVERRIDE,
            pad_inner_dim=plan.pad_inner_dim, emulate=plan.emulate,
        )
        if plan.enable_fsdp_float8_all_gather:
            problem = float8_all_gather_problem(config)
            if problem is None:
                config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
            elif plan.all_gather_asked:
                raise ValueError(f"FP8RecipeKwargs.enable_fsdp_float8_all_gather: cannot be used here: {problem}.")
            else:  # `accelerate launch` exports true by default: not necessarily the user's choice
                warnings.warn(ignored_message(
                    self, "enable_fsdp_float8_all_gather", True, plan.scaling,
                    f"{problem}, so FSDP2 will all-gather these weights in high precision (the value came from "
                    "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER, which `accelerate launch` exports)",
                ), UserWarning, stacklevel=3)
        return config

    # conversion ------------------------------------------------------------------------------------
    def eligible(self, model: nn.Module, plan, linear: bool = True, norm: bool = True) -> Eligibility:
        """Linear layers (where `linear`; torchao has no norms) whose features the plan's torchao
        config can take: aligned to 16, or to MXFP8's blocks of 32 under an MXFP8 training config."""
        if not linear:
            return Eligibility()
        self.require()
        alignment = mx_alignment_problem if is_mx_training_config(plan.torchao_config) else linear_alignment_problem
        return Eligibility({nn.Linear: alignment}, module_filter_fn=plan.module_filter_fn)

    def convert_listed(self, model: nn.Module, plan, modules, report: ConversionReport) -> None:
        """Convert the listed Linear layers in place with the torchao config the plan says (a
        Float8LinearConfig, or an MXFP8 training config: fp8plug.backends.ao.config.mx_training_config),
        handing torchao exactly their names."""
        config = self.float8_config(plan)
        planned = [decision.fqn for decision in modules.targets]
        if "" in planned:
            raise ConversionError("the model itself is a single convertible layer; wrap it in a container first.")
        if is_mx_training_config(config):
            _convert_mx(model, config, planned, report)
            return
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        problem = float8_all_gather_problem(config) if config.enable_fsdp_float8_all_gather else None
        if problem:
            raise ValueError(f"enable_fsdp_float8_all_gather cannot be used with this float8 config: {problem}.")
        if not planned:
            return
        wanted = frozenset(planned)
        paths = module_paths(model)  # torchao converts a module under its first name only
        convert_to_float8_training(model, module_filter_fn=lambda _module, fqn: fqn in wanted, config=config)
        cls = _float8_linear_class()
        for fqn in planned:
            module = model.get_submodule(fqn)
            if type(module) is not Float8Linear:  # pragma: no cover - torchao skipped a planned module
                raise ConversionError(f"torchao did not convert {fqn!r} ({type(module).__name__}).")
            module.__class__ = cls  # same state, fp8plug's forward (see AOFloat8Linear)
            replace_module(model, fqn, module, paths)  # its other names point at it too
            record_converted(model, fqn, module, module, report)
        track(model, self)  # float8 all-gather scales are due after every optimizer step (end_step)

    def unconvert(self, model: nn.Module) -> nn.Module:
        """Put plain nn.Linear modules back, holding the very Parameters the FP8 modules trained
        (torchao's float8 all-gather wrapper is unwrapped to the Parameter it wraps)."""
        for fqn, module in list(model.named_modules()):
            if _is_float8_linear(module):
                replace_module(model, fqn, plain_linear(module, _plain_parameter(module.weight, f"{fqn}.weight"),
                                                        module.bias))
            elif _is_mx_linear(module):
                for name, param in list(module.named_parameters(recurse=False)):
                    setattr(module, name, _plain_parameter(param, f"{fqn}.{name}"))
                module.__class__ = nn.Linear
        return model

    def is_converted(self, module: nn.Module) -> bool:
        return _is_float8_linear(module) or _is_mx_linear(module)

    def runs_fp8(self, module: nn.Module, input) -> bool:
        """Every call the region (or training mode) puts in FP8 runs FP8: odd token counts are padded."""
        return isinstance(input, torch.Tensor) and _fp8_now(module, input)

    def grouped_gemm(self, plan=None, device=None) -> str:
        """Why a transformers model's experts stay in high precision under ao (docs/moe.md), read in
        torchao 0.18's prototype moe_training: its FP8 grouped GEMM requires token groups already
        padded to 16 rows (`pad_token_groups_for_grouped_mm=True` is refused), which transformers'
        routing does not give; its weight subclass intercepts only `torch._grouped_mm`, while
        transformers calls `torch.nn.functional.grouped_mm` where torch has it (so the experts would
        silently stay bf16); and it swaps in new Parameter objects."""
        return ("torchao 0.18's MoE training (torchao.prototype.moe_training) needs token groups padded to 16 "
                "before its grouped GEMM and intercepts only torch._grouped_mm, not the "
                "torch.nn.functional.grouped_mm transformers calls; use the native engine for FP8 experts")

    # running ---------------------------------------------------------------------------------------
    def autocast(self, plan=None, enabled: bool = True):
        """FP8 (enabled) or high precision (disabled) for every fp8plug torchao module inside the
        block; the shared region flag (backends.region), so it also governs native layers."""
        return fp8_region(enabled)

    def end_step(self, models, group=None) -> None:
        """Under FSDP2 with float8 all-gather, compute every float8 weight's scale for the next
        all-gather in one all-reduce per model (torchao's precompute_float8_dynamic_scale_for_fsdp,
        over FSDP's own process group, so `group` is not used). Every model this engine
        converted is tracked (fp8plug.backends.steps), so this runs after each optimizer step that trains
        it; a model without such weights costs one look at its modules."""
        for model in models:
            if any(_gathers_in_float8(m) for m in model.modules()):
                from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

                precompute_float8_dynamic_scale_for_fsdp(model)

    def has_storageless_weights(self) -> bool:
        """torchao's float8 all-gather weights (data_ptr() == 0) can exist only once its fsdp_utils
        is imported."""
        return "torchao.float8.fsdp_utils" in sys.modules


def _is_float8_linear(module: nn.Module) -> bool:
    if "torchao.float8.float8_linear" not in sys.modules:
        return False
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def _is_mx_linear(module: nn.Module) -> bool:
    if isinstance(module, AOMXLinear):
        return True
    if "torchao.prototype.moe_training.tensor" not in sys.modules or not isinstance(module, nn.Linear):
        return False
    from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor

    # getattr: a Linear whose weight was deleted is refused by name later (layers.rules), not here
    return isinstance(getattr(module, "weight", None), TrainingWeightWrapperBaseTensor)


def _gathers_in_float8(module: nn.Module) -> bool:
    if not _is_float8_linear(module) or not module.config.enable_fsdp_float8_all_gather:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(module.weight, DTensor)


def _plain_parameter(param: torch.Tensor, where: str) -> nn.Parameter:
    """The plain Parameter inside torchao's weight wrappers (the original one where it is kept)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        raise ConversionError(
            f"cannot unconvert {where}: its weight is sharded (DTensor); gather a full state dict and "
            "load it into an unconverted model instead."
        )
    inner = getattr(param, "_tensor", None)  # torchao float8 all-gather wrapper
    if inner is None:
        inner = getattr(param, "_data", None)  # torchao MXFP8 training wrapper
    if inner is None:
        return param
    if isinstance(inner, nn.Parameter):
        return inner
    return nn.Parameter(inner, requires_grad=param.requires_grad)


# --- MXFP8 ----------------------------------------------------------------------------------------


def mx_alignment_problem(module: nn.Linear) -> Optional[str]:
    """Why an nn.Linear cannot take MXFP8 GEMMs (blocks of 32 along K and N), or None."""
    features = (("in_features", module.in_features), ("out_features", module.out_features))
    bad = [f"{n}={v}" for n, v in features if v % MX_BLOCK]
    return f"{' and '.join(bad)} not divisible by {MX_BLOCK} (MXFP8 scales blocks of 32)" if bad else None


def _convert_mx(model: nn.Module, config, planned, report: ConversionReport) -> None:
    """Wrap the planned nn.Linear layers' parameters for MXFP8 training with torchao's `quantize_`
    (in place)."""
    from torchao.quantization import quantize_

    if not planned:
        return
    wanted = frozenset(planned)
    quantize_(model, config, filter_fn=lambda _module, fqn: fqn in wanted)
    for fqn in planned:
        module = model.get_submodule(fqn)
        module.__class__ = AOMXLinear
        record_converted(model, fqn, module, module, report)
