"""The records of a conversion: its decisions before anything changes, and its report after.

Why apart from the rules (layers.rules): the rules decide; these say what was decided, in the
words the log line, the report users read and the checks share. A ModulePlan holds one
ModuleDecision per candidate module (converting, with its scaling, or staying, with its reason
and the kind the summary groups it under); the ConversionReport is made from it and then says
what conversion did (`converted`), each count naming what it counts (Linear layers, norms, MoE
experts modules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from fp8plug.layers.fused_heads import LIGER_KIND, TRL_KIND

# Kinds of skip, for the one-line summary (ConversionReport.summary), which groups by kind.
ALREADY = "already converted"
IGNORED = "listed in modules_to_ignore"
OUTPUT_HEAD = "output head"
OUTPUT_HEAD_NOTE = "fp8_output_head=True runs it in FP8"
OUTPUT_HEAD_REASON = (
    "the output head stays in high precision (FP8RecipeKwargs.fp8_output_head): on real text an FP8 head "
    f"cost 1.4% final loss where every other Linear in FP8 cost none (docs/numerics.md); {OUTPUT_HEAD_NOTE}")
REFUSED = "refused by module_filter_fn"
NO_FP8_LINEAR = "norms with no FP8 Linear to feed"
NO_FP8_LINEAR_REASON = ("no Linear of the model runs in FP8 (their reasons are listed), and a fused norm only "
                        "serves the FP8 casts of the Linears reading it")
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
        lines = [f"{self.backend}: converted {self._counted(self.converted, 'norm')}, "
                 f"skipped {self._counted(self.skipped, 'other module')}"]
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
    def fp8_experts(self) -> List[str]:
        """The MoE experts modules whose grouped GEMMs run in FP8."""
        experts = set(self.experts)
        return [f for f in self.converted if f in experts]

    @property
    def high_precision_linears(self) -> Dict[str, str]:
        """The Linear layers left in high precision: fqn -> why."""
        linears = set(self.linears)
        return {f: why for f, why in self.skipped.items() if f in linears and self.kinds.get(f) != ALREADY}

    @property
    def norms(self) -> List[str]:
        """The converted modules that are neither Linear layers nor experts: the norms engines
        convert (the native engine's fused Llama-style RMSNorms, TransformerEngine's LayerNorm and
        RMSNorm)."""
        linears, experts = set(self.linears), set(self.experts)
        return [f for f in self.converted if f not in linears and f not in experts]

    def _counted(self, names, other: str) -> str:
        """'14 Linear layers and 5 norms': `names` counted by what they are (`other`: what a
        module that is neither a Linear layer nor an experts module is called)."""
        linears, experts = set(self.linears), set(self.experts)
        counts = [(sum(n in linears for n in names), "Linear layer"),
                  (sum(n in experts for n in names), "MoE experts module"),
                  (sum(n not in linears and n not in experts for n in names), other)]
        parts = [f"{n} {what}{'' if n == 1 else 's'}" for n, what in counts if n]
        return " and ".join(parts) if parts else "nothing"

    def summary(self, subject: str = "model", max_names: int = 3) -> str:
        """One line: how many Linear layers run in FP8 and why the rest do not, grouped by kind
        (at most `max_names` names per group), plus the experts and the norms converted."""
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
        norms = self.norms
        if norms:
            line += f"; also converted {self._counted(norms, 'norm')} ({self._names(norms, max_names)})"
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


@dataclass(frozen=True)
class ModuleDecision:
    """One module's decision: it converts (with `scaling`, its own scaling word where it has one),
    or it stays as it is, `reason` saying why and `kind` grouping it in the one-line summary.
    `linear`: it is a GEMM (an nn.Linear, or another engine's FP8 Linear), counted among the
    model's Linear layers whether it converts or not; a Linear that is no candidate at all (the
    engine converts no Linear here) has neither a reason nor `converts`."""

    fqn: str
    converts: bool = False
    reason: str = ""
    kind: str = ""
    note: str = ""
    scaling: Optional[str] = None
    linear: bool = False


@dataclass(frozen=True)
class ModulePlan:
    """Every candidate module's decision, in the model's order, for the engine named `engine`."""

    engine: str
    decisions: Tuple[ModuleDecision, ...] = ()

    @property
    def targets(self) -> Tuple[ModuleDecision, ...]:
        """The decisions that convert, in the model's order."""
        return tuple(d for d in self.decisions if d.converts)

    def report(self, experts: Tuple[ModuleDecision, ...] = ()) -> ConversionReport:
        """The report of this plan, and of the `experts` decisions beside it, before anything is
        converted: every Linear, every experts module, and every module left alone with its
        reason; conversion adds what it converts."""
        report = ConversionReport(self.engine)
        report.experts.extend(decision.fqn for decision in experts)
        for decision in self.decisions + tuple(experts):
            if decision.linear:
                report.linears.append(decision.fqn)
            if decision.reason:
                report.skip(decision.fqn, decision.reason, decision.kind, decision.note)
            elif decision.converts and decision.note:
                report.notes[decision.fqn] = decision.note
        return report
