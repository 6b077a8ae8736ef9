"""Which modules an engine converts, written once for every engine, and the report of it.

A module converts if it is of a kind the engine converts (exact nn.Linear; for some engines the
norms), an nn.Linear has in and out features divisible by 16, `modules_to_ignore` does not name it
(a name matching nothing is an error: almost always a typo), it is not the output head where the
plan keeps that in high precision (layers.output_head) and `module_filter_fn` does not veto it;
one skipped module never stops its siblings. Reported, never converted, since their forward
never runs: nn.MultiheadAttention's projections and a head a fused loss reads (layers.fused_heads).
The decisions are made before anything changes, as data (`decide_modules` -> ModulePlan: every
candidate module, converting or staying and why), so that one plan says what a conversion will
do; an engine's `convert_listed` then swaps exactly the modules listed (`swap_modules`,
`record_converted`), and each converted Linear gets a GEMM counter (layers.gemm_counts). User
reference: docs/recipe.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from torch import nn

from fp8plug.layers.carry_over import carry_over
from fp8plug.layers.ddp_buffers import ignore_in_ddp  # noqa: F401  (engines import it from here)
from fp8plug.layers.fused_heads import fused_heads
from fp8plug.layers.gemm_counts import count_gemms, has_gemm_counter
from fp8plug.layers.output_head import output_head_fqns
from fp8plug.layers.report import (  # noqa: F401  (the records, importable from here too)
    ADAPTER,
    ADAPTER_NOTE,
    ALREADY,
    IGNORED,
    LIGER,
    MHA_ADVICE,
    MHA_NOTE,
    MHA_OUT,
    MHA_QKV,
    NO_FP8_LINEAR,
    NO_FP8_LINEAR_REASON,
    NOT_ELIGIBLE,
    OUTPUT_HEAD,
    OUTPUT_HEAD_NOTE,
    OUTPUT_HEAD_REASON,
    REFUSED,
    SUBCLASS,
    TRL_FUSED,
    ConversionReport,
    ModuleDecision,
    ModulePlan,
)
from fp8plug.recipe.layer_scaling import layer_note

ALIGNMENT = 16

class ConversionError(ValueError):
    """A model that cannot be converted as asked (wrapped already, or a bad module name)."""


def refuse_unusable_linear(fqn: str, module: nn.Linear) -> None:
    """Refuse, before anything is swapped (so the model is never half converted), an nn.Linear no
    engine can run: no weight Parameter, or weights in a dtype FP8 training does not start from."""
    import torch

    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter):
        found = "no weight" if weight is None else f"a {type(weight).__name__} as weight"
        raise ConversionError(
            f"cannot convert {fqn!r} to FP8: this nn.Linear has {found}, not a weight Parameter; "
            f"give it one, or leave it in high precision with modules_to_ignore=[{fqn!r}]."
        )
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConversionError(
            f"cannot convert {fqn!r} to FP8: its weight is {weight.dtype}, and FP8 training starts from "
            "float32, bfloat16 or float16 weights; cast the model first (model.float() or "
            f"model.to(torch.bfloat16)), or leave it in high precision with modules_to_ignore=[{fqn!r}]."
        )


def local_shape(t):
    """The shape of this rank's part of tensor `t`: a DTensor's local shard (tensor parallelism),
    a plain tensor's own. A DeepSpeed ZeRO-3 partition (a model built under `deepspeed.zero.Init`)
    holds a 1-D slice until DeepSpeed gathers the whole tensor for each use: its shape is that
    whole tensor's (`ds_shape`)."""
    partitioned = getattr(t, "ds_shape", None)
    if partitioned is not None:
        return partitioned
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return t.shape
    return t.to_local().shape if isinstance(t, DTensor) else t.shape


def local_features(module: nn.Linear) -> Tuple[int, int]:
    """(in_features, out_features) of this rank's part of `module`'s weight: the whole layer's,
    or the shard a tensor-parallel plan left on this rank where its weight is a DTensor."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return module.in_features, module.out_features
    out_features, in_features = local_shape(weight)
    return in_features, out_features


def linear_alignment_problem(module: nn.Linear) -> Optional[str]:
    """Why an nn.Linear cannot run FP8 GEMMs, or None if its shape is fine (on this rank's shard
    under tensor parallelism: local_features)."""
    in_features, out_features = local_features(module)
    sharded = (in_features, out_features) != (module.in_features, module.out_features)
    bad = [
        f"{name}={value}"
        for name, value in (("in_features", in_features), ("out_features", out_features))
        if value % ALIGNMENT
    ]
    if bad:
        where = " on each tensor-parallel shard" if sharded else ""
        return f"{' and '.join(bad)}{where} not divisible by {ALIGNMENT} (FP8 GEMMs need aligned shapes)"
    return None


def check_convertible(model: nn.Module, where: str = "cannot convert to FP8: ") -> None:
    """Refuse a model whose conversion must have come first: compiled, DDP- or FSDP-wrapped (the
    one place this rule is worded; `where` says who refuses)."""
    kind = wrapped_kind(model)
    if kind:
        raise ConversionError(
            f"{where}{type(model).__name__} is already {kind}, but FP8 conversion must come first: pass "
            "the plain model, convert it, then wrap it (DDP/FSDP2) and compile it last "
            "(fp8plug.Accelerator.prepare does this in that order)."
        )


def wrapped_kind(model: nn.Module) -> Optional[str]:
    """'compiled', 'wrapped in DistributedDataParallel', 'sharded with FSDP', or None."""
    import torch

    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return "compiled (torch.compile)"
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "wrapped in DistributedDataParallel"
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(model, FullyShardedDataParallel):
            return "wrapped in FSDP"
    except ImportError:  # pragma: no cover - torch built without distributed
        pass
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "sharded with FSDP2 (fully_shard)"
    return None


@dataclass(frozen=True)
class Eligibility:
    """What an engine converts in one model under its plan (Engine.eligible): the exact module
    types it converts, each with a check saying why a module of that type cannot be converted
    (None: it can); `unfiltered`, the types module_filter_fn is not asked about, since converting
    them decides no precision (the native engine's fused norms; they still honour
    modules_to_ignore, and convert only beside an FP8 Linear); the filter to ask (the plan's, with
    whatever the engine adds, e.g. layer_scaling's bf16 layers); and, where the engine runs one
    layer with a scaling of its own, that layer's scaling word (`scaling_of(fqn)`, None for the
    plan's)."""

    checks: Mapping[type, Callable[[nn.Module], Optional[str]]] = field(default_factory=dict)
    unfiltered: Tuple[type, ...] = ()
    module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None
    scaling_of: Optional[Callable[[str], Optional[str]]] = None


def decide_modules(model: nn.Module, engine, plan, linear: bool = True, norm: bool = True) -> ModulePlan:
    """Decide, module by module, what `engine` (an fp8plug.backends.base.Engine) converts in
    `model` under its `plan`: the modules of the types it converts (`engine.eligible`) that pass
    its checks, are not listed in `modules_to_ignore`, are not the output head where the plan keeps
    that in high precision (fp8plug.layers.output_head; modules_to_ignore naming it too is no
    error) and that the filter does not veto. Nothing is changed: the plan is data, which the
    engine's `convert_listed` carries out. An engine that converts nothing here (`linear` and
    `norm` both off for its kinds) gets an empty plan."""
    eligibility = engine.eligible(model, plan, linear, norm)
    eligible = eligibility.checks
    if not eligible:
        return ModulePlan(engine.name)
    check_convertible(model)
    ignore = set(plan.modules_to_ignore or ())
    paths = module_paths(model)
    check_module_names(model, ignore, paths)
    module_filter_fn = eligibility.module_filter_fn
    scaling_of = eligibility.scaling_of or (lambda fqn: None)
    attention = _attention_modules(model) if nn.Linear in eligible else {}
    adapters = _adapter_modules(model)
    fused = fused_heads(model) if nn.Linear in eligible else {}
    heads = output_head_fqns(model) if plan.keep_output_head and nn.Linear in eligible else frozenset()
    decisions: List[ModuleDecision] = []
    for fqn, module in model.named_modules():
        gemm = isinstance(module, nn.Linear) or has_gemm_counter(module)

        def keep(reason: str, kind: str, note: str = "", where: str = fqn) -> None:
            decisions.append(ModuleDecision(where, reason=reason, kind=kind, note=note, linear=gemm))

        if engine.is_converted(module):
            keep("already converted", ALREADY, where=fqn or "<root>")
            continue
        if has_gemm_counter(module):  # an FP8 layer, but of another engine: it would stay that engine's
            raise ConversionError(
                f"cannot convert {type(model).__name__} with the {engine.name} engine: {fqn or '<root>'!r} is "
                f"already an FP8 layer of another engine ({type(module).__name__}); convert the plain model, or "
                "keep the engine it was converted with."
            )
        if fqn in adapters:
            keep(ADAPTER_NOTE, ADAPTER)
            continue
        if fqn in fused:  # fp8plug.layers.fused_heads: an FP8 module there would never run
            keep(fused[fqn][1], fused[fqn][0])
            continue
        if fqn in attention:
            keep(attention[fqn], MHA_OUT if isinstance(module, nn.Linear) else MHA_QKV, where=fqn or "<root>")
            continue
        check = eligible.get(type(module))
        if check is None:
            if isinstance(module, tuple(eligible)) and type(module) not in eligible:
                keep(f"{type(module).__name__} subclasses {_base_name(module, eligible)} but may not use its "
                     "forward; only exact types are converted", SUBCLASS, type(module).__name__)
            elif gemm:
                decisions.append(ModuleDecision(fqn, linear=True))  # no candidate here, still a Linear
            continue
        if ignore.intersection(paths.get(fqn, ())):  # under any of its names
            keep("listed in modules_to_ignore", IGNORED)
            continue
        if fqn in heads:
            keep(OUTPUT_HEAD_REASON, OUTPUT_HEAD, OUTPUT_HEAD_NOTE)
            continue
        if isinstance(module, nn.Linear):
            refuse_unusable_linear(fqn, module)
        problem = check(module)
        if problem:
            keep(problem, NOT_ELIGIBLE, problem.split(" (")[0])
            continue
        if (module_filter_fn is not None and not isinstance(module, eligibility.unfiltered)
                and not module_filter_fn(module, fqn)):
            # a filter may word its reason, its kind and a short note itself (roofline.SpeedFilter)
            reason = getattr(module_filter_fn, "skip_reason", None)
            kind = getattr(module_filter_fn, "skip_kind", None)
            note = getattr(module_filter_fn, "skip_note", None)
            keep(reason(fqn) if reason else "module_filter_fn returned False",
                 (kind(fqn) if kind else None) or REFUSED, note(fqn) if note else "")
            continue
        scaling = scaling_of(fqn)
        decisions.append(ModuleDecision(fqn, converts=True, scaling=scaling, linear=gemm,
                                        note=layer_note(scaling) if scaling else ""))
    if nn.Linear in eligible and eligibility.unfiltered and not any(d.converts and d.linear for d in decisions):
        # the unfiltered modules serve the FP8 Linears: with none (the speed filter kept every one in
        # bf16), a fused norm is a cost with no reader (0.9x bf16's speed at hidden 768 on an H200)
        decisions = [replace(d, converts=False, reason=NO_FP8_LINEAR_REASON, kind=NO_FP8_LINEAR, note="",
                             scaling=None) if d.converts else d for d in decisions]
    return ModulePlan(engine.name, tuple(decisions))


def check_module_names(model: nn.Module, names: Iterable[str], paths: Optional[Dict[str, List[str]]] = None) -> None:
    """Refuse `modules_to_ignore` entries that name no module of `model` (under any of its names):
    almost always a typo, which would leave the module it meant unprotected."""
    paths = module_paths(model) if paths is None else paths
    known = {name for aliases in paths.values() for name in aliases}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ConversionError(
            f"modules_to_ignore names {unknown} that match no module of {type(model).__name__}; "
            "use fully-qualified names as model.named_modules() gives them, e.g. 'layers.0.mlp.up'."
        )


def _attention_modules(model: nn.Module) -> Dict[str, str]:
    """fqn -> why, for every nn.MultiheadAttention and its out_proj (MHA_NOTE says why)."""
    found = {}
    for fqn, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            found[fqn] = f"nn.MultiheadAttention: {MHA_NOTE}; {MHA_ADVICE}"
            found[f"{fqn}.out_proj" if fqn else "out_proj"] = (
                f"out_proj of nn.MultiheadAttention {fqn or '<root>'!r}: {MHA_NOTE}; {MHA_ADVICE}"
            )
    return found


def _adapter_modules(model: nn.Module) -> set:
    """The fqns of LoRA adapter modules: the members of the `lora_A` / `lora_B` ModuleDicts of a
    PEFT LoRA layer (a module holding a `base_layer` beside them). Found by shape, so peft itself
    is never imported."""
    found = set()
    for fqn, module in model.named_modules():
        if not isinstance(getattr(module, "base_layer", None), nn.Module):
            continue
        for side in ("lora_A", "lora_B"):
            adapters = getattr(module, side, None)
            if isinstance(adapters, nn.ModuleDict):
                found.update(f"{fqn}.{side}.{name}" if fqn else f"{side}.{name}" for name in adapters)
    return found


def _base_name(module: nn.Module, eligible: Iterable[type]) -> str:
    return next(t.__name__ for t in eligible if isinstance(module, t))


def plain_linear(like: nn.Module, weight: nn.Parameter, bias: Optional[nn.Parameter]) -> nn.Linear:
    """A plain nn.Linear holding `weight` and `bias` themselves (no copy, no fresh initialisation,
    so optimizers and tied weights stay valid), with `like`'s shape and training flag: what every
    engine's unconvert puts back for one of its Linears."""
    plain = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(plain)
    plain.in_features, plain.out_features = like.in_features, like.out_features
    plain.weight = weight
    if bias is None:
        plain.register_parameter("bias", None)  # as nn.Linear(bias=False) has it
    else:
        plain.bias = bias
    plain.train(like.training)
    return plain


def module_paths(model: nn.Module) -> Dict[str, List[str]]:
    """Every name of each module, keyed by its first name (the one `named_modules()` gives): one
    module registered twice (`m.a = m.b = linear`, a block shared between two places) has two.
    Replacing a module must replace it under every name, or the other name keeps the old one."""
    first: Dict[int, str] = {}
    paths: Dict[str, List[str]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(first.setdefault(id(module), fqn), []).append(fqn)
    return paths


def replace_module(model: nn.Module, fqn: str, new: nn.Module, paths: Optional[Dict[str, List[str]]] = None) -> None:
    """Put `new` where `fqn` is in `model`, and under every other name of the module there
    (`paths`, from module_paths taken before any replacement, or worked out now), so that aliases
    keep pointing at one module, with the hooks and attributes a sharding plan or another wrapper
    put on the module replaced (layers.carry_over). The root itself cannot be replaced in place."""
    if not fqn:
        raise ConversionError("the model itself is a single convertible layer; wrap it in a container first.")
    if paths is None:
        paths = module_paths(model)
    old = model.get_submodule(fqn)
    if old is not new:  # what a sharding plan or another wrapper put on it (layers.carry_over)
        carry_over(old, new)
    for path in paths.get(fqn, [fqn]):
        parent_name, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)


def planned_modules(model: nn.Module, modules: ModulePlan) -> List[Tuple[ModuleDecision, nn.Module]]:
    """Each decision of `modules` that converts, with the module it names in `model` (its first
    name, as the plan was made)."""
    return [(decision, model.get_submodule(decision.fqn)) for decision in modules.targets]


def swap_modules(
    model: nn.Module,
    targets: List[Tuple[str, nn.Module]],
    build: Callable[[nn.Module], nn.Module],
    report: ConversionReport,
) -> ConversionReport:
    """Replace each target by `build(module)` under all its names, recording it as converted."""
    paths = module_paths(model)
    for fqn, module in targets:
        new = build(module)
        replace_module(model, fqn, new, paths)
        record_converted(model, fqn, module, new, report)
    return report


def record_converted(model: nn.Module, fqn: str, old: nn.Module, new: nn.Module, report: ConversionReport) -> None:
    """Note `fqn` as converted in `report`; a converted nn.Linear (`old`) gets its GEMM counter."""
    report.converted.append(fqn)
    if isinstance(old, nn.Linear):
        count_gemms(model, fqn, new, report.backend)
