"""Per-layer GEMM counters: which calls of each converted Linear ran in FP8 and which did not.

An FP8 run can silently be a high-precision run (a layer left alone, a region that turns FP8 off,
an input the GEMM cannot take): nothing fails and the speed-up is gone. So each converted
nn.Linear counts its forward calls in two bins, FP8 and high precision, as its engine answers
(its optional `runs_fp8`), and `fp8_coverage(model)` reads them back. What a call is, and what is not
counted: docs/troubleshooting.md, "Is it really FP8?".
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from fp8plug.layers.ddp_buffers import ignore_in_ddp

# The counts live in a non-persistent int64 buffer of two elements on the layer's device, added to
# in place by a forward pre-hook: a compiled graph mutates it like any buffer (no Python state, no
# recompiles), eagerly it is one tiny kernel a call. It is left out of the state dict and of DDP's
# buffer broadcast. This module imports nothing of fp8plug's but ddp_buffers and finds engines
# through the lookup the registry hands it, so it sits below conversion, the engines and the registry.
COUNTS = "fp8plug_gemm_counts"  # buffer name: [FP8 calls, high-precision calls]
# The same two bins on a mixture-of-experts experts module (fp8plug.hf.experts), added to by its
# forward: one per projection's grouped GEMM (two a call). A name of its own, so an experts module
# is never taken for a converted Linear.
EXPERT_COUNTS = "fp8plug_expert_gemm_counts"
EXPERT_COUNTS_ON_META = "_fp8plug_counts_on_meta"  # experts module attribute: its counts were made on meta
FP8, HIGH_PRECISION = 0, 1


class GemmCounter:
    """The forward pre-hook that counts one call of a converted Linear as FP8 or high precision.

    A picklable object (not a closure) so converted models still pickle; it keeps the engine's
    name and looks the engine up again after unpickling."""

    def __init__(self, backend: str, on_meta: bool = False):
        self.backend = backend
        self._engine = _engine(backend)
        # counts made on the meta device hold whatever memory held once materialised (to_empty)
        self.on_meta = on_meta

    def __getstate__(self):
        return {"backend": self.backend, "on_meta": self.on_meta}

    def __setstate__(self, state):
        self.backend = state["backend"]
        self.on_meta = state.get("on_meta", False)
        self._engine = _engine(self.backend)

    def settle(self, module: nn.Module) -> None:
        if self.on_meta:
            self.on_meta = not settle_counts(module, COUNTS)

    def __call__(self, module: nn.Module, args, kwargs):
        self.settle(module)
        x = args[0] if args else next(iter(kwargs.values()), None)
        fp8 = bool(self._engine.runs_fp8(module, x))
        if not (fp8 or module.training):
            return None
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return None  # a forward recomputed during backward (activation checkpointing)
        module._buffers[COUNTS].select(0, FP8 if fp8 else HIGH_PRECISION).add_(1)
        return None


def settle_counts(module: nn.Module, name: str) -> bool:
    """Zero `module`'s counts buffer `name`, made on the meta device, once it has been given memory
    (to_empty leaves whatever memory held), or make it where the weights were assigned and the
    counts left behind on meta; whether that is done (False: all still on meta)."""
    counts = module._buffers[name]
    weight = next((p for p in module.parameters(recurse=False)), None)
    if counts.is_meta and (weight is None or weight.is_meta):
        return False
    device = weight.device if counts.is_meta else counts.device
    module._buffers[name] = torch.zeros(2, dtype=torch.int64, device=device)
    return True


def settle_expert_counts(module: nn.Module) -> None:
    """settle_counts for an experts module whose counts were made on meta (EXPERT_COUNTS_ON_META)."""
    if getattr(module, EXPERT_COUNTS_ON_META, False):
        setattr(module, EXPERT_COUNTS_ON_META, not settle_counts(module, EXPERT_COUNTS))


def settle_all(model: nn.Module) -> None:
    """Settle every counts buffer of `model` that was made on meta and has memory now. Called
    outside compiled code (fp8plug.Accelerator.prepare, fp8_coverage) so that a compiled forward
    does not settle them itself: the flag it would flip is a guard, and flipping it recompiles the
    model at its second step (seen under FSDP2 with meta initialisation: the toy MoE on the CPU;
    the Mixtral row on an H200 recompiled there too, 5.6 s)."""
    for module in _unwrap(model).modules():
        for hook in module._forward_pre_hooks.values() if has_gemm_counter(module) else ():
            if isinstance(hook, GemmCounter):
                hook.settle(module)
        if EXPERT_COUNTS in module._buffers:
            settle_expert_counts(module)


# Set by the engine registry (fp8plug.backends) when it is imported, which `import fp8plug` does
# before any of its submodules loads: name -> the engine that counts its layers' calls, or None
# where the engine cannot say per call whether a layer runs in FP8. Handed down rather than
# imported, so counting (and conversion, which installs the counters) sits below the registry.
_counting_engine: Optional[Callable[[str], Any]] = None


def use_engine_lookup(lookup: Callable[[str], Any]) -> None:
    """Called once by the registry: how a counter finds its engine by name (after unpickling too)."""
    global _counting_engine
    _counting_engine = lookup


def _engine(backend: str):
    if _counting_engine is None:  # pragma: no cover - fp8plug/__init__ imports the registry first
        raise RuntimeError("fp8plug.layers.gemm_counts: no engine registry; import fp8plug first.")
    return _counting_engine(backend)


def engine_counts(backend: str) -> bool:
    """Whether the engine says, per call, whether a layer runs in FP8 (it has `runs_fp8`)."""
    return _engine(backend) is not None


def count_gemms(root: nn.Module, fqn: str, module: nn.Module, backend: str) -> bool:
    """Give the converted Linear `module` (at `fqn` in `root`) its counter; False where the engine
    cannot say per call whether it runs FP8. Idempotent."""
    if has_gemm_counter(module):
        return True
    if not engine_counts(backend):
        return False
    device = next((p.device for p in module.parameters(recurse=False)), None)
    module.register_buffer(COUNTS, torch.zeros(2, dtype=torch.int64, device=device), persistent=False)
    module.register_forward_pre_hook(GemmCounter(backend, on_meta=device is not None and device.type == "meta"),
                                     with_kwargs=True)
    ignore_in_ddp(root, [f"{fqn}.{COUNTS}" if fqn else COUNTS])
    return True


def count_expert_gemms(root: nn.Module, fqn: str, module: nn.Module, device: torch.device) -> None:
    """Give the MoE experts module `module` (at `fqn` in `root`) its counts (EXPERT_COUNTS), on
    `device`, which its forward adds to (fp8plug.hf.experts); made on meta, they are zeroed once
    given memory (settle_expert_counts). Idempotent."""
    if EXPERT_COUNTS in module._buffers:
        return
    module.register_buffer(EXPERT_COUNTS, torch.zeros(2, dtype=torch.int64, device=device), persistent=False)
    setattr(module, EXPERT_COUNTS_ON_META, device.type == "meta")
    ignore_in_ddp(root, [f"{fqn}.{EXPERT_COUNTS}" if fqn else EXPERT_COUNTS])


def has_gemm_counter(module: nn.Module) -> bool:
    return COUNTS in module._buffers


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside torch.compile's and DDP's wrappers, so names are the user's own."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, nn.parallel.DistributedDataParallel):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


# The model's attribute holding the numerics guard's moves (fp8plug.numerics.guard.moves_of):
# {layer fqn: {"scaling": where it went, "why": ..., "step": ...}}, which fp8_coverage shows.
GUARD_MOVES = "_fp8plug_guard_moves"


def fp8_coverage(model: nn.Module, reset: bool = False) -> dict:
    """The running GEMM counts of `model`'s converted Linear layers:

        {"fp8_gemms": int, "high_precision_gemms": int, "layers": {fqn: (fp8, high_precision)}}

    with "scalings": {fqn: scaling word} too where the layers name their scaling by one word (the
    native engine's: per-layer scaling, or a guard's change, shows there), and "moved": {fqn: what
    the numerics guard did and why} where it moved a layer (fp8plug.numerics.guard).

    counted per forward call since conversion or the last reset (what counts as a call:
    docs/troubleshooting.md). `reset=True` zeroes the counts after reading them, e.g. once per
    logging interval.
    Reading costs one device synchronisation. A model with no counted layer gives zeros and {}.
    """
    model = _unwrap(model)
    settle_all(model)
    found = [(fqn, m._buffers[COUNTS] if has_gemm_counter(m) else m._buffers[EXPERT_COUNTS])
             for fqn, m in model.named_modules() if has_gemm_counter(m) or EXPERT_COUNTS in m._buffers]
    found = [(fqn, counts) for fqn, counts in found if counts.device.type != "meta"]
    layers: Dict[str, Tuple[int, int]] = {}
    if found:
        with torch.no_grad():
            values = torch.stack([counts.detach().to(found[0][1].device) for _, counts in found]).tolist()
            if reset:
                for _, counts in found:
                    counts.zero_()
        layers = {fqn: (int(fp8), int(hp)) for (fqn, _), (fp8, hp) in zip(found, values)}
    # each layer's scaling, where its module names it by one word (per-layer scaling, a guard's change)
    scalings = {fqn: m.scaling for fqn, m in model.named_modules()
                if has_gemm_counter(m) and isinstance(getattr(m, "scaling", None), str)}
    coverage = {
        "fp8_gemms": sum(fp8 for fp8, _ in layers.values()),
        "high_precision_gemms": sum(hp for _, hp in layers.values()),
        "layers": layers,
    }
    if scalings:
        coverage["scalings"] = scalings
    moves = model.__dict__.get(GUARD_MOVES)
    if moves:  # {fqn: "moved to bf16 by the numerics guard (SQNR 12.3 dB < 20 dB for 3 checks)"}
        coverage["moved"] = {fqn: f"moved to {m['scaling']} by the numerics guard ({m['why']})"
                             for fqn, m in moves.items()}
    return coverage


__all__ = ["COUNTS", "EXPERT_COUNTS", "EXPERT_COUNTS_ON_META", "count_expert_gemms", "count_gemms", "engine_counts",
           "fp8_coverage", "has_gemm_counter", "settle_all", "settle_counts", "settle_expert_counts",
           "use_engine_lookup"]
