"""A transformers mixture-of-experts model's expert GEMMs in FP8, through transformers' own experts registry.

Why: in transformers 5 an MoE block's experts are one module of 3-D parameters (`gate_up_proj`
[E, 2I, H] or `up_proj`, `down_proj` [E, H, I], biases in GPT-OSS, [E, H, 2I] where the class says
`is_transposed`), run by whichever function `config._experts_implementation` names
(`@use_experts_implementation`: "eager", "batched_mm", "grouped_mm", ...). None of it is an
nn.Linear, so Linear conversion leaves most of an MoE model's FLOPs in bf16.

What: planning a conversion decides each experts module (`decide_experts`: the shapes, the speed
filter, and whether the engine has a grouped FP8 GEMM here, its `grouped_gemm`: native's is
backends/native/grouped.py); applying it (`convert_experts`) registers FP8PLUG_EXPERTS with that
registry and switches each transformers model holding converted experts to it. Each experts
module that converts gets that GEMM as an attribute (nothing in its state dict changes); its
forward is the grouped forward transformers runs for "grouped_mm" (tokens sorted by expert, one
grouped GEMM per projection), with the projections in FP8 and everything else as the model's
class says: its `_apply_gate` (concatenated or interleaved gate/up), no gate (`up_proj` and the
activation), biases, transposed weights, a post-expert norm. Routing, the top-k weights and the
router (an nn.Linear the Linear rules decide about) are not touched by this. A module left alone
(modules_to_ignore, unaligned shapes, an engine without a grouped GEMM), eval mode outside an FP8
region, and expert parallelism run the implementation the model had before, unchanged.
`unconvert_model` and `export_model` switch back (`restore_experts`).
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch
from torch import nn

from fp8plug._upstream import (
    apply_gate,
    experts_function,
    experts_implementation,
    is_expert_parallel,
    original_experts_forward,
    register_experts_function,
    set_experts_implementation,
)
from fp8plug.backends.region import fp8_now
from fp8plug.hf.attention import transformers_models
from fp8plug.layers.gemm_counts import (
    EXPERT_COUNTS,
    EXPERT_COUNTS_ON_META,
    FP8,
    HIGH_PRECISION,
    count_expert_gemms,
    settle_expert_counts,
)
from fp8plug.layers.rules import (
    ALIGNMENT,
    IGNORED,
    NOT_ELIGIBLE,
    ConversionReport,
    ModuleDecision,
    module_paths,
)
from fp8plug.tuning.roofline import SpeedFilter, predict_ms

FP8PLUG_EXPERTS = "fp8plug_fp8_experts"
GEMM = "_fp8plug_grouped_gemm"  # experts module attribute: the engine's grouped FP8 GEMM (converted modules only)
BEFORE = "_fp8plug_experts_before"  # experts module and model attribute: the implementation it had
NO_GEMM = "no grouped FP8 GEMM"  # the report's kind for experts an engine cannot run
SPEED = "experts kept in bf16 by the speed filter"


# --- finding experts and reading their layout ---------------------------------------------------------


def is_experts(module: nn.Module) -> bool:
    """A transformers experts module run through the registry: decorated class, 3-D down_proj."""
    down = getattr(module, "down_proj", None)
    return (original_experts_forward(module) is not None and isinstance(down, nn.Parameter) and down.dim() == 3
            and hasattr(module, "config"))


def experts_modules(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    return ((fqn, m) for fqn, m in model.named_modules() if is_experts(m))


def has_gate(module: nn.Module) -> bool:
    return bool(getattr(module, "has_gate", isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)))


def up_weight(module: nn.Module) -> nn.Parameter:
    return module.gate_up_proj if has_gate(module) else module.up_proj


def up_bias(module: nn.Module) -> Optional[torch.Tensor]:
    return getattr(module, "gate_up_proj_bias" if has_gate(module) else "up_proj_bias", None)


def is_transposed(module: nn.Module) -> bool:
    """Whether the weights are stored [E, in, out] (GPT-OSS) rather than [E, out, in]: the class's
    flag where transformers sets one, else read from down_proj's shape against the hidden size."""
    for flag in ("is_transposed", "experts_are_transposed"):
        if hasattr(module, flag):
            return bool(getattr(module, flag))
    hidden = getattr(module.config, "hidden_size", None)
    return module.down_proj.shape[-1] == hidden and module.down_proj.shape[-2] != hidden


def shape_problem(module: nn.Module) -> Optional[str]:
    """Why the experts' GEMMs cannot run in FP8 (unaligned shapes, weights not floating), or None."""
    dims = {"up": tuple(up_weight(module).shape[1:]), "down": tuple(module.down_proj.shape[1:])}
    bad = [f"{name} {a}x{b}" for name, (a, b) in dims.items() if a % ALIGNMENT or b % ALIGNMENT]
    if bad:
        return f"expert weight shapes {', '.join(bad)} not divisible by {ALIGNMENT} (FP8 GEMMs need aligned shapes)"
    if not module.down_proj.dtype.is_floating_point:
        return f"expert weights are {module.down_proj.dtype}, not floating point"
    return None


def gemm_dims(module: nn.Module) -> List[Tuple[int, int]]:
    """(K, N) of each projection's per-expert GEMM: up (or gate_up), then down."""
    dims = [tuple(up_weight(module).shape[1:]), tuple(module.down_proj.shape[1:])]
    return [(a, b) if is_transposed(module) else (b, a) for a, b in dims]


def speed_problem(module: nn.Module, speed_filter) -> Optional[str]:
    """Why the automatic speed filter (fp8plug.tuning.roofline.SpeedFilter, the plan's where it is
    on) keeps these experts in bf16, or None. The experts' GEMMs are predicted as E GEMMs of the
    tokens an expert gets on average (tokens x top-k / E) in one launch (one overhead), both
    projections together: the dense cost model, not a grouped kernel's measured costs."""
    if not isinstance(speed_filter, SpeedFilter):
        return None
    experts = module.down_proj.shape[0]
    top_k = int(getattr(module.config, "num_experts_per_tok", 1) or 1)
    m = max(1, speed_filter.tokens * top_k // experts)

    def total(costs, fp8):
        each = sum(predict_ms(m, k, n, costs, fp8) - costs.overhead_us * 1e-3 for k, n in gemm_dims(module))
        return experts * each + costs.overhead_us * 1e-3

    predicted = total(speed_filter.bf16, False) / total(speed_filter.fp8, True)
    if predicted >= speed_filter.min_speedup:
        return None
    return (f"{speed_filter.source or 'roofline filter'}: FP8 predicted {predicted:.2f}x bf16's speed at {m} tokens "
            f"per expert ({speed_filter.tokens} tokens, top-{top_k} of {experts} experts; needs "
            f"{speed_filter.min_speedup:g}x)")


# --- the forward ---------------------------------------------------------------------------------------


def _count(module: nn.Module, fp8: bool, calls: int = 2) -> None:
    """Count this forward's two projections (fp8plug.coverage): FP8, or high precision in training."""
    if EXPERT_COUNTS not in module._buffers or not (fp8 or module.training):
        return
    if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
        return  # recomputed during backward (activation checkpointing)
    settle_expert_counts(module)
    module._buffers[EXPERT_COUNTS].select(0, FP8 if fp8 else HIGH_PRECISION).add_(calls)


def fp8_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """FP8PLUG_EXPERTS: the grouped experts forward with both projections through the engine's
    grouped FP8 GEMM; the implementation the model had for modules left alone and out of FP8."""
    gemm = getattr(self, GEMM, None)
    if gemm is None or is_expert_parallel(self) or not fp8_now(self.training):
        _count(self, False)
        return _fallback(self)(self, hidden_states, top_k_index, top_k_weights)
    _count(self, True)
    top_k = top_k_index.shape[-1]
    tokens, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    expert_of_pair = top_k_index.reshape(-1)
    expert_sorted, order = torch.sort(expert_of_pair)
    x = hidden_states[order // top_k]
    pair_weights = top_k_weights.reshape(-1)[order]
    experts = self.num_experts if hasattr(self, "num_experts") else self.down_proj.shape[0]
    # the end of each expert's rows in the sorted order, exact integer search with a fixed output
    # size (static under torch.compile, no host sync); a float histogram (histc) is neither exact
    # at the bins' edges nor computed the same way eagerly and compiled
    bounds = torch.arange(experts, device=expert_sorted.device, dtype=expert_sorted.dtype)
    offs = torch.searchsorted(expert_sorted, bounds, right=True).to(torch.int32)
    transposed = is_transposed(self)

    def project(inputs, weight, bias):
        out = gemm(inputs, weight, offs, transposed)
        return out if bias is None else out + bias[expert_sorted].to(out.dtype)

    gate = has_gate(self)
    h = project(x, up_weight(self), up_bias(self) if getattr(self, "has_bias", True) else None)
    if gate:
        h = apply_gate(self, h)
    else:
        h = self.act_fn(h)
    out = project(h, self.down_proj, getattr(self, "down_proj_bias", None) if getattr(self, "has_bias", True) else None)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = out * pair_weights.unsqueeze(-1)  # the routing weights as they are (float32 promotes, as in transformers)
    unsorted = torch.empty_like(out).index_copy_(0, order, out)
    return unsorted.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


# The implementations converted models had, by name, looked up at conversion: the forward then
# reads a dict rather than importing transformers' registry (which torch.compile would trace),
# and a module keeps only the name (a function beneath transformers' decorator cannot be pickled
# by name, so a converted model would no longer torch.save).
_FALLBACKS = {}


def _fallback(module: nn.Module):
    name = getattr(module, BEFORE, None)
    function = _FALLBACKS.get(name)
    if function is None and not torch.compiler.is_compiling():
        function = _FALLBACKS[name] = experts_function(module, name)
    return function or original_experts_forward(module)


# --- conversion and back -----------------------------------------------------------------------------


def decide_experts(model: nn.Module, engine, plan) -> Tuple[ModuleDecision, ...]:
    """Every experts module of `model`, decided for `engine` under its `plan`, changing nothing:
    it runs its grouped GEMMs in FP8 (its note naming the scaling the engine's grouped GEMM
    applies), or it stays with the implementation it has, and why (modules_to_ignore, shapes, the
    speed filter, an engine or device without a grouped FP8 GEMM)."""
    found = list(experts_modules(model))
    if not found:
        return ()
    ignore = set(plan.modules_to_ignore or ())
    paths = module_paths(model)
    decisions = []
    for fqn, module in found:
        if ignore.intersection(paths.get(fqn, ())):
            decisions.append(ModuleDecision(fqn, reason="listed in modules_to_ignore", kind=IGNORED))
            continue
        problem = shape_problem(module) or speed_problem(module, plan.module_filter_fn)
        gemm = None if problem else engine.grouped_gemm(plan, _gemm_device(module))
        problem = problem or (gemm if isinstance(gemm, str) else None)
        if problem:
            kind = SPEED if "predicted" in problem else NOT_ELIGIBLE
            decisions.append(ModuleDecision(fqn, reason=problem,
                                            kind=NO_GEMM if "engine" in problem or "sm_" in problem else kind))
            continue
        scaling = getattr(gemm, "scaling", None)
        decisions.append(ModuleDecision(fqn, converts=True, note=f"{scaling} scaling" if scaling else ""))
    return tuple(decisions)


def _gemm_device(module: nn.Module):
    """The CUDA device a grouped GEMM for `module` runs on (None: not on CUDA)."""
    device = module.down_proj.device
    return device if device.type == "cuda" else None


def convert_experts(model: nn.Module, engine, plan, decisions: Tuple[ModuleDecision, ...],
                    report: ConversionReport) -> List[str]:
    """Carry out `decisions` (decide_experts', in `report` already): give each experts module that
    converts the engine's grouped FP8 GEMM, record it in `report` as converted, and switch the
    transformers models holding them to FP8PLUG_EXPERTS. Returns the converted fqns."""
    converted = []
    for decision in decisions:
        if not decision.converts:
            continue
        module = model.get_submodule(decision.fqn)
        setattr(module, GEMM, engine.grouped_gemm(plan, _gemm_device(module)))
        count_expert_gemms(model, decision.fqn, module, module.down_proj.device)
        report.converted.append(decision.fqn)
        converted.append(decision.fqn)
    if converted:
        _switch(model)
    return converted


def _switch(model: nn.Module) -> None:
    """Put every transformers model holding experts on FP8PLUG_EXPERTS, each experts module
    remembering the implementation it had (what it runs when not in FP8)."""
    register_experts_function(FP8PLUG_EXPERTS, fp8_experts_forward)
    for hf_model in transformers_models(model):
        before = experts_implementation(hf_model.config)
        if before == FP8PLUG_EXPERTS:
            continue
        for _, module in experts_modules(hf_model):
            name = experts_implementation(module.config)
            setattr(module, BEFORE, name)
            if name not in (None, "eager"):  # "eager" is each class's own forward, read from the module
                _FALLBACKS.setdefault(name, experts_function(module, name))
        hf_model.__dict__[BEFORE] = before
        set_experts_implementation(hf_model, FP8PLUG_EXPERTS)


def restore_experts(model: nn.Module) -> None:
    """Undo convert_experts: each model back on the implementation it had, the experts plain."""
    for hf_model in transformers_models(model):
        before = hf_model.__dict__.pop(BEFORE, None)
        if before is not None and experts_implementation(hf_model.config) == FP8PLUG_EXPERTS:
            set_experts_implementation(hf_model, before)
    for _, module in experts_modules(model):
        for name in (GEMM, BEFORE, EXPERT_COUNTS_ON_META):
            module.__dict__.pop(name, None)
        module._buffers.pop(EXPERT_COUNTS, None)


__all__ = ["FP8PLUG_EXPERTS", "convert_experts", "decide_experts", "experts_modules", "fp8_experts_forward",
           "restore_experts"]
