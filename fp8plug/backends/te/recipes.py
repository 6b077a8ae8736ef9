"""Private helper of the te engine (fp8plug/backends/te/engine.py): specifying TransformerEngine recipes.

The engine's plan (engine.TEPlan) -> which TE recipe class, with which arguments, and what the
installed TE cannot honour (`te_recipe_spec`, pure, so it is tested without TE); which scalings a
GPU can run (`scaling_hardware_problem`); TE 2.x's missing `interval` (`IntervalScaling`).
Imported by the engine and te/layers.py only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from fp8plug.recipe.scalings import DELAYED_DEFAULTS, delayed_values

RECIPE_CLASSES = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "block": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
    "nvfp4": "NVFP4BlockScaling",
}
DEFAULT_OVERRIDE = (False, False, False)
BACKWARD_HIGH_PRECISION = (False, True, True)


# --- warnings, once per process --------------------------------------------------------------------

_WARNED: set = set()


def warn_once(message: str) -> None:
    """warnings.warn(message) the first time this process sees `message`."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


# --- recipes: a pure specification (testable without TE), then building ----------------------------


@dataclass(frozen=True)
class TERecipeSpec:
    """Which TE recipe class to build, with which arguments, and what this TE cannot honour.

    `kwargs` holds plain values (fp8_format as a name, "HYBRID" or "E4M3"); `interval` > 1 asks the
    builder for an IntervalScaling scaling_factor_compute_algo; `notes` are (field, value, why)
    for the fields the installed TE cannot honour (the engine words them as every ignored field is).
    """

    scaling: str
    class_name: str
    kwargs: Tuple[Tuple[str, Any], ...]
    interval: int = 1
    notes: Tuple[Tuple[str, Any, str], ...] = ()

    def kwargs_dict(self) -> Dict[str, Any]:
        return dict(self.kwargs)


def te_recipe_spec(plan, fields: Mapping[str, frozenset], te_version: str = "?") -> TERecipeSpec:
    """Map a te.TEPlan to a TE recipe, given the installed TE's recipe classes and their
    dataclass fields (`fields`: class name -> field names; old TE has fields new TE dropped).
    The plan holds only what the engine honours under its scaling: fp8_format None keeps the
    TE recipe's own format."""
    scaling = plan.scaling
    class_name = RECIPE_CLASSES[scaling]
    if class_name not in fields:
        raise ValueError(
            f"FP8RecipeKwargs.scaling: {scaling!r} needs transformer_engine.common.recipe.{class_name}, "
            f"which TransformerEngine {te_version} does not have; upgrade TransformerEngine "
            "(pip install --upgrade \"transformer_engine[pytorch]\") or choose another scaling."
        )
    have = fields[class_name]
    kwargs: Dict[str, Any] = {}
    notes = []
    interval = 1
    if plan.fp8_format is not None:
        kwargs["fp8_format"] = plan.fp8_format

    if scaling == "delayed":  # delayed scaling's settings go to TE's DelayedScaling under their own names
        for name, value in delayed_values(plan).items():
            default = value == DELAYED_DEFAULTS[name]
            if name == "interval" and not default and name not in have:  # TE 2.x dropped it; a hook does it
                if "scaling_factor_compute_algo" in have:
                    interval = value
                else:
                    notes.append((name, value, f"TransformerEngine {te_version} recomputes delayed "
                                  "scaling factors every step and has no hook to change that"))
            elif default and name in ("interval", "reduce_amax"):
                continue  # TE's default too (and TE 2.x has no interval)
            elif name in have:
                kwargs[name] = value
            elif not default:
                notes.append((name, value, f"TransformerEngine {te_version}'s DelayedScaling has no such setting"))
    elif scaling == "mxfp8" and "margin" in have and plan.margin:
        kwargs["margin"] = plan.margin

    override = tuple(plan.override_linear_precision)
    if override != DEFAULT_OVERRIDE:
        if "override_linear_precision" in have:
            kwargs["override_linear_precision"] = override
        elif override == BACKWARD_HIGH_PRECISION and scaling != "delayed" and "backward_override" in have:
            kwargs["backward_override"] = "high_precision"
        else:
            hint = (
                "; use scaling='current' (or 'block') with override_linear_precision=(False, True, True) "
                "to run both backward GEMMs in high precision"
                if override == BACKWARD_HIGH_PRECISION
                else "; TransformerEngine 2.x can only run dgrad and wgrad together in high precision "
                "(override_linear_precision=(False, True, True), not with delayed scaling); for fprop, leave "
                "the layer out of FP8 with modules_to_ignore"
            )
            notes.append(("override_linear_precision", override, f"{class_name} in TransformerEngine {te_version} "
                          f"cannot run that GEMM alone in high precision{hint}"))
    return TERecipeSpec(scaling, class_name, tuple(sorted(kwargs.items())), interval, tuple(notes))


def _version_tuple(text: Optional[str]) -> Tuple[int, ...]:
    parts = []
    for piece in str(text or "0").split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or (0,)


def scaling_hardware_problem(scaling: str, capability: Tuple[int, int], cuda_version: Optional[str],
                             gpu: str = "this GPU") -> Optional[str]:
    """Why `scaling` cannot run on a GPU of this compute capability and CUDA version, or None."""
    major, minor = capability
    sm = f"sm_{major}{minor}"
    others = "use scaling='delayed', 'current' or 'block' on it"
    if scaling in ("delayed", "current"):
        if capability < (8, 9):
            return (
                f"FP8RecipeKwargs.scaling={scaling!r} needs FP8 tensor cores (compute capability 8.9 or "
                f"newer: Ada, Hopper, Blackwell); {gpu} is {sm}."
            )
        return None
    if scaling == "block":
        if capability < (9, 0):
            return (f"FP8RecipeKwargs.scaling='block' needs compute capability 9.0 or newer (Hopper); "
                    f"{gpu} is {sm}. Use scaling='delayed' or 'current'.")
        if cuda_version is not None and _version_tuple(cuda_version)[:2] < (12, 9):
            return (f"FP8RecipeKwargs.scaling='block' needs CUDA 12.9 or newer; this torch is built "
                    f"for CUDA {cuda_version}. Use scaling='delayed' or 'current'.")
        return None
    if scaling == "mxfp8":
        if not (10, 0) <= capability < (12, 0):
            return (f"FP8RecipeKwargs.scaling='mxfp8' needs a Blackwell data-center GPU (compute "
                    f"capability 10.x, sm_100); {gpu} is {sm}: {others}.")
        return None
    if scaling == "nvfp4":
        if capability < (10, 0):
            return (f"FP8RecipeKwargs.scaling='nvfp4' needs a Blackwell GPU (compute capability 10.0 or "
                    f"newer, sm_100); {gpu} is {sm}: {others}.")
        return None
    raise ValueError(f"FP8RecipeKwargs.scaling: unknown TransformerEngine scaling {scaling!r}.")


class IntervalScaling:
    """DelayedScaling.scaling_factor_compute_algo that recomputes a scale every `interval` updates
    (the `interval` field TE 2.x removed), with TE's own formula and edge cases otherwise:
    scale = fp8_max / amax / 2**margin, kept where amax is 0 or not finite, float32 max where
    it overflows. Counts are per scale tensor (one per module and direction).

    With it TE takes its unfused per-module update path, which costs a little speed; it is used
    only when interval > 1 is asked for. The counts restart when the process does.
    """

    def __init__(self, interval: int):
        if int(interval) < 1:
            raise ValueError(f"FP8RecipeKwargs.interval: {interval!r} is not allowed; use an integer >= 1.")
        self.interval = int(interval)
        self.counts: Dict[int, int] = {}

    def __call__(self, amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, recipe) -> torch.Tensor:
        key = scale.data_ptr()
        count = self.counts.get(key, 0)
        self.counts[key] = count + 1
        if count % self.interval:
            return scale
        new = (fp8_max / amax) / (2 ** int(getattr(recipe, "margin", 0)))
        new = torch.where(amax > 0.0, new, scale)
        new = torch.where(torch.isfinite(amax), new, scale)
        return torch.where(torch.isinf(new), torch.full_like(new, torch.finfo(torch.float32).max), new)

    def __repr__(self) -> str:
        return f"IntervalScaling(interval={self.interval})"


def recipe_kind(te_recipe) -> str:
    """"mxfp8", "nvfp4", or "fp8" (per-tensor and block scaling): what an FP8 GEMM input must align to."""
    for kind in ("mxfp8", "nvfp4"):
        check = getattr(te_recipe, kind, None)
        if callable(check) and check():
            return kind
    return "fp8"
