"""Which modules an engine converts, written once for every engine, and the report of it.

A module converts if it is of a kind the engine converts (exact nn.Linear; for some engines the
norms), an nn.Linear has in and out features divisible by 16, `modules_to_ignore` does not name it
(a name matching nothing is an error: almost always a typo), it is not the output head where the
plan keeps that in high precision (layers.output_head) and `module_filter_fn` does not veto it;
one skipped module never stops its siblings. Reported, never converted, since their forward
never runs: nn.MultiheadAttention's projections and a head a fused loss reads (layers.fused_heads).
Each converted Linear gets a GEMM counter (layers.gemm_counts). User reference: docs/recipe.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from torch import nn

from fp8plug.layers.ddp_buffers import ignore_in_ddp  # noqa: F401  (engines import it from here)
from fp8plug.layers.fused_heads import LIGER_KIND, TRL_KIND, fused_heads
from fp8plug.layers.gemm_counts import count_gemms, has_gemm_counter
from fp8plug.layers.output_head import output_head_fqns

ALIGNMENT = 16

# Kinds of skip, for the one-line summary (ConversionReport.summary), which groups by kind.
ALREADY = "already converted"
IGNORED = "listed in modules_to_ignore"
OUTPUT_HEAD = "output head"
OUTPUT_HEAD_NOTE = "fp8_output_head=True runs it in FP8"
OUTPUT_HEAD_REASON = (
    "the output head stays in high precision (FP8RecipeKwargs.fp8_output_head): on real text an FP8 head "
    f"cost 1.4% final loss where every other Linear in FP8 cost none (docs/numerics.md); {OUTPUT_HEAD_NOTE}")
REFUSED = "refused by module_filter_fn"
NOT_ELIGIBLE = "not eligible"
SUBCLASS = "subclasses of nn.Linear (only exact nn.Linear is converted)"
ADAPTER = "LoRA adapters (PEFT lora_A / lora_B)"
ADAPTER_NOTE = ("LoRA adapter: trains in high precision (one rank wide, too small to gain from FP8); "
                "its frozen base_layer runs in FP8")
LIGER = LIGER_KIND
TRL_FUSED = TRL_KIND
MHA_OUT = "output projections of nn.MultiheadAttention"
MHA_QKV = "Q/K/V projections of nn.MultiheadAttention"
MHA_NOTE = (
    "F.multi_head_attention_forward computes nn.MultiheadAttention's Q/K/V projection from "
    "in_proj_weight (or q/k/v_proj_weight) and its output projection from out_proj.weight directly, "
    "never calling a Linear module, so no engine can run them in FP8"
)
MHA_ADVICE = ("they stay in high precision. To train attention projections in FP8, build attention "
              "from nn.Linear layers (as Hugging Face models do).")


@dataclass
class ConversionReport:
    """What a conversion did: the modules converted and, for each one left alone, why.

    `kinds` groups the skipped modules (fqn -> kind, e.g. "listed in modules_to_ignore"), `notes`
    holds a short per-module detail (e.g. the auto filter's predicted speed-up), `linears` names
    the candidates that were nn.Linear layers (GEMMs), converted or not; `summary()` says it all
    in one line.
    """

    backend: str
    converted: List[str] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)
    kinds: Dict[str, str] = field(default_factory=dict)
    notes: Dict[str, str] = field(default_factory=dict)
    linears: List[str] = field(default_factory=list)
    experts: List[str] = field(default_factory=list)  # mixture-of-experts experts modules (fp8plug.hf.experts)

    def __str__(self) -> str:
        lines = [f"{self.backend}: converted {len(self.converted)} module(s), skipped {len(self.skipped)}"]
        lines += [f"  converted {name}" + (f": {self.notes[name]}" if self.notes.get(name) else "")
                  for name in self.converted]
        lines += [f"  skipped   {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)

    def skip(self, fqn: str, reason: str, kind: str, note: str = "") -> None:
        """Record `fqn` as left alone, with its reason, the kind it is grouped under, and a note."""
        self.skipped[fqn] = reason
        self.kinds[fqn] = kind
        if note:
            self.notes[fqn] = note

    @property
    def fp8_linears(self) -> List[str]:
        """The Linear layers that run in FP8: converted now or already before."""
        linears = set(self.linears)
        return [f for f in self.converted if f in linears] + [
            f for f in self.skipped if f in linears and self.kinds.get(f) == ALREADY
        ]

    @property
    def high_precision_linears(self) -> Dict[str, str]:
        """The Linear layers left in high precision: fqn -> why."""
        linears = set(self.linears)
        return {f: why for f, why in self.skipped.items() if f in linears and self.kinds.get(f) != ALREADY}

    def summary(self, subject: str = "model", max_names: int = 3) -> str:
        """One line: how many Linear layers run in FP8 and why the rest do not, grouped by kind
        (at most `max_names` names per group), plus other converted modules (norms)."""
        fp8 = self.fp8_linears
        rest = self.high_precision_linears
        total = len(fp8) + len(rest)
        if total == 0:
            line = f"{subject}: no nn.Linear layer to convert, so nothing runs in FP8"
        elif not fp8:
            line = f"{subject}: none of its {total} Linear layers runs in FP8"
        else:
            line = f"{subject}: {len(fp8)} of {total} Linear layers run in FP8"
        groups: Dict[str, List[str]] = {}
        for fqn in rest:
            groups.setdefault(self.kinds.get(fqn, NOT_ELIGIBLE), []).append(fqn)
        for fqn, kind in self.kinds.items():
            if kind == MHA_QKV:
                groups.setdefault(kind, []).append(fqn)
        parts = [f"{len(names)} {kind} ({self._names(names, max_names)})" for kind, names in groups.items()]
        if MHA_QKV in groups or MHA_OUT in groups:
            parts.append(f"({MHA_NOTE})")
        if parts:
            line += "; in high precision: " + "; ".join(parts)
        if self.experts:
            line += "; " + self._experts_summary(max_names)
        others = [f for f in self.converted if f not in set(self.linears) and f not in set(self.experts)]
        if others:
            line += f"; also converted {len(others)} other module(s) ({self._names(others, max_names)})"
        return line

    def _experts_summary(self, limit: int) -> str:
        """How many MoE experts modules run their grouped GEMMs in FP8, and why the others do not."""
        converted = [f for f in self.experts if f in set(self.converted)]
        scalings = sorted({self.notes[f] for f in converted if self.notes.get(f)})
        kept = "; ".join([*scalings, "router and routing weights in high precision"])
        line = f"{len(converted)} of {len(self.experts)} MoE experts modules run their grouped GEMMs in FP8 ({kept})"
        reasons: Dict[str, List[str]] = {}
        for fqn in self.experts:
            if fqn in self.skipped:
                reasons.setdefault(self.skipped[fqn], []).append(fqn)
        for reason, names in reasons.items():
            line += f"; experts in high precision: {len(names)} ({self._names(names, limit)}): {reason}"
        return line

    def _names(self, names: List[str], limit: int) -> str:
        shown = [f"{n}: {self.notes[n]}" if self.notes.get(n) else n for n in names[:limit]]
        if len(names) > limit:
            shown.append(f"+{len(names) - limit} more")
        return ", ".join(shown)


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


def linear_alignment_problem(module: nn.Linear) -> Optional[str]:
    """Why an nn.Linear cannot run FP8 GEMMs, or None if its shape is fine."""
    bad = [
        f"{name}={value}"
        for name, value in (("in_features", module.in_features), ("out_features", module.out_features))
        if value % ALIGNMENT
    ]
    if bad:
        return f"{' and '.join(bad)} not divisible by {ALIGNMENT} (FP8 GEMMs need aligned shapes)"
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


def plan_conversion(
    model: nn.Module,
    backend: str,
    eligible: Dict[type, Callable[[nn.Module], Optional[str]]],
    is_converted: Callable[[nn.Module], bool],
    modules_to_ignore: Optional[Sequence[str]] = None,
    module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
    unfiltered: Tuple[type, ...] = (),
    keep_output_head: bool = False,
) -> Tuple[List[Tuple[str, nn.Module]], ConversionReport]:
    """Decide, module by module, what to convert.

    `eligible` maps an exact module type to a check that returns why a module of that type cannot
    be converted (None if it can). `unfiltered`: eligible types module_filter_fn is not asked
    about, since converting them decides no precision (the native engine's fused norms); they
    still honour modules_to_ignore. `keep_output_head`: leave the model's output head
    (fp8plug.layers.output_head; Plan.keep_output_head) in high precision; modules_to_ignore naming
    it too is no error. Returns the (fqn, module) pairs to convert and a report
    holding them and every skipped candidate with its reason.
    """
    check_convertible(model)
    ignore = set(modules_to_ignore or ())
    paths = module_paths(model)
    check_module_names(model, ignore, paths)
    report = ConversionReport(backend)
    targets: List[Tuple[str, nn.Module]] = []
    attention = _attention_modules(model) if nn.Linear in eligible else {}
    adapters = _adapter_modules(model)
    fused = fused_heads(model) if nn.Linear in eligible else {}
    heads = output_head_fqns(model) if keep_output_head and nn.Linear in eligible else frozenset()
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) or has_gemm_counter(module):
            report.linears.append(fqn)
        if is_converted(module):
            report.skip(fqn or "<root>", "already converted", ALREADY)
            continue
        if has_gemm_counter(module):  # an FP8 layer, but of another engine: it would stay that engine's
            raise ConversionError(
                f"cannot convert {type(model).__name__} with the {backend} engine: {fqn or '<root>'!r} is already "
                f"an FP8 layer of another engine ({type(module).__name__}); convert the plain model, or keep "
                "the engine it was converted with."
            )
        if fqn in adapters:
            report.skip(fqn, ADAPTER_NOTE, ADAPTER)
            continue
        if fqn in fused:  # fp8plug.layers.fused_heads: an FP8 module there would never run
            report.skip(fqn, fused[fqn][1], fused[fqn][0])
            continue
        if fqn in attention:
            report.skip(fqn or "<root>", attention[fqn], MHA_OUT if isinstance(module, nn.Linear) else MHA_QKV)
            continue
        check = eligible.get(type(module))
        if check is None:
            if isinstance(module, tuple(eligible)) and type(module) not in eligible:
                report.skip(fqn, (
                    f"{type(module).__name__} subclasses {_base_name(module, eligible)} but may not use its "
                    "forward; only exact types are converted"
                ), SUBCLASS, type(module).__name__)
            continue
        if ignore.intersection(paths.get(fqn, ())):  # under any of its names
            report.skip(fqn, "listed in modules_to_ignore", IGNORED)
            continue
        if fqn in heads:
            report.skip(fqn, OUTPUT_HEAD_REASON, OUTPUT_HEAD, OUTPUT_HEAD_NOTE)
            continue
        if isinstance(module, nn.Linear):
            refuse_unusable_linear(fqn, module)
        problem = check(module)
        if problem:
            report.skip(fqn, problem, NOT_ELIGIBLE, problem.split(" (")[0])
            continue
        if module_filter_fn is not None and not isinstance(module, unfiltered) and not module_filter_fn(module, fqn):
            # a filter may word its reason, its kind and a short note itself (roofline.SpeedFilter)
            reason = getattr(module_filter_fn, "skip_reason", None)
            kind = getattr(module_filter_fn, "skip_kind", None)
            note = getattr(module_filter_fn, "skip_note", None)
            report.skip(
                fqn, reason(fqn) if reason else "module_filter_fn returned False",
                (kind(fqn) if kind else None) or REFUSED, note(fqn) if note else "",
            )
            continue
        targets.append((fqn, module))
    return targets, report


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
    keep pointing at one module. The root itself cannot be replaced in place."""
    if not fqn:
        raise ConversionError("the model itself is a single convertible layer; wrap it in a container first.")
    if paths is None:
        paths = module_paths(model)
    for path in paths.get(fqn, [fqn]):
        parent_name, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)


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
