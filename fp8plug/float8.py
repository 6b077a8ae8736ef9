"""Float8 training entry points shaped like OLMo-core's and like torchao's own, on fp8plug engines.

OLMo-core's shape: `Float8Config(ao=..., ao_recipe=..., ao_mx=..., modules_to_ignore=..., enabled=...)`
and `Float8Config.apply_float8_linear(model, modules_to_ignore=...)`, served by the `ao` engine
(torchao Float8Linear, or torchao's MXFP8 training for `ao_mx`).

torchao's seed shape: `convert_to_float8_training(model, module_filter_fn=..., config=...)` with a
`Float8LinearConfig` of per-tensor `CastConfig(scaling_type=ScalingType.DYNAMIC | DELAYED)`, plus
`sync_float8_amax_and_scale_history` and `precompute_float8_dynamic_scale_for_fsdp`. All-dynamic
configs run on torchao (the `ao` engine); torchao removed delayed scaling in 0.10, so a config
with any DELAYED tensor runs on fp8plug's native engine, which keeps TransformerEngine-style amax
histories per tensor.

Both convert in place under fp8plug's shared rules (fp8plug.convert): exact nn.Linear only, in
and out features divisible by 16, an already compiled or sharded model refused. Converted layers
run FP8 in training mode and high precision in eval mode, as with every fp8plug engine; use the
engine's autocast (`fp8plug.get_backend("ao").autocast(recipe, enabled=True)`) to evaluate in FP8.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field, fields
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from .api import sync_fp8_scaling
from .backends import get_backend
from .convert import ConversionError, ConversionReport
from .coverage import describe_engine, log_conversion
from .steps import end_step

__all__ = [
    "AOFloat8LinearConfig",
    "AOFloat8LinearRecipe",
    "AOMXLinearConfig",
    "CastConfig",
    "DelayedScalingConfig",
    "Float8Config",
    "Float8LinearConfig",
    "ScalingType",
    "convert_to_float8_training",
    "precompute_float8_dynamic_scale_for_fsdp",
    "sync_float8_amax_and_scale_history",
]


# --- OLMo-core's shape -------------------------------------------------------------------------------


class AOFloat8LinearRecipe(str, enum.Enum):
    """torchao's float8 recipe names (a string enum: `AOFloat8LinearRecipe("rowwise")` works)."""

    tensorwise = "tensorwise"
    rowwise = "rowwise"
    rowwise_with_gw_hp = "rowwise_with_gw_hp"

    def __str__(self) -> str:
        return self.value


def _cast_config(value, where: str):
    """A torchao CastConfig from a CastConfig or a dict of its fields written as strings."""
    from torchao.float8.config import CastConfig as AOCastConfig, ScalingGranularity, ScalingType as AOScalingType

    if isinstance(value, AOCastConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"AOFloat8LinearConfig.{where}: give a torchao CastConfig or a dict of its fields, not {value!r}.")
    unknown = set(value) - {"scaling_type", "scaling_granularity", "target_dtype"}
    if unknown:
        raise ValueError(f"AOFloat8LinearConfig.{where}: unknown field(s) {sorted(unknown)}.")
    kwargs = {}
    try:
        if value.get("scaling_type") is not None:
            kwargs["scaling_type"] = AOScalingType(str(getattr(value["scaling_type"], "value", value["scaling_type"])).lower())
        if value.get("scaling_granularity") is not None:
            kwargs["scaling_granularity"] = ScalingGranularity(
                str(getattr(value["scaling_granularity"], "value", value["scaling_granularity"])).lower()
            )
    except ValueError as exc:
        raise ValueError(f"AOFloat8LinearConfig.{where}: {exc}.") from None
    if value.get("target_dtype") is not None:
        dtype = value["target_dtype"]
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).replace("torch.", ""), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"AOFloat8LinearConfig.{where}.target_dtype: {value['target_dtype']!r} is not a torch dtype.")
        kwargs["target_dtype"] = dtype
    return AOCastConfig(**kwargs)


def _gemm_config(value, where: str):
    from torchao.float8.config import Float8GemmConfig

    if isinstance(value, Float8GemmConfig):
        return value
    if isinstance(value, dict) and set(value) <= {"use_fast_accum"}:
        return Float8GemmConfig(**value)
    raise ValueError(f"AOFloat8LinearConfig.{where}: give a torchao Float8GemmConfig or {{'use_fast_accum': bool}}.")


@dataclass
class AOFloat8LinearConfig:
    """torchao's Float8LinearConfig, field for field; None leaves torchao's default (emulate None:
    emulate only where the machine has no FP8 GEMM at all). Cast configs may be torchao
    CastConfig objects or dicts such as {"scaling_granularity": "axiswise"}."""

    cast_config_input: Optional[object] = None
    cast_config_input_for_grad_weight: Optional[object] = None
    cast_config_weight: Optional[object] = None
    cast_config_weight_for_grad_input: Optional[object] = None
    cast_config_grad_output: Optional[object] = None
    cast_config_grad_output_for_grad_weight: Optional[object] = None
    gemm_config_output: Optional[object] = None
    gemm_config_grad_input: Optional[object] = None
    gemm_config_grad_weight: Optional[object] = None
    enable_fsdp_float8_all_gather: Optional[bool] = None
    pad_inner_dim: Optional[bool] = None
    emulate: Optional[bool] = None
    force_recompute_fp8_weight_in_bwd: Optional[bool] = None  # deprecated in torchao: no effect
    round_scales_to_power_of_2: Optional[bool] = None

    def to_ao_type(self):
        """The torchao Float8LinearConfig these fields describe."""
        from torchao.float8 import Float8LinearConfig as AOConfig

        from .torchao_config import needs_emulation

        kwargs = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name.startswith("cast_config"):
                value = _cast_config(value, f.name)
            elif f.name.startswith("gemm_config"):
                value = _gemm_config(value, f.name)
            elif not isinstance(value, bool):
                raise ValueError(f"AOFloat8LinearConfig.{f.name}: expected True, False or None, got {value!r}.")
            kwargs[f.name] = value
        kwargs.setdefault("emulate", needs_emulation())
        try:
            return AOConfig(**kwargs)
        except AssertionError as exc:  # torchao validates with assert
            raise ValueError(f"AOFloat8LinearConfig: torchao rejected it: {exc}") from None


@dataclass
class AOMXLinearConfig:
    """OLMo-core's MX training config; served by torchao's MXFP8 training (fp8plug.torchao_config.
    mx_training_config says what torchao can and cannot train). None takes torchao's choice:
    blocks of 32, E4M3 elements, RCEIL scales, real kernels on a GPU and emulation without one."""

    block_size: Optional[int] = None
    elem_dtype: Optional[object] = None
    elem_dtype_weight_override: Optional[object] = None
    elem_dtype_grad_output_override: Optional[object] = None
    kernel_preference: Optional[object] = None
    mxfp8_cast_kernel_choice: Optional[object] = None
    scale_calculation_mode: Optional[object] = None

    def to_ao_type(self):
        """torchao's MXFP8TrainingOpConfig for these fields; a clear error where it cannot run."""
        from .torchao_config import mx_training_config

        return mx_training_config(**{f.name: getattr(self, f.name) for f in fields(self)})


@dataclass
class Float8Config:
    """Which float8 training to apply, OLMo-core style: `ao` (a torchao Float8LinearConfig's
    fields), `ao_recipe` (a torchao recipe name) or `ao_mx` (MXFP8): at most one; none means
    torchao's default (tensorwise). `modules_to_ignore` are fully-qualified names of Linear layers
    to keep in high precision. `enabled=False` makes apply_float8_linear do nothing."""

    ao: Optional[AOFloat8LinearConfig] = None
    ao_recipe: Optional[AOFloat8LinearRecipe] = None
    ao_mx: Optional[AOMXLinearConfig] = None
    modules_to_ignore: Optional[List[str]] = None
    enabled: bool = True

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check the fields (at most one of ao, ao_recipe, ao_mx; known recipe names; a list of
        names) and normalise ao_recipe and modules_to_ignore; ValueError naming the field if not."""
        given = [name for name in ("ao", "ao_recipe", "ao_mx") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"Float8Config: {' and '.join(given)} are mutually exclusive; set only one of ao, ao_recipe, ao_mx."
            )
        if self.ao_recipe is not None:
            try:
                self.ao_recipe = AOFloat8LinearRecipe(str(getattr(self.ao_recipe, "value", self.ao_recipe)).lower())
            except ValueError:
                allowed = ", ".join(r.value for r in AOFloat8LinearRecipe)
                raise ValueError(f"Float8Config.ao_recipe: {self.ao_recipe!r} is not a torchao recipe; use one of {allowed}.") from None
        if self.ao is not None and not isinstance(self.ao, AOFloat8LinearConfig) and not _is_torchao_config(self.ao):
            raise ValueError(f"Float8Config.ao: expected an AOFloat8LinearConfig (or a torchao Float8LinearConfig), got {type(self.ao).__name__}.")
        if self.ao_mx is not None and not isinstance(self.ao_mx, AOMXLinearConfig):
            raise ValueError(f"Float8Config.ao_mx: expected an AOMXLinearConfig, got {type(self.ao_mx).__name__}.")
        self.modules_to_ignore = _names(self.modules_to_ignore, "Float8Config.modules_to_ignore")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"Float8Config.enabled: expected True or False, got {self.enabled!r}.")

    def float8_linear_config(self):
        """The torchao Float8LinearConfig applied (None for ao_mx)."""
        if self.ao_mx is not None:
            return None
        from torchao.float8 import Float8LinearConfig as AOConfig

        from .torchao_config import build_float8_config, needs_emulation

        if self.ao_recipe is not None:
            return build_float8_config(AOConfig.from_recipe_name(self.ao_recipe.value), emulate=needs_emulation())
        if _is_torchao_config(self.ao):
            return self.ao
        return (self.ao or AOFloat8LinearConfig()).to_ao_type()

    @property
    def should_precompute_float8_dynamic_scale_for_fsdp(self) -> bool:
        """Whether weights all-gather in float8 under FSDP2, so scales should be precomputed after
        each optimizer step (precompute_float8_dynamic_scale_for_fsdp)."""
        if not self.enabled or self.ao_mx is not None or self.ao_recipe is not None:
            return False
        return bool(self.float8_linear_config().enable_fsdp_float8_all_gather)

    def apply_float8_linear(self, model: nn.Module, *, modules_to_ignore: Optional[Sequence[str]] = None):
        """Convert `model`'s Linear layers to torchao float8 (or MXFP8) layers, in place.

        Call it before torch.compile, activation checkpointing and FSDP/DDP wrapping. Names in
        `modules_to_ignore` (and the config's) must each name a Linear layer of `model` exactly.
        Frozen parameters stay frozen. Returns the ConversionReport, or None when disabled.
        """
        if not self.enabled:
            return None
        self.validate()
        ignore = sorted(set(self.modules_to_ignore or ()) | set(_names(modules_to_ignore, "modules_to_ignore") or ()))
        _check_linear_names(model, ignore)
        engine = get_backend("ao")
        engine.require()
        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        config = self.ao_mx.to_ao_type() if self.ao_mx is not None else self.float8_linear_config()
        report = engine.convert_with_config(model, config, ignore)
        for name in frozen:
            model.get_parameter(name).requires_grad_(False)
        log_conversion(report, describe_engine(engine), type(model).__name__)
        return report


def _is_torchao_config(value) -> bool:
    cls = type(value)
    return cls.__name__ == "Float8LinearConfig" and cls.__module__.startswith("torchao.")


def _names(value, where: str) -> Optional[List[str]]:
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"{where}: give a list of fully-qualified module names, not {value!r}.")
    return list(value)


def _check_linear_names(model: nn.Module, names: Sequence[str]) -> None:
    """OLMo-core's names are Linear layers: refuse one that names another module. A name that
    matches nothing is reported by the shared conversion rules (fp8plug.convert)."""
    modules = dict(model.named_modules())
    not_linear = [n for n in names if n in modules and not isinstance(modules[n], nn.Linear)]
    if not_linear:
        raise ConversionError(
            f"modules_to_ignore names {not_linear}, which are not Linear layers; names match exactly, so "
            "list each Linear layer to keep in high precision."
        )


# --- torchao's seed shape ---------------------------------------------------------------------------


class ScalingType(enum.Enum):
    """How one tensor is scaled to float8: from its own amax (DYNAMIC), from a history of past
    amaxes (DELAYED, served by fp8plug's native engine), or not cast at all (DISABLED, torchao)."""

    DYNAMIC = "dynamic"
    DELAYED = "delayed"
    DISABLED = "disabled"


@dataclass(frozen=True)
class CastConfig:
    """How to cast one tensor (input, weight or grad_output) to float8."""

    scaling_type: ScalingType = ScalingType.DYNAMIC

    def __post_init__(self):
        if not isinstance(self.scaling_type, ScalingType):
            raise ValueError(
                f"CastConfig.scaling_type: expected ScalingType.DYNAMIC, DELAYED or DISABLED, got {self.scaling_type!r}."
            )


@dataclass(frozen=True)
class DelayedScalingConfig:
    """Delayed scaling: how many past amaxes to keep per tensor and how to reduce them ("max",
    torchao's only choice, or "most_recent")."""

    history_len: int = 16
    scale_fn_name: str = "max"

    def __post_init__(self):
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"DelayedScalingConfig.history_len: use an integer >= 1, not {self.history_len!r}.")
        if self.scale_fn_name not in ("max", "most_recent"):
            raise ValueError(f"DelayedScalingConfig.scale_fn_name: use 'max' or 'most_recent', not {self.scale_fn_name!r}.")


@dataclass(frozen=True)
class Float8LinearConfig:
    """The torchao seed's float8 Linear config: a CastConfig per tensor (E4M3 input and weight,
    E5M2 grad_output), delayed-scaling settings, and torchao's per-linear switches.

    enable_amax_init / enable_pre_and_post_forward were torchao workarounds for delayed scaling
    under autocast + compile + FSDP; the native engine initialises each scale from the first amax
    and updates its history after each optimizer step, so it needs neither: both are accepted and
    have no effect. emulate and pad_inner_dim apply to dynamic (torchao) configs.

    `recipe_name` names one of torchao's float8 recipes ("tensorwise", "rowwise",
    "rowwise_with_gw_hp") instead of cast configs: `Float8LinearConfig.from_recipe_name(name)`,
    as torchao spells it. Rowwise scaling needs torchao itself; tensorwise runs on fp8plug's
    native engine (dynamic scaling) where torchao is not installed.
    """

    cast_config_input: CastConfig = field(default_factory=CastConfig)
    cast_config_weight: CastConfig = field(default_factory=CastConfig)
    cast_config_grad_output: CastConfig = field(default_factory=CastConfig)
    enable_amax_init: bool = True
    enable_pre_and_post_forward: bool = True
    enable_fsdp_float8_all_gather: bool = False
    pad_inner_dim: bool = False
    emulate: bool = False
    delayed_scaling_config: DelayedScalingConfig = field(default_factory=DelayedScalingConfig)
    recipe_name: Optional[str] = None

    @staticmethod
    def from_recipe_name(recipe_name) -> "Float8LinearConfig":
        """The config for one of torchao's float8 recipe names ("tensorwise", "rowwise",
        "rowwise_with_gw_hp"; a string or a torchao Float8LinearRecipeName), as torchao's
        Float8LinearConfig.from_recipe_name."""
        return Float8LinearConfig(recipe_name=recipe_name)

    def __post_init__(self):
        if self.recipe_name is not None:
            object.__setattr__(self, "recipe_name", _recipe_name(self.recipe_name))
            if any(t is not ScalingType.DYNAMIC for t in self.scaling_types):
                raise ValueError(
                    f"Float8LinearConfig: recipe_name={self.recipe_name!r} sets every cast itself; leave "
                    "cast_config_input/weight/grad_output at their defaults, or give cast configs without a recipe_name."
                )
        for name in ("cast_config_input", "cast_config_weight", "cast_config_grad_output"):
            if not isinstance(getattr(self, name), CastConfig):
                raise ValueError(f"Float8LinearConfig.{name}: expected a fp8plug.float8.CastConfig, got {getattr(self, name)!r}.")
        if self.delayed and ScalingType.DISABLED in self.scaling_types:
            raise ValueError(
                "Float8LinearConfig: DELAYED and DISABLED cannot be mixed (delayed scaling runs on fp8plug's "
                "native engine, which casts all three tensors); use DYNAMIC instead of DISABLED."
            )
        if self.delayed and self.enable_fsdp_float8_all_gather:
            raise ValueError(
                "Float8LinearConfig.enable_fsdp_float8_all_gather: float8 all-gather needs dynamic weight "
                "scaling (torchao); with DELAYED scaling set it to False."
            )

    @property
    def scaling_types(self):
        """(input, weight, grad_output) scaling types."""
        return (self.cast_config_input.scaling_type, self.cast_config_weight.scaling_type,
                self.cast_config_grad_output.scaling_type)

    @property
    def delayed(self) -> bool:
        """Whether any tensor uses DELAYED scaling (then the native engine serves the config)."""
        return ScalingType.DELAYED in self.scaling_types

    def to_torchao(self):
        """The equivalent torchao Float8LinearConfig (dynamic or disabled tensors only)."""
        from torchao.float8 import CastConfig as AOCastConfig, Float8LinearConfig as AOConfig, ScalingType as AOType

        if self.delayed:
            raise ValueError("Float8LinearConfig: torchao has no delayed scaling (removed in 0.10); the native engine serves it.")
        if self.recipe_name is not None:
            from .torchao_config import build_float8_config, needs_emulation

            return build_float8_config(
                AOConfig.from_recipe_name(self.recipe_name), pad_inner_dim=self.pad_inner_dim,
                emulate=self.emulate or needs_emulation(),
                enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather or None,
            )
        cast = lambda c: AOCastConfig(scaling_type=AOType(c.scaling_type.value))  # noqa: E731
        try:
            return AOConfig(
                cast_config_input=cast(self.cast_config_input), cast_config_weight=cast(self.cast_config_weight),
                cast_config_grad_output=cast(self.cast_config_grad_output),
                enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather,
                pad_inner_dim=self.pad_inner_dim, emulate=self.emulate,
            )
        except AssertionError as exc:
            raise ValueError(
                f"Float8LinearConfig: torchao rejected it ({exc}); a GEMM's two operands must both be "
                "cast or both be DISABLED (input and weight for the output, grad_output and weight, "
                "grad_output and input for the gradients)."
            ) from None


def _recipe_name(value) -> str:
    """A torchao float8 recipe name from a string or an enum member, checked."""
    text = str(getattr(value, "value", value)).strip().lower()
    allowed = [r.value for r in AOFloat8LinearRecipe]
    if text not in allowed:
        raise ValueError(f"Float8LinearConfig.recipe_name: {value!r} is not a torchao float8 recipe; use one of {', '.join(allowed)}.")
    return text


def convert_to_float8_training(
    module: nn.Module,
    *,
    module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
    config=None,
) -> nn.Module:
    """Swap `module`'s eligible nn.Linear layers for float8 training layers, in place; returns it.

    `config`: a fp8plug.float8.Float8LinearConfig (default: all tensors DYNAMIC) or a torchao
    Float8LinearConfig. Dynamic configs run on torchao (the `ao` engine); any DELAYED tensor puts
    every converted layer on fp8plug's native engine (NativeFP8Linear with per-tensor modes).
    `module_filter_fn(module, fqn)` returning False keeps a layer in high precision; layers whose
    in or out features are not divisible by 16 stay too.
    """
    config = Float8LinearConfig() if config is None else config
    report = _convert_float8(module, config, module_filter_fn)
    log_conversion(report, describe_engine(get_backend(report.backend)), type(module).__name__)
    return module


def _convert_float8(module: nn.Module, config, module_filter_fn) -> ConversionReport:
    if _is_torchao_config(config):
        return get_backend("ao").convert_with_config(module, config, None, module_filter_fn)
    if not isinstance(config, Float8LinearConfig):
        raise ValueError(
            "convert_to_float8_training: config must be a fp8plug.float8.Float8LinearConfig or a torchao "
            f"Float8LinearConfig, not {type(config).__name__}."
        )
    if config.delayed:
        return _convert_delayed(module, config, module_filter_fn)
    engine = get_backend("ao")
    if engine.probe().available:
        return engine.convert_with_config(module, config.to_torchao(), None, module_filter_fn)
    if (ScalingType.DISABLED in config.scaling_types or config.enable_fsdp_float8_all_gather
            or config.recipe_name not in (None, "tensorwise")):
        engine.require()  # those need torchao itself: say how to install it
    warnings.warn(
        f"torchao is {engine.probe().reason}: dynamic float8 scaling runs on fp8plug's native engine "
        f"instead (install torchao with `{engine.install_hint}` for torchao's kernels).", UserWarning, stacklevel=3,
    )
    return _convert_native(module, config, module_filter_fn, ("dynamic",) * 3)


def _convert_delayed(module, config: Float8LinearConfig, module_filter_fn) -> ConversionReport:
    modes = tuple(t.value for t in config.scaling_types)
    return _convert_native(module, config, module_filter_fn, modes)


def _convert_native(module, config: Float8LinearConfig, module_filter_fn, modes) -> ConversionReport:
    """The native engine with a scaling mode per tensor and the config's delayed-scaling settings
    (everything else at FP8RecipeKwargs' defaults)."""
    options = dict(
        scaling=modes[0] if len(set(modes)) == 1 else modes,
        amax_history_len=config.delayed_scaling_config.history_len,
        amax_compute_algo=config.delayed_scaling_config.scale_fn_name,
    )
    return get_backend("native").convert_with_config(module, options, None, module_filter_fn)


def sync_float8_amax_and_scale_history(model: nn.Module) -> None:
    """The torchao seed's per-step sync for delayed scaling: ends the step now (amaxes reduced
    across ranks, histories and scales updated; fp8plug.sync_fp8_scaling). fp8plug would also do
    it by itself after the optimizer step, which then finds nothing left to do."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"sync_float8_amax_and_scale_history: expected an nn.Module, got {type(model).__name__}.")
    sync_fp8_scaling(model)


def precompute_float8_dynamic_scale_for_fsdp(model: nn.Module) -> None:
    """After an optimizer step under FSDP2 with float8 all-gather, compute every float8 weight's
    scale for the next all-gather in a single all-reduce (torchao's function). Does nothing for a
    model without such weights, or where torchao is not installed. fp8plug also does it by itself
    after every optimizer step that trains an ao-converted model (fp8plug.steps), so a call here
    after one only repeats that all-reduce."""
    engine = get_backend("ao")
    if engine.probe().available:
        end_step([model], [engine])
