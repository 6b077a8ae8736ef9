"""Float8 training entry points shaped like OLMo-core's and like torchao's own, on fp8plug engines.

OLMo-core's `Float8Config(...).apply_float8_linear(model)` runs on the `ao` engine; torchao's older
`convert_to_float8_training(model, config=Float8TrainingConfig(...))` on torchao where every tensor
is dynamic and on the native engine where one is DELAYED (torchao dropped delayed scaling in 0.10).
Each entry point only turns its config into an FP8RecipeKwargs and calls fp8plug.convert_model, so
conversion takes the one path every recipe takes. The functions keep torchao's names and arguments
on purpose, so torchao code runs with its import changed. docs/ao.md has the details.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, fields
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from fp8plug.api import convert_model, sync_fp8_scaling
from fp8plug.backends import get_backend
from fp8plug.backends.steps import end_step
from fp8plug.integrations.float8_training import (
    TORCHAO_CONVERTS_THE_HEAD,
    DelayedScalingConfig,
    Float8CastConfig,
    Float8ScalingType,
    Float8TrainingConfig,
    is_torchao_float8_config,
    torchao_recipe,
)
from fp8plug.layers.rules import ConversionError
from fp8plug.recipe.kwargs import FP8RecipeKwargs

__all__ = [
    "AOFloat8LinearConfig",
    "AOFloat8LinearRecipe",
    "AOMXLinearConfig",
    "DelayedScalingConfig",
    "Float8CastConfig",
    "Float8Config",
    "Float8ScalingType",
    "Float8TrainingConfig",
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
    from torchao.float8.config import CastConfig as AOCastConfig
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.config import ScalingType as AOScalingType

    if isinstance(value, AOCastConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(
            f"AOFloat8LinearConfig.{where}: give a torchao CastConfig or a dict of its fields, not {value!r}.")
    unknown = set(value) - {"scaling_type", "scaling_granularity", "target_dtype"}
    if unknown:
        raise ValueError(f"AOFloat8LinearConfig.{where}: unknown field(s) {sorted(unknown)}.")
    kwargs = {}
    try:
        if value.get("scaling_type") is not None:
            kwargs["scaling_type"] = AOScalingType(
                str(getattr(value["scaling_type"], "value", value["scaling_type"])).lower())
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
            raise ValueError(
                f"AOFloat8LinearConfig.{where}.target_dtype: {value['target_dtype']!r} is not a torch dtype.")
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

        from fp8plug.backends.ao.config import needs_emulation

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
    """OLMo-core's MX training config; served by torchao's MXFP8 training (fp8plug.backends.ao.config.
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
        from fp8plug.backends.ao.config import mx_training_config

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
                raise ValueError(f"Float8Config.ao_recipe: {self.ao_recipe!r} is not a torchao recipe; "
                                 f"use one of {allowed}.") from None
        if (self.ao is not None and not isinstance(self.ao, AOFloat8LinearConfig)
                and not is_torchao_float8_config(self.ao)):
            raise ValueError(f"Float8Config.ao: expected an AOFloat8LinearConfig (or a torchao Float8LinearConfig), "
                             f"got {type(self.ao).__name__}.")
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

        from fp8plug.backends.ao.config import build_float8_config, needs_emulation

        if self.ao_recipe is not None:
            return build_float8_config(AOConfig.from_recipe_name(self.ao_recipe.value), emulate=needs_emulation())
        if is_torchao_float8_config(self.ao):
            return self.ao
        return (self.ao or AOFloat8LinearConfig()).to_ao_type()

    @property
    def should_precompute_float8_dynamic_scale_for_fsdp(self) -> bool:
        """Whether weights all-gather in float8 under FSDP2, so scales should be precomputed after
        each optimizer step (precompute_float8_dynamic_scale_for_fsdp)."""
        if not self.enabled or self.ao_mx is not None or self.ao_recipe is not None:
            return False
        return bool(self.float8_linear_config().enable_fsdp_float8_all_gather)

    def to_recipe(self, *, modules_to_ignore: Optional[Sequence[str]] = None) -> FP8RecipeKwargs:
        """The FP8RecipeKwargs this config stands for, on the `ao` engine (what apply_float8_linear
        converts with; `enabled` is apply_float8_linear's to read). `ao_recipe` is the recipe's
        `scaling`; `ao` and `ao_mx` become a whole torchao config (`ao_config`). Every field the
        config speaks for is set, so no `ACCELERATE_FP8_*` variable changes it; `auto_filter`
        resolves as for fp8plug.convert_model. `modules_to_ignore` adds to the config's own.
        BackendUnavailableError where torchao is not installed."""
        self.validate()
        get_backend("ao").require()
        ignore = tuple(sorted(set(self.modules_to_ignore or ())
                              | set(_names(modules_to_ignore, "modules_to_ignore") or ())))
        if self.ao_mx is not None:
            return torchao_recipe(self.ao_mx.to_ao_type(), modules_to_ignore=ignore)
        if self.ao_recipe is None:
            return torchao_recipe(self.float8_linear_config(), modules_to_ignore=ignore)
        name = self.ao_recipe.value
        return FP8RecipeKwargs(
            backend="ao", scaling=name, modules_to_ignore=ignore,
            # torchao's recipe as it is: tensorwise's own format is HYBRID (the ao engine applies a
            # format to the rowwise recipes, E4M3 throughout, only when one is set), nothing overridden
            fp8_format="HYBRID" if name == "tensorwise" else None, override_linear_precision=(False, False, False),
            pad_inner_dim=False, enable_fsdp_float8_all_gather=False, fp8_output_head=TORCHAO_CONVERTS_THE_HEAD,
        )

    def apply_float8_linear(self, model: nn.Module, *, modules_to_ignore: Optional[Sequence[str]] = None):
        """Convert `model`'s Linear layers to torchao float8 (or MXFP8) layers, in place, through
        fp8plug.convert_model with `to_recipe`'s recipe.

        Call it before torch.compile, activation checkpointing and FSDP/DDP wrapping. Names in
        `modules_to_ignore` (and the config's) must each name a Linear layer of `model` exactly.
        Frozen parameters stay frozen. Returns the ConversionReport, or None when disabled.
        """
        if not self.enabled:
            return None
        recipe = self.to_recipe(modules_to_ignore=modules_to_ignore)
        _check_linear_names(model, recipe.modules_to_ignore)
        return convert_model(model, recipe=recipe)


def _names(value, where: str) -> Optional[List[str]]:
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"{where}: give a list of fully-qualified module names, not {value!r}.")
    return list(value)


def _check_linear_names(model: nn.Module, names: Sequence[str]) -> None:
    """OLMo-core's names are Linear layers: refuse one that names another module. A name that
    matches nothing is reported by the shared conversion rules (fp8plug.layers.rules)."""
    modules = dict(model.named_modules())
    not_linear = [n for n in names if n in modules and not isinstance(modules[n], nn.Linear)]
    if not_linear:
        raise ConversionError(
            f"modules_to_ignore names {not_linear}, which are not Linear layers; names match exactly, so "
            "list each Linear layer to keep in high precision."
        )


# --- torchao's seed shape ---------------------------------------------------------------------------


def convert_to_float8_training(
    module: nn.Module,
    *,
    module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
    config=None,
) -> nn.Module:
    """Swap `module`'s eligible nn.Linear layers for float8 training layers, in place; returns it.

    `config`: a fp8plug.integrations.float8.Float8TrainingConfig (default: all tensors DYNAMIC) or a torchao
    Float8LinearConfig. Dynamic configs run on torchao (the `ao` engine); any DELAYED tensor puts
    every converted layer on fp8plug's native engine (NativeFP8Linear with per-tensor modes).
    `module_filter_fn(module, fqn)` returning False keeps a layer in high precision; layers whose
    in or out features are not divisible by 16 stay too. The config becomes an FP8RecipeKwargs
    (Float8TrainingConfig.to_recipe) that fp8plug.convert_model converts with.
    """
    config = Float8TrainingConfig() if config is None else config
    if is_torchao_float8_config(config):
        recipe = torchao_recipe(config, module_filter_fn)
    elif isinstance(config, Float8TrainingConfig):
        recipe = config.to_recipe(module_filter_fn)
    else:
        raise ValueError(
            "convert_to_float8_training: config must be a fp8plug.integrations.float8.Float8TrainingConfig "
            "or a torchao "
            f"Float8LinearConfig, not {type(config).__name__}."
        )
    convert_model(module, recipe=recipe)
    return module


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
    after every optimizer step that trains an ao-converted model (fp8plug.backends.steps), so a call here
    after one only repeats that all-reduce."""
    engine = get_backend("ao")
    if engine.probe().available:
        end_step([model], [engine])


# --- the old names ----------------------------------------------------------------------------------

# fp8plug's classes that used to carry torchao's own names, so that two different classes answered
# to one name; the old names still import (torchao's README code uses them), with a warning, and
# will be removed
_RENAMED = {"ScalingType": "Float8ScalingType", "CastConfig": "Float8CastConfig",
            "Float8LinearConfig": "Float8TrainingConfig"}


def __getattr__(name):
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(
            f"fp8plug.integrations.float8.{name} is deprecated: it is fp8plug's class, not torchao.float8.{name}, and "
            f"has been renamed fp8plug.integrations.float8.{new}; the old name will be removed.",
            DeprecationWarning, stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
