"""The numerics watch: every N optimizer steps, what FP8 does to each converted layer's operands.

Why: a layer whose activations grow outliers, or whose delayed scale lags its tensors, loses
precision silently; the loss shows it thousands of steps later. So, on a watch step only, every
converted Linear's forward hook reads its input and weight and puts a tensor hook on its output
(the gradient arriving at it); on other steps the hook returns at once (compiled: it is not in
the graph at all, see `arm`, and the watch step itself runs eagerly: `_EagerWatchStep`). Each operand is
re-quantized as the layer's scaling implies (fp8plug.numerics.emulate: the engine's own scale
where it offers `operand_scales`, else the current amax's) to measure its amax, the fraction
flushed to zero and the fraction saturated, and a sample of rows (`SAMPLE_ROWS`) is multiplied
both ways, in FP8 emulation and in float32, for the SQNR of the forward GEMM and of the
input-gradient GEMM.

One check gives a flat dict {"fp8/<layer>/<operand>/<stat>": float, "fp8/<layer>/sqnr_db": ...}
(what `accelerator.log` sends to any tracker), one INFO line naming the worst layers, and the
guard's decision (fp8plug.numerics.guard). Nothing here asks which engine runs: converted layers
are found with `Engine.is_converted`, FP8 calls with the optional `runs_fp8`.

Values are this process's own (its batch); they are not reduced across ranks, except the guard's
decision, which every rank takes alike. A model compiled before conversion has no hooks in its
graph; where a watch step saw no layer run, one warning says so.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from fp8plug.backends import steps
from fp8plug.backends.base import offers
from fp8plug.coverage import is_main_process
from fp8plug.numerics import emulate, tap
from fp8plug.numerics.guard import NumericsGuard

logger = logging.getLogger("fp8plug")
SAMPLE_ROWS = 64  # rows of each GEMM recomputed in float32 for its SQNR
OPERANDS = ("input", "weight", "grad_output")
_WATCHES: "weakref.WeakKeyDictionary[nn.Module, NumericsWatch]" = weakref.WeakKeyDictionary()


def eager_stance():
    """Until the returned stance is exited, torch.compile runs only what it has already compiled
    and runs anything else eagerly (torch.compiler.set_stance("eager_on_recompile")); None where
    that cannot be set: a torch without set_stance, or inside a compiled region."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return None
    try:
        return set_stance("eager_on_recompile")
    except RuntimeError:  # inside a torch.compile region
        return None


class _EagerWatchStep:
    """The watch step of a compiled model runs eagerly: from the end of the step before a check
    to the end of the check's step, `eager_stance` holds (where that step ran a compiled graph).

    Why: armed, a compiled model's hooks fail its graph's guard (`armed`), and compiling a graph
    for the watch step cost a whole model's compile at the first check (96 s for the 162M Llama of
    benchmarks/training/real_text.py on an H200, 2026-11-27) against an eager step's fraction of a
    second; the ordinary steps keep their graph either way. Inside the window nothing new is
    compiled anywhere in the process (it runs eagerly instead), so the window is closed when the
    step ends, when the watch is closed and when the model is collected. With a check every step
    there is no ordinary step to keep: the armed graph is compiled (whole: fp8plug.numerics.tap),
    as it is where the stance cannot be set."""

    told = False  # the log line, once per process

    def __init__(self):
        self.stance = None

    def open(self) -> None:
        if self.stance is None:
            self.stance = eager_stance()
            if self.stance is not None and not _EagerWatchStep.told:
                _EagerWatchStep.told = True
                logger.info("fp8plug: numerics watch steps run eagerly under torch.compile: from the end of the step "
                            "before a check to the end of the check's step, torch.compile runs only what it has "
                            "compiled already (docs/numerics.md)")

    def close(self) -> None:
        stance, self.stance = self.stance, None
        if stance is not None:
            stance.__exit__(None, None, None)  # back to the stance the window found


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A tensor the watch can compute with: a sharded (DTensor) weight gathered whole, detached."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach()


class _GatedHook:
    """A converted Linear's forward hook: nothing unless its watch is armed."""

    def __init__(self, watch: "NumericsWatch", fqn: str):
        self.watch, self.fqn = watch, fqn

    def __call__(self, module, args, output):
        if not torch.compiler.is_compiling():  # traced, this branch is dropped: nothing of it in the graph
            self.watch.ran_eagerly = True
        if self.watch.armed:
            return self.watch._on_forward(self.fqn, module, args, output)
        return None


class NumericsWatch:
    """The watch of one converted model: `interval` (>= 1) steps apart, on steps interval, 2 *
    interval, ... (counting the optimizer steps since it was attached). `grad_dtype` is the FP8
    format of gradients (E5M2 under HYBRID). `guard`: the NumericsGuard acting on the checks, or
    None. `on_check(stats, step)` is called after each check (fp8plug.Accelerator logs to its
    trackers there)."""

    def __init__(self, model: nn.Module, engine, interval: int, grad_dtype: torch.dtype = emulate.E5M2,
                 guard: Optional[NumericsGuard] = None, on_check: Optional[Callable] = None, report=None):
        if interval < 1:
            raise ValueError(f"numerics watch: interval {interval!r} must be at least 1 (0 turns the watch off).")
        self._model = weakref.ref(model)
        self.engine = engine
        self.interval = interval
        self.grad_dtype = grad_dtype
        self.guard = guard
        self.on_check = on_check
        self.report = report  # the conversion's ConversionReport, which the guard's moves update
        self.step = 0
        self.checks = 0
        self.handles: List = []  # (module, hook handle)
        self.armed = False
        self._eager_step = _EagerWatchStep()
        self.ran_eagerly = False  # a hook ran outside a compiled graph since the last step ended
        weakref.finalize(model, self._eager_step.close)
        self.records: Dict[str, Dict[str, float]] = {}
        self._scales: Dict[str, dict] = {}  # per layer watched this step: the scales its forward cast with
        self._token = tap.register(self)
        self.latest: Dict[str, float] = {}
        self._unread = False
        self._warned_empty = False
        self._warned_errors: set = set()
        steps.after_step(model, self.end_step)
        self.hook_layers()
        if self._due(1):
            self.arm()

    @property
    def model(self) -> Optional[nn.Module]:
        return self._model()

    def _due(self, step: int) -> bool:
        return step % self.interval == 0

    def layers(self) -> List[Tuple[str, nn.Module]]:
        """The converted Linear layers (a converted module with a 2-D weight), in order."""
        model = self.model
        if model is None:
            return []
        return [(fqn, m) for fqn, m in model.named_modules()
                if self.engine.is_converted(m) and getattr(getattr(m, "weight", None), "dim", lambda: 0)() == 2]

    # hooks, acting on watch steps only ------------------------------------------------------------
    # Each converted Linear carries one forward hook for good, which returns at once unless the
    # step is a watch step (`armed`). Not hooks put on for a watch step and taken off after it:
    # torch.compile traces the hooks a module has when it compiles and never sees one added later,
    # so a model compiled after prepare would never be watched. Compiled, the flag is a guard of
    # the graph: the steps between checks run a graph without the hook at all, a watch step
    # another one (compiled once), whose statistics run eagerly inside two opaque custom ops
    # (fp8plug.numerics.tap), not in a graph break, which would cost every later step its graph.
    def hook_layers(self) -> None:
        """Hook every converted Linear not hooked yet (at conversion, before anyone compiles)."""
        hooked = {id(module) for module, _ in self.handles}
        for fqn, module in self.layers():
            if id(module) not in hooked:
                self.handles.append((module, module.register_forward_hook(_GatedHook(self, fqn))))

    def arm(self, compiled: bool = False) -> None:
        """Watch the coming step; `compiled`: the last step ran the model as a compiled graph
        (its hooks never ran eagerly), so the watch step runs eagerly (`_EagerWatchStep`)."""
        self.records, self._scales = {}, {}
        self.hook_layers()  # a layer the guard moved to another FP8 scaling is a new module
        self.armed = True
        if compiled and self.interval > 1:
            self._eager_step.open()

    def disarm(self) -> None:
        self.armed = False
        self._eager_step.close()

    def remove_hooks(self) -> None:
        self.disarm()
        for _, handle in self.handles:
            handle.remove()
        self.handles = []

    def _on_forward(self, fqn: str, module: nn.Module, args, output):
        """An armed hook's work: compiled, the taps (the output replaced by the tap's copy); eager,
        or with operands the taps cannot take, `_observe`."""
        if torch.compiler.is_compiling() and tap.fits(args, output):
            if not module.training:
                return None
            return tap.numerics_tap(output, args[0], self._token, fqn)
        self._observe(fqn, module, args, output)
        return None

    @torch.compiler.disable
    def _observe(self, fqn: str, module: nn.Module, args, output) -> None:
        if not args or not isinstance(args[0], torch.Tensor):
            return
        if self._measure_forward(fqn, module, args[0]) and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._grad_hook(fqn, module))

    def _grad_hook(self, fqn: str, module: nn.Module):
        def hook(grad):
            self._measure_grad(fqn, module, grad)
        return hook

    def record_forward(self, fqn: str, x: torch.Tensor) -> None:
        """Layer `fqn`'s forward ran with input `x` (fp8plug.numerics.tap, compiled)."""
        model = self.model
        if self.armed and model is not None:
            self._measure_forward(fqn, model.get_submodule(fqn), x)

    def record_grad(self, fqn: str, grad: torch.Tensor) -> None:
        """The gradient at layer `fqn`'s output (fp8plug.numerics.tap, compiled)."""
        model = self.model
        if model is not None and fqn in self._scales and "dgrad_sqnr_db" not in self.records.get(fqn, {}):
            self._measure_grad(fqn, model.get_submodule(fqn), grad)

    def _measure_forward(self, fqn: str, module: nn.Module, x: torch.Tensor) -> bool:
        """The forward statistics of `fqn`'s first call this step; whether it was measured."""
        if fqn in self.records or not module.training:
            return False
        if offers(self.engine, "runs_fp8") and not self.engine.runs_fp8(module, x):
            return False
        try:
            scales = self.engine.operand_scales(module) if offers(self.engine, "operand_scales") else {}
            with torch.no_grad():
                self.records[fqn] = self._forward_stats(module, x, scales)
            self._scales[fqn] = scales
            return True
        except Exception as exc:  # noqa: BLE001 - the watch must never stop a training run
            self._skip(fqn, exc)
            return False

    def _measure_grad(self, fqn: str, module: nn.Module, grad: torch.Tensor) -> None:
        try:
            with torch.no_grad():
                self.records.setdefault(fqn, {}).update(self._grad_stats(module, grad, self._scales.get(fqn, {})))
        except Exception as exc:  # noqa: BLE001
            self._skip(fqn, exc)

    def _skip(self, fqn: str, exc: Exception) -> None:
        if fqn not in self._warned_errors:
            self._warned_errors.add(fqn)
            logger.warning("fp8plug: the numerics watch skips %s: %s: %s", fqn, type(exc).__name__, exc)

    # the statistics -------------------------------------------------------------------------------
    def _forward_stats(self, module: nn.Module, x: torch.Tensor, scales: dict) -> Dict[str, float]:
        x2 = x.detach().reshape(-1, x.shape[-1])
        w = _plain(module.weight)
        out = {}
        x_scale = emulate.resolve_scale(x2, emulate.E4M3, scales.get("input"))
        w_scale = emulate.resolve_scale(w, emulate.E4M3, scales.get("weight"), weight=True)
        for name, t, scale in (("input", x2, x_scale), ("weight", w, w_scale)):
            out.update({f"{name}/{k}": v for k, v in emulate.operand_stats(t, scale, emulate.E4M3).items()})
        index = emulate.sample_index(x2.shape[0], SAMPLE_ROWS, x2.device)
        xs = x2.index_select(0, index)
        xs_scale = x_scale.index_select(0, index) if x_scale.dim() == 2 and x_scale.shape[0] > 1 else x_scale
        reference = xs.float() @ w.float().t()
        fp8 = emulate.fake_quantize(xs, xs_scale, emulate.E4M3) @ emulate.fake_quantize(w, w_scale, emulate.E4M3).t()
        out["sqnr_db"] = emulate.sqnr_db(reference, fp8)
        return out

    def _grad_stats(self, module: nn.Module, grad: torch.Tensor, scales: dict) -> Dict[str, float]:
        g2 = grad.detach().reshape(-1, grad.shape[-1])
        w = _plain(module.weight)
        g_scale = emulate.resolve_scale(g2, self.grad_dtype, scales.get("grad_output"))
        out = {f"grad_output/{k}": v for k, v in emulate.operand_stats(g2, g_scale, self.grad_dtype).items()}
        index = emulate.sample_index(g2.shape[0], SAMPLE_ROWS, g2.device)
        gs = g2.index_select(0, index)
        gs_scale = g_scale.index_select(0, index) if g_scale.dim() == 2 and g_scale.shape[0] > 1 else g_scale
        w_scale = emulate.resolve_scale(w, emulate.E4M3, scales.get("weight"), weight=True)
        reference = gs.float() @ w.float()
        fp8 = emulate.fake_quantize(gs, gs_scale, self.grad_dtype) @ emulate.fake_quantize(w, w_scale, emulate.E4M3)
        out["dgrad_sqnr_db"] = emulate.sqnr_db(reference, fp8)
        return out

    # checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> Dict:
        """What a checkpoint keeps of the watch (plain numbers and strings): the optimizer steps it
        has counted, its checks, and the guard's streaks. With it a resumed run checks at the same
        steps, hands trackers the same step numbers and moves layers at the same checks as one that
        never stopped."""
        state: Dict = {"step": self.step, "checks": self.checks}
        if self.guard is not None:
            state["guard"] = self.guard.state_dict()
        return state

    def load_state_dict(self, state: Dict) -> None:
        """Continue from a saved `state_dict`: its step count and checks, the guard's streaks (a
        guard with none saved starts afresh); armed for the coming step if that one is a check."""
        self.step = int(state.get("step", 0))
        self.checks = int(state.get("checks", 0))
        if self.guard is not None:
            self.guard.load_state_dict(state.get("guard", {}))
        if self.armed:
            self.disarm()
        if self._due(self.step + 1):
            self.arm()

    # the end of each optimizer step -------------------------------------------------------------
    def end_step(self) -> None:
        """After each optimizer step that trains the model (fp8plug.backends.steps.after_step): on
        a watch step, finish the check; before one, arm the hooks."""
        self.step += 1
        compiled, self.ran_eagerly = not self.ran_eagerly, False
        if self.armed:
            self.disarm()
            self._finish()
        if self._due(self.step + 1):
            self.arm(compiled)

    def _finish(self) -> None:
        records, self.records, self._scales = self.records, {}, {}
        if not records:
            if not self._warned_empty:
                self._warned_empty = True
                logger.warning(
                    "fp8plug: the numerics watch saw no FP8 layer run at step %d (a model compiled before "
                    "fp8plug converted it runs without the watch's hooks: compile after prepare)", self.step)
            return
        self.checks += 1
        self.latest = flat_stats(records)
        self._unread = True
        if is_main_process():
            logger.info("fp8plug: %s", summary_line(records, self.step))
        if self.guard is not None and self.model is not None:
            self.guard.check(self.model, self.engine, records, self.step, self.report)
        if self.on_check is not None:
            self.on_check(self.latest, self.step)

    def take(self) -> Dict[str, float]:
        """The latest check's flat dict, once (then {} until the next check)."""
        if not self._unread:
            return {}
        self._unread = False
        return dict(self.latest)

    def close(self) -> None:
        """Stop watching: hooks removed, no more checks."""
        self.remove_hooks()
        model = self.model
        if model is not None:
            steps.remove_after_step(model, self.end_step)
            _WATCHES.pop(model, None)


def flat_stats(records: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """{"fp8/<layer>/<operand>/<stat>": value, "fp8/<layer>/sqnr_db": value, ...} for the trackers."""
    return {f"fp8/{fqn}/{key}": float(value) for fqn, stats in records.items() for key, value in stats.items()}


def summary_line(records: Dict[str, Dict[str, float]], step: int, worst: int = 3) -> str:
    """One line per check: the layers checked, the `worst` by forward SQNR, and the largest
    saturated and flushed fractions with their layers."""
    by_sqnr = sorted(((stats.get("sqnr_db", math.inf), fqn) for fqn, stats in records.items()))
    shown = ", ".join(f"{fqn} {value:.1f} dB" for value, fqn in by_sqnr[:worst])

    def largest(stat: str) -> str:
        value, fqn = max(((stats.get(f"{op}/{stat}", 0.0), fqn) for fqn, stats in records.items() for op in OPERANDS),
                         default=(0.0, "-"))
        return f"{100 * value:.3g}% ({fqn})" if value > 0 else "0%"

    return (f"numerics at step {step}: {len(records)} FP8 layers; worst SQNR {shown}; "
            f"most saturated {largest('saturated')}; most flushed to zero {largest('flushed')}")


def watch_model(model: nn.Module, engine, plan, report=None) -> Optional[NumericsWatch]:
    """Attach the watch (and guard) `plan` asks for to a converted `model` (once); None when its
    `numerics_watch_interval` is 0."""
    if not plan.numerics_watch_interval:
        return None
    existing = _WATCHES.get(model)
    if existing is not None:
        return existing
    guard = (NumericsGuard(plan.guard_min_sqnr_db, plan.guard_max_saturation, plan.guard_patience)
             if plan.numerics_guard else None)
    grad_dtype = emulate.E5M2 if getattr(plan, "fp8_format", "HYBRID") == "HYBRID" else emulate.E4M3
    watch = _WATCHES[model] = NumericsWatch(model, engine, plan.numerics_watch_interval, grad_dtype, guard,
                                            report=report)
    return watch


def watch_of(model: nn.Module) -> Optional[NumericsWatch]:
    """The watch attached to `model` (or to the model a torch.compile wrapper holds), if any."""
    return _WATCHES.get(getattr(model, "_orig_mod", model))


def watch_state(model: nn.Module) -> Dict:
    """The state of `model`'s watch for a checkpoint ({} without a watch)."""
    watch = watch_of(model)
    return watch.state_dict() if watch is not None else {}


def load_watch_state(model: nn.Module, state: Dict) -> None:
    """Put a checkpoint's `watch_state` back into `model`'s watch; nothing without a watch or a
    saved state (then `what_starts_afresh` says what that means)."""
    watch = watch_of(model)
    if watch is not None and state:
        watch.load_state_dict(state)


def what_starts_afresh(model: nn.Module, state: Dict) -> Optional[str]:
    """What of `model`'s watch cannot continue from the saved `state` (a checkpoint written without
    the watch, without the guard, or before fp8plug kept their state), in words; None if all can."""
    watch = watch_of(model)
    if watch is None:
        return None
    if not state:
        guard = " and the numerics guard's counts of bad checks start afresh" if watch.guard is not None else ""
        return f"the numerics watch counts optimizer steps from this resume (checks every {watch.interval}){guard}"
    if watch.guard is not None and "guard" not in state:
        return "the numerics guard's counts of bad checks start afresh (the saved run had no guard)"
    return None


def numerics_stats(model: nn.Module) -> Dict[str, float]:
    """The latest check's flat dict for `model`, once per check ({} otherwise, or without a watch):
    what to pass to `accelerator.log` or any tracker."""
    watch = watch_of(model)
    return watch.take() if watch is not None else {}
