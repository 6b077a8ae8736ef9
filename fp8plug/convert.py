"""Which modules an engine converts, written once for every engine, and the report of it.

The rules: a module must be of a kind the engine converts (nn.Linear exactly, and for some engines
the norms); an nn.Linear needs in and out features divisible by 16 (FP8 GEMMs need aligned
operands); `modules_to_ignore` names modules by fully-qualified name (a name that matches nothing
is an error, since it is almost always a typo); `module_filter_fn(module, fqn)` may veto any
module (a filter with a `skip_reason(fqn)` method, like the automatic roofline filter, words the
reason itself). A skipped module never stops its siblings from converting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from torch import nn

ALIGNMENT = 16


@dataclass
class ConversionReport:
    """What a conversion did: the modules converted and, for each one left alone, why."""

    backend: str
    converted: List[str] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"{self.backend}: converted {len(self.converted)} module(s), skipped {len(self.skipped)}"]
        lines += [f"  converted {name}" for name in self.converted]
        lines += [f"  skipped   {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)

    def merge(self, other: "ConversionReport") -> "ConversionReport":
        """Add `other`'s converted and skipped modules to this report (in place) and return it."""
        self.converted += other.converted
        self.skipped.update(other.skipped)
        return self


class ConversionError(ValueError):
    """A model that cannot be converted as asked (wrapped already, or a bad module name)."""


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


def check_convertible(model: nn.Module) -> None:
    """Refuse a model whose conversion must have come first: compiled, DDP- or FSDP-wrapped."""
    kind = wrapped_kind(model)
    if kind:
        raise ConversionError(
            f"cannot convert a model that is already {kind}: convert to FP8 first, then wrap "
            "(fp8plug.Accelerator.prepare does this in the right order), and compile last."
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
) -> Tuple[List[Tuple[str, nn.Module]], ConversionReport]:
    """Decide, module by module, what to convert.

    `eligible` maps an exact module type to a check that returns why a module of that type cannot
    be converted (None if it can). Returns the (fqn, module) pairs to convert and a report holding
    them and every skipped candidate with its reason.
    """
    check_convertible(model)
    ignore = set(modules_to_ignore or ())
    names = {name for name, _ in model.named_modules()}
    unknown = sorted(ignore - names)
    if unknown:
        raise ConversionError(
            f"modules_to_ignore names {unknown} that match no module of {type(model).__name__}; "
            "use fully-qualified names as model.named_modules() gives them, e.g. 'layers.0.mlp.up'."
        )
    report = ConversionReport(backend)
    targets: List[Tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        if is_converted(module):
            report.skipped[fqn or "<root>"] = "already converted"
            continue
        check = eligible.get(type(module))
        if check is None:
            if isinstance(module, tuple(eligible)) and type(module) not in eligible:
                report.skipped[fqn] = (
                    f"{type(module).__name__} subclasses {_base_name(module, eligible)} but may not use its "
                    "forward; only exact types are converted"
                )
            continue
        if fqn in ignore:
            report.skipped[fqn] = "listed in modules_to_ignore"
            continue
        problem = check(module)
        if problem:
            report.skipped[fqn] = problem
            continue
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            reason = getattr(module_filter_fn, "skip_reason", None)  # e.g. roofline.SpeedFilter
            report.skipped[fqn] = reason(fqn) if reason else "module_filter_fn returned False"
            continue
        targets.append((fqn, module))
    return targets, report


def _base_name(module: nn.Module, eligible: Iterable[type]) -> str:
    return next(t.__name__ for t in eligible if isinstance(module, t))


def replace_module(model: nn.Module, fqn: str, new: nn.Module) -> None:
    """Put `new` where `fqn` is in `model` (the root itself cannot be replaced in place)."""
    if not fqn:
        raise ConversionError("the model itself is a single convertible layer; wrap it in a container first.")
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def swap_modules(
    model: nn.Module,
    targets: List[Tuple[str, nn.Module]],
    build: Callable[[nn.Module], nn.Module],
    report: ConversionReport,
) -> ConversionReport:
    """Replace each target by `build(module)`, recording it as converted."""
    for fqn, module in targets:
        replace_module(model, fqn, build(module))
        report.converted.append(fqn)
    return report
