"""The config of `fp8plug.integrations.float8.convert_to_float8_training`, and the FP8RecipeKwargs it stands for.

torchao's float8 README from before 0.10 configures per-tensor `CastConfig(scaling_type=DYNAMIC |
DELAYED)`; torchao has since dropped DELAYED, so fp8plug keeps that vocabulary in its own classes,
named apart from torchao's: `Float8ScalingType`, `Float8CastConfig`, `Float8TrainingConfig`.
`Float8TrainingConfig.to_recipe` is the whole translation: which engine serves the config, with
which FP8RecipeKwargs fields, so conversion takes fp8plug.convert_model's path.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

from fp8plug.backends import get_backend
from fp8plug.recipe.kwargs import DEFAULTS, FP8RecipeKwargs

# torchao's float8 recipe names, in the order torchao documents them
RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

# torchao's converters (and OLMo-core's, on them) convert every Linear their filter lets through, the
# output head included; the entry points shaped like them keep that, where fp8plug's own ways in
# keep the head in high precision unless asked (FP8RecipeKwargs.fp8_output_head)
TORCHAO_CONVERTS_THE_HEAD = True


class Float8ScalingType(enum.Enum):
    """How one tensor is scaled to float8: from its own amax (DYNAMIC), from a history of past
    amaxes (DELAYED, served by fp8plug's native engine), or not cast at all (DISABLED, torchao).
    Was `fp8plug.integrations.float8.ScalingType`, a name torchao uses for its own enum (no DELAYED)."""

    DYNAMIC = "dynamic"
    DELAYED = "delayed"
    DISABLED = "disabled"


@dataclass(frozen=True)
class Float8CastConfig:
    """How to cast one tensor (input, weight or grad_output) to float8. Was
    `fp8plug.integrations.float8.CastConfig`, a name torchao uses for its own (different) class."""

    scaling_type: Float8ScalingType = Float8ScalingType.DYNAMIC

    def __post_init__(self):
        if not isinstance(self.scaling_type, Float8ScalingType):
            raise ValueError(
                "Float8CastConfig.scaling_type: expected Float8ScalingType.DYNAMIC, DELAYED or DISABLED, "
                f"got {self.scaling_type!r}."
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
            raise ValueError(
                f"DelayedScalingConfig.scale_fn_name: use 'max' or 'most_recent', not {self.scale_fn_name!r}.")


@dataclass(frozen=True)
class Float8TrainingConfig:
    """The torchao README's float8 Linear config: a Float8CastConfig per tensor (E4M3 input and
    weight, E5M2 grad_output), delayed-scaling settings, and torchao's per-linear switches. Was
    `fp8plug.integrations.float8.Float8LinearConfig`, a name torchao uses for its own config.

    enable_amax_init / enable_pre_and_post_forward were torchao workarounds for delayed scaling
    under autocast + compile + FSDP; the native engine initialises each scale from the first amax
    and updates its history after each optimizer step, so it needs neither: both are accepted and
    have no effect. emulate and pad_inner_dim apply to dynamic (torchao) configs.

    `recipe_name` names one of torchao's float8 recipes ("tensorwise", "rowwise",
    "rowwise_with_gw_hp") instead of cast configs: `Float8TrainingConfig.from_recipe_name(name)`,
    as torchao spells it. Rowwise scaling needs torchao itself; tensorwise runs on fp8plug's
    native engine (dynamic scaling) where torchao is not installed.
    """

    cast_config_input: Float8CastConfig = field(default_factory=Float8CastConfig)
    cast_config_weight: Float8CastConfig = field(default_factory=Float8CastConfig)
    cast_config_grad_output: Float8CastConfig = field(default_factory=Float8CastConfig)
    enable_amax_init: bool = True
    enable_pre_and_post_forward: bool = True
    enable_fsdp_float8_all_gather: bool = False
    pad_inner_dim: bool = False
    emulate: bool = False
    delayed_scaling_config: DelayedScalingConfig = field(default_factory=DelayedScalingConfig)
    recipe_name: Optional[str] = None

    @staticmethod
    def from_recipe_name(recipe_name) -> "Float8TrainingConfig":
        """The config for one of torchao's float8 recipe names ("tensorwise", "rowwise",
        "rowwise_with_gw_hp"; a string or a torchao Float8LinearRecipeName), as torchao's
        Float8LinearConfig.from_recipe_name."""
        return Float8TrainingConfig(recipe_name=recipe_name)

    def __post_init__(self):
        if self.recipe_name is not None:
            object.__setattr__(self, "recipe_name", _recipe_name(self.recipe_name))
            if any(t is not Float8ScalingType.DYNAMIC for t in self.scaling_types):
                raise ValueError(
                    f"Float8TrainingConfig: recipe_name={self.recipe_name!r} sets every cast itself; leave "
                    "cast_config_input/weight/grad_output at their defaults, "
                    "or give cast configs without a recipe_name."
                )
        for name in ("cast_config_input", "cast_config_weight", "cast_config_grad_output"):
            if not isinstance(getattr(self, name), Float8CastConfig):
                raise ValueError(
                    f"Float8TrainingConfig.{name}: expected a fp8plug.integrations.float8.Float8CastConfig, "
                    f"got {getattr(self, name)!r}."
                )
        if self.delayed and Float8ScalingType.DISABLED in self.scaling_types:
            raise ValueError(
                "Float8TrainingConfig: DELAYED and DISABLED cannot be mixed (delayed scaling runs on fp8plug's "
                "native engine, which casts all three tensors); use DYNAMIC instead of DISABLED."
            )
        if self.delayed and self.enable_fsdp_float8_all_gather:
            raise ValueError(
                "Float8TrainingConfig.enable_fsdp_float8_all_gather: float8 all-gather needs dynamic weight "
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
        return Float8ScalingType.DELAYED in self.scaling_types

    def to_torchao(self):
        """The equivalent torchao Float8LinearConfig (dynamic or disabled tensors only)."""
        from torchao.float8 import CastConfig as AOCastConfig
        from torchao.float8 import Float8LinearConfig as AOConfig
        from torchao.float8 import ScalingType as AOType

        if self.delayed:
            raise ValueError("Float8TrainingConfig: torchao has no delayed scaling (removed in 0.10); "
                             "the native engine serves it.")
        if self.recipe_name is not None:
            from fp8plug.backends.ao.config import build_float8_config, needs_emulation

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
                f"Float8TrainingConfig: torchao rejected it ({exc}); a GEMM's two operands must both be "
                "cast or both be DISABLED (input and weight for the output, grad_output and weight, "
                "grad_output and input for the gradients)."
            ) from None

    def to_recipe(self, module_filter_fn: Optional[Callable] = None) -> FP8RecipeKwargs:
        """The FP8RecipeKwargs this config stands for (what convert_to_float8_training converts
        with): all-dynamic configs on torchao (`ao_config`, this config's torchao equivalent);
        any DELAYED tensor on the native engine with a scaling mode per tensor and this config's
        history settings; an all-dynamic tensorwise config on the native engine, with a warning,
        where torchao is not installed (anything else needs torchao: BackendUnavailableError).

        Every field the config speaks for is set, so `ACCELERATE_FP8_*` variables cannot change
        it; the speed filter (`auto_filter`) resolves as for fp8plug.convert_model."""
        if not self.delayed:
            engine = get_backend("ao")
            if engine.probe().available:
                return torchao_recipe(self.to_torchao(), module_filter_fn)
            if (Float8ScalingType.DISABLED in self.scaling_types or self.enable_fsdp_float8_all_gather
                    or self.recipe_name not in (None, "tensorwise")):
                engine.require()  # those need torchao itself: say how to install it
            warnings.warn(
                f"torchao is {engine.probe().reason}: dynamic float8 scaling runs on fp8plug's native engine "
                f"instead (install torchao with `{engine.install_hint}` for torchao's kernels).", UserWarning,
                stacklevel=3,
            )
        return FP8RecipeKwargs(
            backend="native",
            scaling=tuple(t.value for t in self.scaling_types),  # the recipe makes three equal modes one
            amax_history_len=self.delayed_scaling_config.history_len,
            amax_compute_algo=self.delayed_scaling_config.scale_fn_name,
            **{name: DEFAULTS[name] for name in ("fp8_format", "margin", "interval", "override_linear_precision",
                                                 "reduce_amax")},
            modules_to_ignore=(), module_filter_fn=module_filter_fn, fp8_output_head=TORCHAO_CONVERTS_THE_HEAD,
        )


def torchao_recipe(config, module_filter_fn: Optional[Callable] = None, modules_to_ignore=()) -> FP8RecipeKwargs:
    """The recipe for a whole torchao config (a Float8LinearConfig or its MXFP8 training config),
    taken as is: `ao_config` on the `ao` engine, no other field of the config's set explicitly, so
    nothing from the environment is applied on top of it; the output head converts with the rest
    (TORCHAO_CONVERTS_THE_HEAD)."""
    return FP8RecipeKwargs(backend="ao", ao_config=config, modules_to_ignore=tuple(modules_to_ignore),
                           module_filter_fn=module_filter_fn, fp8_output_head=TORCHAO_CONVERTS_THE_HEAD)


def is_torchao_float8_config(value) -> bool:
    """Whether `value` is torchao's own Float8LinearConfig (checked by name: torchao may not be
    importable where fp8plug's configs are used)."""
    cls = type(value)
    return cls.__name__ == "Float8LinearConfig" and cls.__module__.startswith("torchao.")


def _recipe_name(value) -> str:
    """A torchao float8 recipe name from a string or an enum member, checked."""
    text = str(getattr(value, "value", value)).strip().lower()
    if text not in RECIPE_NAMES:
        raise ValueError(
            f"Float8TrainingConfig.recipe_name: {value!r} is not a torchao float8 recipe; use one of "
            f"{', '.join(RECIPE_NAMES)}."
        )
    return text


__all__ = ["DelayedScalingConfig", "Float8CastConfig", "Float8ScalingType", "Float8TrainingConfig", "RECIPE_NAMES",
           "is_torchao_float8_config", "torchao_recipe"]
