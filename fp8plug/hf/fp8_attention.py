"""FP8 attention for transformers models: the recipe's `fp8_dpa` (off by default).

Conversion switches a transformers model on "sdpa" (or "fp8plug_sdpa") to FP8PLUG_FP8_DPA, whose
attention function runs TransformerEngine's FP8 dot-product attention (fp8plug.backends.te.attention)
where it computes what SDPA computes (`why_sdpa` says where it does not), and transformers' own
SDPA everywhere else; `unconvert_model` and `export_model` put "sdpa" back. Opt-in because on an
H100 it was slower than bf16 SDPA and 3% higher in loss after 200 steps. docs/attention.md says
what runs, what is logged, and why its scaling state is not checkpointed.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from fp8plug.hf.attention import (
    FP8PLUG_FP8_DPA,
    FP8PLUG_SDPA,
    SDPA,
    implementations,
    model_configs,
    register_attention,
    switch_attention,
    transformers_models,
)
from fp8plug.recipe.kwargs import DEFAULTS, FP8_FORMATS
from fp8plug.recipe.plans import DelayedScalingPlan, Plan

logger = logging.getLogger("fp8plug")

# Arguments some transformers models pass to an attention function that change what it computes
# and that TE's causal attention does not do: SDPA runs wherever one of them is not None.
UNSUPPORTED_ARGUMENTS = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias", "cache", "cu_seq_lens_q",
                         "cu_seq_lens_k", "indices", "block_indices", "attention_chunk_size")
INPUT_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIM_MULTIPLE = 16
COMPILED = "the model runs under torch.compile (TransformerEngine's modules cannot be traced)"


@dataclass(frozen=True)
class FP8AttentionSettings:
    """What the FP8 attention of one converted model runs with: delayed scaling's settings (TE's
    DelayedScaling arguments) and whether eval runs in FP8 too."""

    fp8_format: str = DEFAULTS["fp8_format"]
    margin: int = DEFAULTS["margin"]
    amax_history_len: int = DEFAULTS["amax_history_len"]
    amax_compute_algo: str = DEFAULTS["amax_compute_algo"]
    reduce_amax: bool = DEFAULTS["reduce_amax"]
    in_eval: bool = DEFAULTS["use_autocast_during_eval"]

    @classmethod
    def from_plan(cls, plan: Plan) -> "FP8AttentionSettings":
        """The plan's delayed-scaling settings where the engine runs delayed scaling's kind of plan
        (native, te), else the recipe's defaults; the plan's FP8 format where it has one."""
        fp8_format = getattr(plan, "fp8_format", None)
        delayed = dict(margin=plan.margin, amax_history_len=plan.amax_history_len,
                       amax_compute_algo=plan.amax_compute_algo, reduce_amax=plan.reduce_amax) \
            if isinstance(plan, DelayedScalingPlan) else {}
        return cls(fp8_format=fp8_format if fp8_format in FP8_FORMATS else DEFAULTS["fp8_format"],
                   in_eval=plan.use_autocast_during_eval, **delayed)

    def recipe_arguments(self) -> Dict[str, Any]:
        """The arguments of TE's DelayedScaling (fp8_dpa=True is added by fp8plug.backends.te.attention)."""
        return dict(fp8_format=self.fp8_format, margin=self.margin, amax_history_len=self.amax_history_len,
                    amax_compute_algo=self.amax_compute_algo, reduce_amax=self.reduce_amax)


DEFAULT_SETTINGS = FP8AttentionSettings()
# id(config) -> (a weak reference to it, its settings): configs are unhashable. A module whose
# config is not here (a deep copy of a converted model) runs with DEFAULT_SETTINGS.
_SETTINGS: Dict[int, Tuple[weakref.ref, FP8AttentionSettings]] = {}
# attention module -> {shape and settings: its TE attention, or the reason TE could not be built}.
# Kept beside the modules, not as submodules, so the model's state dict, checkpoints and deep copies
# stay transformers' own (and the TE modules' scaling state is not checkpointed: a resumed run
# starts again from TE's initial scale, 1.0).
_RUNNERS: "weakref.WeakKeyDictionary[nn.Module, Dict[tuple, Any]]" = weakref.WeakKeyDictionary()
_SDPA: Dict[str, Callable] = {}  # transformers' SDPA function, looked up once at registration
_logged: set = set()


def _log_once(level: int, key, message: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, message, *args)


# --- the switch ----------------------------------------------------------------------------------


def use_fp8_attention(model: nn.Module, plan: Plan, device=None) -> bool:
    """Switch every transformers model in `model` on "sdpa" or "fp8plug_sdpa" to FP8PLUG_FP8_DPA,
    with the plan's settings; returns whether any was. Where FP8 attention cannot run on `device`
    (default: the current CUDA GPU) nothing is switched and a warning naming fp8_dpa says why, once;
    a model on another attention is left alone, with a note in the log."""
    from fp8plug.backends.te.attention import fp8_attention_problem

    hf_models = list(transformers_models(model))
    if not hf_models:
        return False
    problem = fp8_attention_problem(device)
    if problem is not None:
        _log_once(
            logging.WARNING, ("unavailable", problem),
            "fp8plug: FP8RecipeKwargs.fp8_dpa=True, but FP8 attention cannot run here: %s. It needs "
            "TransformerEngine 2.x with its FP8 attention (cuDNN) and a compute capability 9.0+ GPU; attention "
            "stays transformers' SDPA ('%s' or 'sdpa'). Set fp8_dpa=False (FP8PLUG_FP8_DPA=false) to stop asking.",
            problem, FP8PLUG_SDPA)
        return False
    settings = FP8AttentionSettings.from_plan(plan)
    switched = False
    for hf_model in hf_models:
        names = implementations(hf_model)
        name = type(hf_model).__name__
        if not names <= {SDPA, FP8PLUG_SDPA, FP8PLUG_FP8_DPA}:
            _log_once(logging.WARNING, ("not sdpa", name),
                      "fp8plug: %s: fp8_dpa=True, but its attention is %s, not 'sdpa': left as it is (load it with "
                      "attn_implementation='sdpa' for FP8 attention).", name, ", ".join(sorted(map(repr, names))))
            continue
        _register()
        switch_attention(hf_model, FP8PLUG_FP8_DPA)
        for config in model_configs(hf_model):
            _SETTINGS[id(config)] = (weakref.ref(config, _forget(id(config))), settings)
        switched = True
        _log_once(logging.INFO, ("switched", name),
                  "fp8plug: %s: attention through %r (fp8_dpa=True): TransformerEngine's FP8 attention for causal "
                  "attention without a mask while training, transformers' SDPA elsewhere (eval, a padding mask, a KV "
                  "cache, under torch.compile, ...), each reason logged once.", name, FP8PLUG_FP8_DPA)
    return switched


def _forget(key: int) -> Callable:
    def forget(_):
        _SETTINGS.pop(key, None)

    return forget


def _register() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _SDPA.setdefault(SDPA, ALL_ATTENTION_FUNCTIONS[SDPA])
    register_attention(FP8PLUG_FP8_DPA, fp8_attention_forward)


def settings_of(module: nn.Module) -> FP8AttentionSettings:
    """The settings of the converted model `module` belongs to (by its config), else the defaults."""
    config = getattr(module, "config", None)
    entry = _SETTINGS.get(id(config))
    return entry[1] if entry is not None and entry[0]() is config else DEFAULT_SETTINGS


# --- the attention function ----------------------------------------------------------------------


def fp8_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                          is_causal: Optional[bool] = None, **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function contract (as its sdpa_attention_forward): query [B, H, T, D],
    key and value [B, Hkv, S, D] -> ([B, T, H, D], None). TE's FP8 attention where it applies
    (where `why_sdpa` finds no reason against it), transformers' SDPA function otherwise."""
    if torch.compiler.is_compiling():
        _note_compiled()
    else:
        settings = settings_of(module)
        reason = why_sdpa(module, query, key, value, attention_mask, dropout, is_causal, kwargs, settings)
        if reason is None:
            output = _fp8(module, query, key, value, scaling, settings)
            if output is not None:
                return output, None
        else:
            _log_once(logging.INFO, ("fallback", reason),
                      "fp8plug: fp8_dpa: transformers' SDPA instead of FP8 attention where %s.", reason)
    return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                   **kwargs)


@torch.compiler.assume_constant_result
def _note_compiled() -> bool:
    """Log the torch.compile fall-back once. Run while dynamo traces (its result is taken as a
    constant), so it costs the compiled graph nothing and breaks no graph, as a log call would."""
    _log_once(logging.INFO, ("fallback", "compiled"),
              "fp8plug: fp8_dpa: transformers' SDPA instead of FP8 attention where %s.", COMPILED)
    return True


def _sdpa() -> Callable:
    if SDPA not in _SDPA:  # the function called without conversion (a test, or a user's own registration)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        _SDPA[SDPA] = ALL_ATTENTION_FUNCTIONS[SDPA]
    return _SDPA[SDPA]


def why_sdpa(module: nn.Module, query, key, value, attention_mask, dropout, is_causal, kwargs,
             settings: FP8AttentionSettings = DEFAULT_SETTINGS) -> Optional[str]:
    """Why this call runs SDPA rather than FP8 attention (None: FP8 attention applies), in words
    that complete "SDPA instead of FP8 attention where ..."."""
    if not query.is_cuda:
        return "the tensors are not on a CUDA GPU"
    if not module.training and not settings.in_eval:
        return "the model is in eval mode (use_autocast_during_eval=True runs FP8 there too)"
    if attention_mask is not None:
        return "an attention mask is given (padding, packed sequences, a KV cache, a sliding window)"
    if dropout:
        return "attention dropout is on"
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        return "the attention is not causal"
    if query.shape[2] != key.shape[2]:
        return "keys and queries are not as many (a KV cache)"
    given = [name for name in UNSUPPORTED_ARGUMENTS if kwargs.get(name) is not None]
    if given:
        return f"the model passes {given[0]}"
    mixed = not _autocast(query) and not query.dtype == key.dtype == value.dtype  # autocast would cast them
    if compute_dtype(query) not in INPUT_DTYPES or mixed:
        return (f"the inputs are {query.dtype}, {key.dtype}, {value.dtype}; FP8 attention takes bfloat16 or float16 "
                "(train under bf16 autocast)")
    if query.shape[-1] != value.shape[-1] or query.shape[-1] % HEAD_DIM_MULTIPLE:
        return f"head dims are {query.shape[-1]} and {value.shape[-1]}; FP8 attention takes one, a multiple of 16"
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key/value heads"
    return None


def _autocast(tensor) -> bool:
    return torch.is_autocast_enabled(tensor.device.type)


def compute_dtype(query) -> torch.dtype:
    """The dtype attention computes in: under autocast, autocast's (transformers' SDPA is cast to
    it there: a Llama with float32 weights under bf16 autocast hands float32 queries and keys,
    RoPE's float32 cos and sin having promoted them, and bf16 values); else the query's."""
    return torch.get_autocast_dtype(query.device.type) if _autocast(query) else query.dtype


def _fp8(module: nn.Module, query, key, value, scaling, settings: FP8AttentionSettings) -> Optional[torch.Tensor]:
    """TE's FP8 attention for this call, or None where TE could not be built or refused this shape
    (then logged, and remembered so that it is not tried again). The inputs are cast to the
    compute dtype first, as autocast would cast them for SDPA."""
    from fp8plug.backends.te.attention import TEAttention, attention_recipe

    dtype = compute_dtype(query)
    query, key, value = (t if t.dtype == dtype else t.to(dtype) for t in (query, key, value))

    runners = _RUNNERS.setdefault(module, {})
    key_ = (query.shape[1], key.shape[1], query.shape[-1], value.shape[-1], scaling, settings)
    runner = runners.get(key_)
    if isinstance(runner, str):
        return None
    try:
        if runner is None:
            runner = runners[key_] = TEAttention(query.shape[1], key.shape[1], query.shape[-1], value.shape[-1],
                                                 scaling, attention_recipe(**settings.recipe_arguments()),
                                                 query.device)
        output = runner(query, key, value, module.training)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - TE refusing a shape falls back to SDPA, with the reason
        runners[key_] = f"{type(exc).__name__}: {exc}"
        _log_once(logging.WARNING, ("refused", key_, str(exc)),
                  "fp8plug: fp8_dpa: TransformerEngine's FP8 attention failed for %s: %s: %s; that attention runs "
                  "transformers' SDPA from now on.", _describe(module, query, key), type(exc).__name__,
                  str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        return None
    _log_once(logging.INFO, "runs",
              "fp8plug: fp8_dpa: FP8 attention runs: TransformerEngine DotProductAttention under "
              "DelayedScaling(fp8_dpa=True) (cuDNN's FP8 fused attention), first for %s.",
              _describe(module, query, key))
    return output


def _describe(module: nn.Module, query, key) -> str:
    return (f"{type(module).__name__} ({query.shape[1]}/{key.shape[1]} heads, head dim {query.shape[-1]}, "
            f"{query.shape[2]} tokens, {query.dtype})")


def fp8_attention_modules(model: nn.Module) -> Dict[str, Any]:
    """The TE attention objects (fp8plug.backends.te.attention.TEAttention) created for `model`'s modules,
    by module name (with a shape suffix where one module ran several): each has `calls`, the FP8
    calls it ran, and `dpa`, TE's module. Empty where FP8 attention never ran."""
    found = {}
    for name, module in model.named_modules():
        runners = [r for r in _RUNNERS.get(module, {}).values() if not isinstance(r, str)]
        for index, runner in enumerate(runners):
            found[name if index == 0 else f"{name}#{index}"] = runner
    return found
