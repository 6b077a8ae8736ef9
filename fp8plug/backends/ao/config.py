"""torchao float8 and MXFP8 training configs built from plain fields, and whether this machine
must emulate FP8 GEMMs.

Shared by the `ao` engine (FP8RecipeKwargs -> torchao Float8LinearConfig) and fp8plug.integrations.float8
(torchao- and OLMo-core-shaped configs), so each mapping is written once. No engine lives here;
torchao is imported only inside the functions that build its objects.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Tuple

import torch

MX_BLOCK = 32  # MXFP8 scales blocks of 32 elements


# --- when the hardware needs emulation -------------------------------------------------------------


def needs_emulation() -> bool:
    """True on a machine with no CUDA GPU: there torchao emulates its FP8 GEMMs (dequantise, then
    an fp32 matmul) rather than call torch's CPU `_scaled_mm`, which on some CPUs (AMX Xeons) runs
    oneDNN's reference kernel, hundreds of times slower than bf16 (fp8plug.backends.gemm)."""
    return not torch.cuda.is_available()


# --- the recipe -> torchao config mapping ----------------------------------------------------------


def _gemm_operands():
    """For each GEMM, the two Float8LinearConfig cast-config fields feeding it (torchao's layout:
    output = input @ weight.T, grad_input = grad_output @ weight, grad_weight = grad_output.T @ input)."""
    return {
        "fprop": ("cast_config_input", "cast_config_weight"),
        "dgrad": ("cast_config_grad_output", "cast_config_weight_for_grad_input"),
        "wgrad": ("cast_config_grad_output_for_grad_weight", "cast_config_input_for_grad_weight"),
    }


def build_float8_config(
    base,
    *,
    fp8_format: Optional[str] = None,
    override_linear_precision: Tuple[bool, bool, bool] = (False, False, False),
    enable_fsdp_float8_all_gather: Optional[bool] = None,
    pad_inner_dim: Optional[bool] = None,
    emulate: Optional[bool] = None,
):
    """A torchao Float8LinearConfig: `base` with the given changes (None keeps base's value).

    fp8_format: "HYBRID" casts grad_output to E5M2 and input and weight to E4M3, "E4M3" casts all
    three to E4M3. override_linear_precision (fprop, dgrad, wgrad): True runs that GEMM on its
    unscaled high-precision operands (both its cast configs set to ScalingType.DISABLED).
    """
    from torchao.float8.config import CastConfig, ScalingType, e4m3_dtype, e5m2_dtype

    casts = {name: getattr(base, name) for names in _gemm_operands().values() for name in names}
    if fp8_format is not None:
        grad_dtype = e5m2_dtype if fp8_format == "HYBRID" else e4m3_dtype
        for name, cast in casts.items():
            dtype = grad_dtype if "grad_output" in name else e4m3_dtype
            casts[name] = dataclasses.replace(cast, target_dtype=dtype)
    for flag, names in zip(override_linear_precision, _gemm_operands().values()):
        if flag:
            for name in names:
                # DISABLED takes tensorwise granularity; the dtype must stay to match the other GEMM.
                casts[name] = CastConfig(scaling_type=ScalingType.DISABLED, target_dtype=casts[name].target_dtype)
    changes = dict(casts)
    for name, value in (("enable_fsdp_float8_all_gather", enable_fsdp_float8_all_gather),
                        ("pad_inner_dim", pad_inner_dim), ("emulate", emulate)):
        if value is not None:
            changes[name] = value
    try:
        return dataclasses.replace(base, **changes)
    except AssertionError as exc:  # torchao checks its configs with assert
        raise ValueError(f"torchao rejected the float8 config: {exc}") from None


def float8_all_gather_problem(config) -> Optional[str]:
    """Why `config` cannot all-gather weights in float8 under FSDP2, or None."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    weight = config.cast_config_weight
    if weight.scaling_type is not ScalingType.DYNAMIC:
        return "the forward GEMM's weight is not cast to float8 (override_linear_precision[0])"
    if weight.scaling_granularity is not ScalingGranularity.TENSORWISE:
        return "torchao all-gathers float8 weights with tensorwise scales only, not rowwise"
    return None


def scaling_of(config) -> str:
    """The scaling a whole torchao config gives, for the log line and checkpoints: "mxfp8" for an
    MXFP8 training config, the torchao recipe name whose casts it has, or "custom"."""
    if is_mx_training_config(config):
        return "mxfp8"
    from torchao.float8 import Float8LinearConfig

    casts = [name for names in _gemm_operands().values() for name in names]
    for name in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        named = Float8LinearConfig.from_recipe_name(name)
        if all(getattr(config, c) == getattr(named, c) for c in casts):
            return name
    return "custom"


# --- MXFP8 ----------------------------------------------------------------------------------------


def is_mx_training_config(config) -> bool:
    """Whether `config` is torchao's MXFP8 training config (mx_training_config builds it), checked
    by name so torchao's prototype module is not imported to answer."""
    return type(config).__name__ == "MXFP8TrainingOpConfig"


def _dtype(value, field: str) -> Optional[torch.dtype]:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(getattr(value, "value", value)).replace("torch.", "")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"AOMXLinearConfig.{field}: {value!r} is not a torch dtype name such as 'float8_e4m3fn'.")
    return dtype


def _enum_value(value) -> Optional[str]:
    return None if value is None else str(getattr(value, "value", value)).lower()


def mx_support_problem(emulated: bool) -> Optional[str]:
    """Why MXFP8 training cannot run here, or None."""
    from torch.distributed.tensor import _dispatch, _ops

    if not (hasattr(_ops, "scaled_mm_single_dim_strategy") and hasattr(_dispatch, "is_pinned_handler")):
        return (f"torchao's MXFP8 training needs a newer torch (a nightly in torchao 0.18's time) "
                f"than {torch.__version__}")
    if emulated:
        return None
    if not torch.cuda.is_available():
        return "MXFP8 GEMMs need a CUDA GPU with compute capability 10.0 (Blackwell); none is visible"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (10, 0):
        return f"MXFP8 GEMMs need compute capability 10.0 (Blackwell), this GPU has {major}.{minor}"
    return None


def mx_training_config(
    block_size=None,
    elem_dtype=None,
    elem_dtype_weight_override=None,
    elem_dtype_grad_output_override=None,
    kernel_preference=None,
    mxfp8_cast_kernel_choice=None,
    scale_calculation_mode=None,
):
    """torchao's MXFP8TrainingOpConfig for OLMo-core's MXLinearConfig fields, refusing what
    torchao 0.18 cannot train: blocks other than 32, elements other than E4M3 (MXFP4 training is
    not offered for linears), and hardware or torch versions that cannot run it.

    kernel_preference None picks "auto" (real MXFP8 GEMMs) where a CUDA GPU is visible and
    "emulated" (dequantise, then a high-precision matmul; slow, for development) where none is.
    """
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    if block_size not in (None, MX_BLOCK):
        raise ValueError(
            f"AOMXLinearConfig.block_size: torchao's MXFP8 training uses blocks of 32, not {block_size!r}.")
    for field, value in (("elem_dtype", elem_dtype), ("elem_dtype_weight_override", elem_dtype_weight_override),
                         ("elem_dtype_grad_output_override", elem_dtype_grad_output_override)):
        dtype = _dtype(value, field)
        if dtype not in (None, torch.float8_e4m3fn):
            raise ValueError(
                f"AOMXLinearConfig.{field}: torchao {__import__('torchao').__version__} trains linears in MXFP8 "
                f"(float8_e4m3fn elements) only, not {dtype}; MXFP4 training is not offered. Use float8_e4m3fn or None."
            )
    kernel = _enum_value(kernel_preference)
    if kernel is None:
        kernel = "auto" if torch.cuda.is_available() else "emulated"
    if kernel not in ("auto", "emulated"):
        raise ValueError(f"AOMXLinearConfig.kernel_preference: use 'auto' or 'emulated' for MXFP8 training, "
                         f"not {kernel_preference!r}.")
    choice = _enum_value(mxfp8_cast_kernel_choice)
    if choice not in (None, "cuda"):
        warnings.warn(
            f"AOMXLinearConfig.mxfp8_cast_kernel_choice={choice!r} is ignored: torchao's MXFP8 training "
            "chooses its cast kernels itself.", UserWarning, stacklevel=3,
        )
    mode = _enum_value(scale_calculation_mode) or "rceil"
    try:
        mode = ScaleCalculationMode(mode)
    except ValueError:
        allowed = ", ".join(m.value for m in ScaleCalculationMode)
        raise ValueError(
            f"AOMXLinearConfig.scale_calculation_mode: {scale_calculation_mode!r}; use one of {allowed}.") from None
    problem = mx_support_problem(emulated=kernel == "emulated")
    if problem:
        raise RuntimeError(
            f"MXFP8 training cannot run here: {problem}. Use float8 (ao or ao_recipe) instead, or "
            "kernel_preference='emulated' to develop on other hardware (slow)."
        )
    return MXFP8TrainingOpConfig(kernel_preference=KernelPreference(kernel), scale_calculation_mode=mode)
