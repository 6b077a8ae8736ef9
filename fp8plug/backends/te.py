"""The `te` engine: NVIDIA TransformerEngine (`transformer_engine.pytorch`), 2.x.

What it does, and why:

- Conversion swaps nn.Linear for te.Linear, nn.LayerNorm for te.LayerNorm and nn.RMSNorm for
  te.RMSNorm under the shared rules of fp8plug.convert. The new modules take over the very same
  Parameter objects (weights are bit-identical, tied weights stay tied, an optimizer built before
  conversion stays valid; device and dtype are kept). te.Linear(bias=False) has an empty tensor
  as `bias`, not None; unconvert turns that back into None. te.LayerNorm always has a learnable
  weight and bias and te.RMSNorm a weight, so a norm without them is skipped with that reason
  (converting it would add parameters the optimizer and checkpoints do not know).
  nn.RMSNorm(eps=None) means "the input dtype's eps"; TE needs a number, so it gets the
  parameters' dtype eps, and unconvert restores None.
- Converted Linears are `TELinear`, a te.Linear subclass with two additions:
  1. A forward whose token count TE's FP8 GEMMs would reject (not divisible by 16, e.g. 7 tokens
     in generation or an odd length from dynamic padding; 32 for MXFP8; see gemm_alignment) runs in
     FP8 all the same: the tokens are zero-padded up to the multiple and the padding rows sliced
     off the output (backends.padding: the real rows' outputs and gradients are unchanged).
     An input whose features do not fit, or that is not a plain tensor, runs that layer in high
     precision instead of raising ValueError. The check is per layer, at the layer, with TE's
     own rule, rather than on the model's first argument: what a Linear sees (after reshapes,
     padding, prefixes) is not knowable from the top-level input, and catching TE's ValueError
     would mean re-running a half-done forward.
  2. Gradient accumulation: inside `TEBackend.microbatch(is_first)` each TELinear gets
     `is_first_microbatch=is_first` unless the caller passes it. True on the first micro-batch
     after an optimizer step, False on the others: TE then quantizes each weight once per step
     and reuses the FP8 copy. Never leave it False across an optimizer step (stale weights).
- Recipes come from FP8RecipeKwargs (`plan_te_recipe`, pure, so it is tested without TE):
  "delayed" -> DelayedScaling(margin, fp8_format, amax_history_len, amax_compute_algo);
  "current" -> Float8CurrentScaling; "block" -> Float8BlockScaling (sm_90+, CUDA >= 12.9);
  "mxfp8" -> MXFP8BlockScaling and "nvfp4" -> NVFP4BlockScaling (sm_100: refused elsewhere).
  Fields TE 2.x dropped: `interval` > 1 is honoured through DelayedScaling's
  scaling_factor_compute_algo (`IntervalScaling`); override_linear_precision=(False, True, True)
  becomes backward_override="high_precision" on recipes that have it. Anything TE cannot do is
  warned about once per process, never dropped silently.
- Checkpoints: `plain_state_dict` drops TE's `_extra_state` entries; converted modules carry a
  load_state_dict pre-hook that supplies them, so a plain checkpoint loads strictly.
  `fp8_state` / `load_fp8_state` carry the delayed-scaling amax histories and scales as plain
  tensors (TE 2.x refuses to unpickle its own `_extra_state` unless told it is trusted).

`import fp8plug` never imports TransformerEngine; this file imports it only when asked to.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from ..convert import ALIGNMENT, ConversionReport, linear_alignment_problem, plan_conversion, replace_module, swap_modules
from .base import Backend, Probe, probe_import
from .padding import pad_tokens

TE_MODULE = "transformer_engine.pytorch"
RECIPE_CLASSES = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "block": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
    "nvfp4": "NVFP4BlockScaling",
}
TE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_OVERRIDE = (False, False, False)
BACKWARD_HIGH_PRECISION = (False, True, True)
EXTRA_STATE = "_extra_state"  # torch's suffix for get_extra_state entries


# --- warnings, once per process --------------------------------------------------------------------

_WARNED: set = set()


def warn_once(message: str) -> None:
    """warnings.warn(message) the first time this process sees `message`."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


# --- recipes: pure planning (testable without TE), then building -------------------------------------


@dataclass(frozen=True)
class TERecipePlan:
    """Which TE recipe class to build, with which arguments, and what could not be honoured.

    `kwargs` holds plain values (fp8_format as a name, "HYBRID" or "E4M3"); `interval` > 1 asks the
    builder for an IntervalScaling scaling_factor_compute_algo; `warnings` are the messages about
    fields TE cannot honour.
    """

    scaling: str
    class_name: str
    kwargs: Tuple[Tuple[str, Any], ...]
    interval: int = 1
    warnings: Tuple[str, ...] = ()

    def kwargs_dict(self) -> Dict[str, Any]:
        return dict(self.kwargs)


def plan_te_recipe(recipe, scaling: str, fields: Mapping[str, frozenset], te_version: str = "?") -> TERecipePlan:
    """Map an FP8RecipeKwargs to a TE recipe, given the installed TE's recipe classes and their
    dataclass fields (`fields`: class name -> field names; old TE has fields new TE dropped)."""
    class_name = RECIPE_CLASSES[scaling]
    if class_name not in fields:
        raise ValueError(
            f"FP8RecipeKwargs.scaling: {scaling!r} needs transformer_engine.common.recipe.{class_name}, "
            f"which TransformerEngine {te_version} does not have; upgrade TransformerEngine "
            "(pip install --upgrade \"transformer_engine[pytorch]\") or choose another scaling."
        )
    have = fields[class_name]
    explicit = getattr(recipe, "is_explicit", lambda name: True)
    kwargs: Dict[str, Any] = {}
    notes = []
    interval = 1

    if scaling == "delayed":
        kwargs.update(
            margin=recipe.margin, fp8_format=recipe.fp8_format, amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo,
        )
        if not getattr(recipe, "reduce_amax", True) and "reduce_amax" in have:
            kwargs["reduce_amax"] = False  # TE's own switch: amaxes reduced across the fp8 group or not
        if recipe.interval != 1:
            if "interval" in have:
                kwargs["interval"] = recipe.interval
            elif "scaling_factor_compute_algo" in have:
                interval = recipe.interval
            else:
                notes.append(
                    f"FP8RecipeKwargs.interval={recipe.interval} is ignored: TransformerEngine {te_version} "
                    "recomputes delayed scaling factors every step and has no hook to change that."
                )
    else:
        if scaling in ("current", "block", "mxfp8") and (scaling == "current" or explicit("fp8_format")):
            kwargs["fp8_format"] = recipe.fp8_format
        if scaling == "mxfp8" and "margin" in have and recipe.margin:
            kwargs["margin"] = recipe.margin
        if scaling == "nvfp4" and explicit("fp8_format") and recipe.fp8_format != "E4M3":
            notes.append(
                f"FP8RecipeKwargs.fp8_format={recipe.fp8_format!r} is ignored with scaling='nvfp4': NVFP4 "
                "stores E2M1 values with E4M3 block scales, whatever the format."
            )
        delayed_only = ["interval", "amax_history_len", "amax_compute_algo"]
        if scaling != "mxfp8":
            delayed_only.insert(0, "margin")
        for name in delayed_only:
            if explicit(name) and getattr(recipe, name) != _delayed_default(name):
                notes.append(
                    f"FP8RecipeKwargs.{name}={getattr(recipe, name)!r} is ignored with scaling={scaling!r}: "
                    "it only applies to delayed scaling (scaling='delayed')."
                )

    override = tuple(recipe.override_linear_precision)
    if override != DEFAULT_OVERRIDE:
        if "override_linear_precision" in have:
            kwargs["override_linear_precision"] = override
        elif override == BACKWARD_HIGH_PRECISION and scaling != "delayed" and "backward_override" in have:
            kwargs["backward_override"] = "high_precision"
        else:
            hint = (
                " Use scaling='current' (or 'block') with override_linear_precision=(False, True, True) "
                "to run both backward GEMMs in high precision."
                if override == BACKWARD_HIGH_PRECISION
                else " TransformerEngine 2.x can only run dgrad and wgrad together in high precision "
                "(override_linear_precision=(False, True, True), not with delayed scaling); for fprop, leave "
                "the layer out of FP8 with modules_to_ignore."
            )
            notes.append(
                f"FP8RecipeKwargs.override_linear_precision={override} is ignored: {class_name} in "
                f"TransformerEngine {te_version} cannot run that GEMM alone in high precision.{hint}"
            )
    return TERecipePlan(scaling, class_name, tuple(sorted(kwargs.items())), interval, tuple(notes))


def _delayed_default(name: str):
    from ..recipe import DEFAULTS

    return DEFAULTS[name]


def _version_tuple(text: Optional[str]) -> Tuple[int, ...]:
    parts = []
    for piece in str(text or "0").split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or (0,)


def scaling_hardware_problem(scaling: str, capability: Tuple[int, int], cuda_version: Optional[str], gpu: str = "this GPU") -> Optional[str]:
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
        if _version_tuple(cuda_version)[:2] < (12, 9):
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


def gemm_alignment(kind: str) -> Tuple[int, int]:
    """(token multiple, feature multiple) an FP8 GEMM input needs under a recipe kind. For FP8
    per-tensor and block scaling, TE's forward check (assert_dim_for_fp8_exec) takes tokens in
    multiples of 8, but the weight-gradient GEMM has the tokens as its leading dimension, which
    cuBLASLt wants in multiples of 16 (an H100 rejected 8-aligned padding with "lda % 16 == 0");
    MXFP8 has 32-element blocks, NVFP4 16-element blocks."""
    return {"mxfp8": (32, 32), "nvfp4": (16, 16)}.get(kind, (16, 16))


def fp8_input_fits(shape, kind: str = "fp8") -> bool:
    """Whether an input of this shape can go through TE's FP8 GEMM under a recipe kind as is."""
    if len(shape) < 2:
        return False
    tokens, features = gemm_alignment(kind)
    return math.prod(shape[:-1]) % tokens == 0 and shape[-1] % features == 0


def fp8_token_multiple(inp, kind: str = "fp8") -> Optional[int]:
    """How an input goes through TE's FP8 GEMM under a recipe kind: 1 as it is, a larger number:
    after padding its tokens up to a multiple of it, None: not at all (features misaligned, no
    token dimension or no rows, or tokens misaligned in a tensor that is not a plain one, such
    as TE's own quantized tensors, which are never padded)."""
    shape = tuple(inp.shape)
    if len(shape) < 2 or math.prod(shape[:-1]) == 0:
        return None
    tokens, features = gemm_alignment(kind)
    if shape[-1] % features:
        return None
    if math.prod(shape[:-1]) % tokens == 0:
        return 1
    return tokens if type(inp) in (torch.Tensor, nn.Parameter) else None


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


@dataclass
class NativeTERecipe:
    """A TransformerEngine recipe object passed as is (e.g. to contextual_fp8_autocast)."""

    te_recipe: Any
    use_autocast_during_eval: bool = False
    modules_to_ignore: Any = None
    module_filter_fn: Any = field(default=None, repr=False)


# --- TE's API, old names and new -------------------------------------------------------------------


@dataclass(frozen=True)
class TEApi:
    """TE's autocast and model-init contexts under whichever names the installed version has:
    `autocast(enabled, recipe, amax_reduction_group)` and `quantized_model_init(enabled, recipe)`
    (TE >= 2.8), or `fp8_autocast(enabled, fp8_recipe, fp8_group)` and `fp8_model_init(enabled,
    recipe)` (older, deprecated since)."""

    module: Any

    @property
    def new_names(self) -> bool:
        return callable(getattr(self.module, "autocast", None)) and hasattr(self.module, "quantized_model_init")

    def autocast(self, enabled: bool = True, recipe=None, group=None):
        if self.new_names:
            return self.module.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
        return self.module.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)

    def model_init(self, enabled: bool = True, recipe=None):
        if self.new_names:
            return self.module.quantized_model_init(enabled=enabled, recipe=recipe)
        return self.module.fp8_model_init(enabled=enabled, recipe=recipe)


def _te():
    """transformer_engine.pytorch, imported now (only ever called once the engine is in use)."""
    share_torch_cudnn()
    return importlib.import_module(TE_MODULE)


def torch_cudnn_dir() -> Optional[str]:
    """The folder of the cuDNN that torch ships with (the nvidia-cudnn wheel), or None."""
    import glob
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if glob.glob(os.path.join(folder, "**", "libcudnn.so*"), recursive=True):
            return folder
    return None


def share_torch_cudnn() -> Optional[str]:
    """Make TransformerEngine use the cuDNN torch uses; returns that folder if it acted.

    Why: at import TE loads cuDNN itself (RTLD_GLOBAL), from CUDNN_HOME, CUDNN_PATH, CUDA_HOME or
    the system library path before any Python wheel, and its libraries name cuDNN's sub-libraries
    as dependencies, which the loader takes from the system if torch has not loaded them yet.
    Where the system has another cuDNN than the one torch ships, both end up in one process.
    Measured on the project's H200 (system cuDNN 9.14, torch's 9.19): imported first, TE's 9.14
    served torch's cuDNN calls too, so torch ranked cuDNN attention below FlashAttention-2 (it
    prefers cuDNN only from 9.15 on) and a probe-model step was 3% slower; imported after torch
    had used cuDNN, TE did not import at all (undefined symbol). So, before TE is imported, every
    library of torch's cuDNN is loaded (as torch's own preloading does) and CUDNN_PATH points at
    it: each later lookup finds the copy already loaded. A CUDNN_PATH or CUDNN_HOME the user set
    is left alone, and so is a machine without the wheel or without a GPU. Once TE is imported it
    is too late, and this does nothing.
    """
    import ctypes
    import glob
    import os

    if TE_MODULE in sys.modules or os.environ.get("CUDNN_PATH") or os.environ.get("CUDNN_HOME"):
        return None
    if not torch.cuda.is_available():
        return None
    folder = torch_cudnn_dir()
    if folder is None:
        return None
    libraries = sorted(glob.glob(os.path.join(folder, "lib", "libcudnn*.so.*[0-9]")))
    # the dispatcher and the graph library first: the others link against them
    libraries.sort(key=lambda path: (not os.path.basename(path).startswith(("libcudnn.so", "libcudnn_graph")), path))
    for library in libraries:
        try:
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            return None  # a broken wheel: leave cuDNN to TE and torch as they are
    os.environ["CUDNN_PATH"] = folder
    return folder


def _te_version() -> str:
    try:
        return str(importlib.import_module("transformer_engine").__version__)
    except Exception:  # noqa: BLE001
        return "?"


def _state_manager():
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE < 2.8
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


def _recipe_kind(te_recipe) -> str:
    for kind in ("mxfp8", "nvfp4"):
        check = getattr(te_recipe, kind, None)
        if callable(check) and check():
            return kind
    return "fp8"


# --- micro-batches -----------------------------------------------------------------------------------


class _Microbatch:
    """The is_first_microbatch value TELinear passes to TE; None (the default) passes nothing."""

    is_first: Optional[bool] = None


@contextlib.contextmanager
def microbatch(is_first: Optional[bool]):
    """Run the block as one micro-batch of gradient accumulation (see the module docstring)."""
    previous = _Microbatch.is_first
    _Microbatch.is_first = None if is_first is None else bool(is_first)
    try:
        yield
    finally:
        _Microbatch.is_first = previous


# --- the converted Linear (a te.Linear subclass, built when TE is first needed) ------------------------

_CLASSES: Dict[str, type] = {}


def te_linear_class() -> type:
    """TELinear: te.Linear plus token padding for inputs TE's FP8 GEMM would reject (and the
    high-precision path where padding cannot help) and the micro-batch flag. Built on first use (it subclasses a TE class) and reachable as
    `fp8plug.backends.te.TELinear`, so converted models pickle."""
    cls = _CLASSES.get("TELinear")
    if cls is not None:
        return cls
    te = _te()
    api = TEApi(te)
    manager = _state_manager()

    class TELinear(te.Linear):
        """te.Linear that pads an input's tokens up to what TE's FP8 GEMMs take (e.g. 7 tokens to
        16), runs a forward in high precision when padding cannot help (features misaligned), and
        takes is_first_microbatch from fp8plug.backends.te.microbatch."""

        def forward(self, inp, *args, **kwargs):
            if not args and "is_first_microbatch" not in kwargs and _Microbatch.is_first is not None:
                kwargs["is_first_microbatch"] = _Microbatch.is_first
            if manager.is_fp8_enabled():
                recipe = manager.get_fp8_recipe()
                multiple = fp8_token_multiple(inp, _recipe_kind(recipe))
                if multiple is None:
                    with api.autocast(enabled=False, recipe=recipe):
                        return super().forward(inp, *args, **kwargs)
                if multiple > 1:
                    return self._padded_forward(inp, multiple, args, kwargs)
            return super().forward(inp, *args, **kwargs)

        def _padded_forward(self, inp, multiple, args, kwargs):
            extra = []  # te.Linear(return_bias=True) returns (output, bias): pad the output only

            def run(rows):
                out = super(TELinear, self).forward(rows, *args, **kwargs)
                if isinstance(out, tuple):
                    extra.extend(out[1:])
                    return out[0]
                return out

            out = pad_tokens(run, inp, multiple)
            return (out, *extra) if extra else out

        def fp8_call(self, inp) -> bool:
            """Whether a call on `inp` runs in FP8 now (padded or not): fp8plug's GEMM count asks."""
            if not manager.is_fp8_enabled():
                return False
            return fp8_token_multiple(inp, _recipe_kind(manager.get_fp8_recipe())) is not None

    TELinear.__module__ = __name__
    TELinear.__qualname__ = "TELinear"
    _CLASSES["TELinear"] = TELinear
    return TELinear


def __getattr__(name):
    if name == "TELinear":
        return te_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def te_module_types() -> Tuple[type, ...]:
    """The TE module classes that count as converted (empty while TE is not imported)."""
    te = sys.modules.get(TE_MODULE)
    if te is None:
        return ()
    types = []
    base = getattr(sys.modules.get("transformer_engine.pytorch.module.base"), "TransformerEngineBaseModule", None)
    for candidate in (base, getattr(te, "Linear", None), getattr(te, "LayerNorm", None),
                      getattr(te, "RMSNorm", None), getattr(te, "TransformerLayer", None)):
        if isinstance(candidate, type):
            types.append(candidate)
    return tuple(types)


# --- checkpoints ---------------------------------------------------------------------------------------


def _is_te_extra_state(key: str, value) -> bool:
    """TE's `_extra_state` entries: a uint8 tensor (its pickle), an empty tensor (what it writes
    when it has nothing to keep; fp8plug.checkpoint also asks with empty placeholders), or the
    io.BytesIO of old TE versions. Other modules' extra state (say a dict) is left alone."""
    if key.rpartition(".")[2] != EXTRA_STATE:
        return False
    import io

    if isinstance(value, torch.Tensor):
        return value.dtype == torch.uint8 or value.numel() == 0
    return isinstance(value, io.BytesIO)


def plain_state_dict(state_dict: Mapping[str, Any]) -> "OrderedDict[str, Any]":
    """`state_dict` without TE's `_extra_state` entries: the plain architecture's keys."""
    out = OrderedDict((k, v) for k, v in state_dict.items() if not _is_te_extra_state(k, v))
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out


def supply_extra_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook: a plain checkpoint has no `_extra_state` for a TE module; supply
    the empty one TE itself writes when it has nothing to keep, so a strict load succeeds."""
    key = prefix + EXTRA_STATE
    if key not in state_dict:
        state_dict[key] = torch.empty(0, dtype=torch.uint8)


def accept_plain_state_dict(module: nn.Module) -> None:
    """Let `module` (a TE module) load a state dict that lacks its `_extra_state`, once."""
    if getattr(module, "_fp8plug_plain_loads", False):
        return
    module.register_load_state_dict_pre_hook(supply_extra_state)
    module._fp8plug_plain_loads = True


def load_plain_state_dict(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True):
    """Load a plain (unconverted) checkpoint into a converted model, strictly by default."""
    types = te_module_types()
    if types:
        for module in model.modules():
            if isinstance(module, types):
                accept_plain_state_dict(module)
    return model.load_state_dict(state_dict, strict=strict)


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
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


class TEBackend(Backend):
    """NVIDIA TransformerEngine. See the module docstring for behaviour and quirks.

    Gradient accumulation: wrap each micro-batch's forward in `engine.microbatch(is_first)`
    (True for the first micro-batch after an optimizer step, False for the rest) so TE quantizes
    each weight once per step; outside it TE quantizes on every forward, which is always correct.
    """

    name = "te"
    title = "TransformerEngine"
    install_hint = 'pip install --no-build-isolation "transformer_engine[pytorch]"'
    scalings = ("delayed", "current", "block", "mxfp8", "nvfp4")

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
            check = getattr(_te(), "is_fp8_available", None)
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
        probe = self.probe()
        if not probe.available:
            from . import BackendUnavailableError

            raise BackendUnavailableError(
                f"FP8 backend 'te' (TransformerEngine) cannot run here: {probe.reason}. "
                f"Install it with `{self.install_hint}` on a machine with a CUDA GPU of compute capability 8.9 or newer."
            )
        return _te()

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

    def check_hardware(self, scaling: str) -> None:
        """Refuse a scaling the current GPU (or TE on it) cannot run, with a clear message."""
        if not torch.cuda.is_available():
            return
        index = torch.cuda.current_device()
        problem = scaling_hardware_problem(
            scaling, torch.cuda.get_device_capability(index), torch.version.cuda, torch.cuda.get_device_name(index)
        )
        if problem is None:
            te_check = {
                "block": "is_fp8_block_scaling_available", "mxfp8": "is_mxfp8_available", "nvfp4": "is_nvfp4_available",
            }.get(scaling, "is_fp8_available")
            check = getattr(_te(), te_check, None)
            if check is not None:
                available, reason = check(return_reason=True)
                if not available:
                    problem = f"FP8RecipeKwargs.scaling={scaling!r} cannot run here: TransformerEngine says {reason}"
        if problem:
            raise ValueError(problem)

    def te_recipe(self, recipe=None):
        """The TE recipe object for an FP8RecipeKwargs (or a NativeTERecipe's own), built once per
        distinct setting and device so TE sees the same object every step."""
        if isinstance(recipe, NativeTERecipe):
            return recipe.te_recipe
        if recipe is None:
            from ..recipe import FP8RecipeKwargs

            recipe = FP8RecipeKwargs(backend="te")
        scaling = self.scaling_name(recipe)
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        key = (scaling, recipe.fp8_format, recipe.margin, recipe.interval, recipe.amax_history_len,
               recipe.amax_compute_algo, tuple(recipe.override_linear_precision),
               getattr(recipe, "_explicit_fields", None), device)
        built = self._recipes.get(key)
        if built is None:
            self.check_hardware(scaling)
            plan = plan_te_recipe(recipe, scaling, self.recipe_fields(), _te_version())
            for note in plan.warnings:
                warn_once(note)
            built = self._recipes[key] = self.build_recipe(plan)
        return built

    def build_recipe(self, plan: TERecipePlan):
        module = importlib.import_module("transformer_engine.common.recipe")
        kwargs = plan.kwargs_dict()
        if "fp8_format" in kwargs:
            kwargs["fp8_format"] = module.Format[kwargs["fp8_format"]]
        if plan.interval > 1:
            kwargs["scaling_factor_compute_algo"] = IntervalScaling(plan.interval)
        return getattr(module, plan.class_name)(**kwargs)

    def wrap_native_recipe(self, te_recipe) -> NativeTERecipe:
        """Accept a TransformerEngine recipe object as is (contextual_fp8_autocast does this)."""
        base = getattr(importlib.import_module("transformer_engine.common.recipe"), "Recipe", None)
        if base is not None and not isinstance(te_recipe, base):
            raise TypeError(
                "fp8_recipe: give an fp8plug.FP8RecipeKwargs or a TransformerEngine recipe "
                f"(transformer_engine.common.recipe.DelayedScaling, ...), not {type(te_recipe).__name__}."
            )
        return NativeTERecipe(te_recipe)

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
                bad = [f"{n}={v}" for n, v in (("in_features", module.in_features), ("out_features", module.out_features))
                       if v % feature_multiple]
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

    def convert(self, model: nn.Module, recipe=None, convert_linear: bool = True, convert_norm: bool = True) -> ConversionReport:
        """Swap eligible Linear / LayerNorm / RMSNorm modules for TE's, in place, sharing their
        parameters. Checks the recipe against the GPU first, so a bad choice fails here."""
        te = self.require()
        if recipe is None:
            from ..recipe import FP8RecipeKwargs

            recipe = FP8RecipeKwargs(backend="te")
        if isinstance(recipe, NativeTERecipe):
            scaling = _recipe_kind(recipe.te_recipe)
        else:
            scaling = self.scaling_name(recipe)
            if torch.cuda.is_available():
                self.te_recipe(recipe)  # refuse a recipe this GPU cannot run, before touching the model
        targets, report = plan_conversion(
            model, self.name, self.eligibility(scaling, convert_linear, convert_norm), self.is_converted,
            getattr(recipe, "modules_to_ignore", None), getattr(recipe, "module_filter_fn", None),
        )
        linear_cls = te_linear_class() if convert_linear else None

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

        return swap_modules(model, targets, build, report)

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
            warn_once(f"unconvert: left TransformerEngine module(s) {kept} in place: their layout has no exact torch equivalent.")
        return model

    def is_converted(self, module: nn.Module) -> bool:
        types = te_module_types()
        return bool(types) and isinstance(module, types)

    def runs_fp8(self, module: nn.Module, input) -> bool:
        """Whether this TELinear call runs in FP8 (TE's autocast is on and the input can be padded)."""
        fp8_call = getattr(module, "fp8_call", None)
        return bool(fp8_call(input)) if fp8_call is not None else False

    # running ------------------------------------------------------------------------------------------
    def autocast(self, recipe=None, enabled: bool = True):
        """TE's autocast for one forward: FP8 with the recipe's TE recipe when enabled, high
        precision otherwise."""
        api = TEApi(self.require())
        if not enabled:
            try:
                te_recipe = self.te_recipe(recipe)
            except ValueError:  # a recipe this GPU cannot run is irrelevant when FP8 is off
                te_recipe = None
            return api.autocast(enabled=False, recipe=te_recipe)
        return api.autocast(enabled=True, recipe=self.te_recipe(recipe))

    def microbatch(self, is_first: Optional[bool]):
        return microbatch(is_first)

    # checkpoints ------------------------------------------------------------------------------------
    def plain_state_dict(self, state_dict):
        return plain_state_dict(state_dict)

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
    if (getattr(module, "weight_names", ["weight"]) != ["weight"] or getattr(module, "return_bias", False)
            or getattr(module, "parallel_mode", None) is not None or getattr(module, "tp_size", 1) != 1):
        return None
    plain = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(plain)
    plain.in_features, plain.out_features = module.in_features, module.out_features
    plain.weight = module.weight
    if getattr(module, "use_bias", True):
        plain.bias = module.bias
    else:
        plain.register_parameter("bias", None)  # as nn.Linear(bias=False) has it, not TE's empty tensor
    return plain


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
