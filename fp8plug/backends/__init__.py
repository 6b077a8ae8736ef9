"""The engine registry and the automatic choice between engines, with a reason for each.

Which engines exist, where their code lives and how fast they were measured is one row each in
fp8plug.recipe.engines; this module imports an engine from its row only when asked for, so
`import fp8plug` never imports TransformerEngine, MS-AMP or torchao, and a broken install of one
is reported rather than raised. Engines never import this module (the protocol and its errors
live in backends/base.py).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Dict, Optional

from fp8plug.backends.base import BackendUnavailableError, Engine, Probe, offers
from fp8plug.layers import gemm_counts
from fp8plug.recipe.engines import ENGINES, MEASURED_ON, Speed
from fp8plug.recipe.kwargs import BACKENDS, normalize_backend
from fp8plug.tuning.hardware import DeviceInfo, device_info

_INSTANCES: Dict[str, Engine] = {}
_A = {"compiled": "a compiled", "eager": "an eager"}
MODES = ("compiled", "eager")  # how a model can run, each with its measured figure (EngineRow.measured)
# bf16 eager's speed against bf16 compiled in the run behind the measured figures: an FP8 engine
# below it is slower than not using FP8 at all when the model runs eagerly
BF16_EAGER_SPEEDUP = 0.84
ORDER = ", ".join(BACKENDS)  # the automatic order where measured speed does not decide (the rows')


def get_backend(name: str) -> Engine:
    """The engine object for a backend name (any spelling `FP8RecipeKwargs.backend` accepts)."""
    canonical = normalize_backend(name)
    if canonical is None:
        raise ValueError(f"get_backend: name a backend, one of {', '.join(BACKENDS)}.")
    return _engine(canonical)


def _engine(canonical: str) -> Engine:
    """The engine object for a canonical name (one of BACKENDS), imported on first use."""
    if canonical not in _INSTANCES:
        module_name, class_name = ENGINES[canonical].engine.split(":")
        _INSTANCES[canonical] = getattr(importlib.import_module(module_name), class_name)()
    return _INSTANCES[canonical]


def _counting_engine(name: str) -> Optional[Engine]:
    """The engine named `name` where it says, per call, whether a converted Linear runs in FP8
    (it offers `runs_fp8`), else None: what a GEMM counter asks (fp8plug.layers.gemm_counts)."""
    engine = get_backend(name)
    return engine if offers(engine, "runs_fp8") else None


def _measured(name: str) -> Dict[str, Speed]:
    """The engine's measured speed by mode (its row's)."""
    return ENGINES[name].measured


# GEMM counters sit below the registry (conversion installs them), so the registry hands them
# its lookup instead of being imported by them.
gemm_counts.use_engine_lookup(_counting_engine)


@dataclass
class Verdict:
    """One engine's standing on this machine."""

    name: str
    title: str
    probe: Probe
    usable: bool
    reason: str  # why usable, or why not
    checked: bool = True  # False: not probed, since another engine was requested
    install: bool = False  # whether installing (or repairing) the package is the fix


@dataclass
class Selection:
    """The chosen engine and the reasoning for every engine considered."""

    backend: Optional[Engine]
    device: DeviceInfo
    requested: Optional[str]
    verdicts: Dict[str, Verdict] = field(default_factory=dict)
    # "compiled" or "eager" when the automatic choice ranked by measured speed in a known mode;
    # "any" when ranked for a model that may run either way (see select_backend)
    mode: Optional[str] = None
    # why the engine Accelerate's call names was passed over (select_for), for the log; "" if it was not
    passed_over: str = ""

    @property
    def name(self) -> Optional[str]:
        return self.backend.name if self.backend else None

    @property
    def speed(self) -> Optional[Speed]:
        """The chosen engine's measured speed in this selection's mode (None outside a ranked
        choice); for "any", its compiled figure, with the scaling it was measured with in both
        modes (None where the two differ)."""
        return _speed(self.name, self.mode) if self.backend and self.mode else None

    def tune(self, recipe):
        """`recipe` with the settings the chosen engine was measured fastest with (its `scaling`),
        where the choice was automatic and ranked and the user set no scaling; else `recipe`."""
        speed = self.speed
        if self.requested or speed is None or speed.scaling is None or recipe.scaling is not None:
            return recipe
        return dataclasses.replace(recipe, scaling=speed.scaling)

    def summary(self) -> str:
        """One line: the engine, and why where the choice was ranked by measured speed."""
        speed = self.speed
        if speed is None:
            return f"{self.name}"
        with_scaling = f" with {speed.scaling} scaling" if speed.scaling else ""
        if self.mode == "any":
            figures = ", ".join(f"{_measured(self.name)[m].speedup:.2f}x {m}" for m in MODES)
            line = (f"{self.name}{with_scaling}, measured fastest however the model is held, eager or "
                    f"compiled before or after prepare ({figures}, against bf16 compiled; {MEASURED_ON})")
            return line + self._costs_eager()
        line = (f"{self.name}{with_scaling}, measured fastest for {_A[self.mode]} model "
                f"({speed.speedup:.2f}x bf16 compiled; {MEASURED_ON})")
        if self.mode == "eager" and speed.speedup < BF16_EAGER_SPEEDUP:
            line += (f"; slower than plain bf16 eager ({BF16_EAGER_SPEEDUP:.2f}x) all the same: compile the model "
                     "(Accelerator(dynamo_backend='inductor')) or install TransformerEngine for FP8's speed")
        return line

    def _costs_eager(self) -> str:
        """Where the choice for either mode is slower eagerly than an engine that was not chosen,
        by more than 2%: what that costs, and the fix for a model that will never be compiled."""
        usable = [n for n, v in self.verdicts.items() if v.usable or not v.checked]
        rivals = [(_measured(n)["eager"].speedup, n) for n in usable if n != self.name and "eager" in _measured(n)]
        if not rivals:
            return ""
        best, name = max(rivals)
        mine = _measured(self.name)["eager"].speedup
        if mine >= best * 0.98:
            return ""
        return (f"; run eagerly (never compiled) it is {1 - mine / best:.0%} slower than {name} "
                f"({mine:.2f}x against {best:.2f}x): compile the model, or, for a model that stays "
                f"eager, pass backend='{name}' where it is installed")

    def explain(self) -> str:
        lines = [f"device: {self.device.describe()}"]
        if self.requested:
            how = f"requested backend={self.requested!r}"
        elif self.mode == "any":
            how = ("automatic, the engine whose slower mode (eager or compiled) comes closest to the "
                   f"fastest engine in that mode ({MEASURED_ON}); unmeasured engines and ties within 1% "
                   f"in the order {ORDER}")
        elif self.mode:
            how = (f"automatic, the fastest measured for {_A[self.mode]} model ({MEASURED_ON}); "
                   f"unmeasured engines and ties within 1% in the order {ORDER}")
        else:
            how = f"automatic ({ORDER})"
        lines.append(f"selection: {how}")
        for verdict in self.verdicts.values():
            mark = "chosen" if self.backend and verdict.name == self.backend.name else (
                "usable" if verdict.usable else "no" if verdict.checked else "skipped"
            )
            version = f" {verdict.probe.version}" if verdict.probe.version else ""
            speeds = _measured(verdict.name)
            modes = (MODES if self.mode == "any" else (self.mode,)) if self.mode else ()
            figures = [f"{m}: {speeds[m].speedup:.2f}x bf16 compiled"
                       + (f", {speeds[m].scaling} scaling" if speeds[m].scaling else "")
                       for m in modes if m in speeds]
            measured = f" [{'; '.join(figures)}]" if figures else ""
            lines.append(f"  {verdict.name:7s} {verdict.title}{version}: {mark} - {verdict.reason}{measured}")
        return "\n".join(lines)


def judge(name: str, device: DeviceInfo, scaling=None) -> Verdict:
    """Probe one engine (by canonical name) and check it against the device and, where given,
    the scaling the recipe asks for (an engine without it is passed over unprobed)."""
    return _lacking(scaling, (name,)).get(name) or _probe(name, device)


def _lacking(scaling, names=BACKENDS, label: str = "FP8RecipeKwargs.scaling") -> Dict[str, Verdict]:
    """The verdicts of the engines among `names` that have no `scaling` (FP8RecipeKwargs.scaling,
    named as `label` says: with its variable where the environment set it; None: every engine has
    its default): passed over unprobed, so never imported for nothing."""
    lacking = {}
    for name in names if scaling is not None else ():
        engine = _engine(name)
        if not engine.offers_scaling(scaling):
            lacking[name] = Verdict(
                name, engine.title, Probe(False, reason="not checked"), False,
                f"has no {scaling!r} scaling ({label}; its own: {', '.join(engine.scalings)})", checked=False)
    return lacking


def _probe(name: str, device: DeviceInfo) -> Verdict:
    """Probe one engine (by canonical name) and check it against the device."""
    engine = _engine(name)
    probe = engine.probe()
    if device.type == "cpu":  # an engine that cannot run on the CPU: installing would not help
        ok, why = engine.supports(device)
        if not ok:
            return Verdict(name, engine.title, probe, False, why)
    if not probe.available:
        return Verdict(name, engine.title, probe, False, f"{probe.reason} (install: {engine.install_hint})",
                       install=True)
    ok, why = engine.supports(device)
    if not ok:
        return Verdict(name, engine.title, probe, False, why)
    where = "FP8 GEMMs on this GPU" if device.type == "cuda" else "on the CPU"
    return Verdict(name, engine.title, probe, True, f"available, {where}")


def not_checked(name: str, why: str) -> Verdict:
    """The verdict for an engine left unprobed (unimported), and `why`."""
    engine = _engine(name)
    return Verdict(name, engine.title, Probe(False, reason="not checked"), False, f"not checked: {why}",
                   checked=False)


def _none_usable(selection: Selection) -> BackendUnavailableError:
    return BackendUnavailableError(
        "No FP8 backend can run here; FP8 is not silently replaced by bf16.\n" + selection.explain())


def select_backend(requested: Optional[str] = None, device=None, compiled: Optional[bool] = None,
                   scaling=None) -> Selection:
    """Choose the engine: the requested one if it can run (else an error saying why and how to
    install it), or automatically among the usable ones. Automatically, on a device with FP8
    GEMMs, by measured speed (the rows' `measured`, fp8plug.recipe.engines): where it is known
    how the model will run (`compiled` True or False), the engine fastest in that mode; where it
    is not (None: most training loops call torch.compile(model) themselves after prepare, which
    nothing can see coming), the engine that loses least in its slower mode, so that the default
    is fast however the model is held. Between engines within 1% or unmeasured, and on a device
    without FP8 GEMMs, the first usable one in the rows' order (ORDER). `Selection.tune` then
    gives the recipe the settings that figure was measured with.

    In the automatic choice by order every engine is judged, not only the winner, so the choice
    can be explained. A requested engine is the only one probed, and the choice by measured speed
    stops at the first usable engine: probing imports an engine, and an import can change the
    whole process (TransformerEngine loads its own cuDNN; see _te_import.share_torch_cudnn and
    _ranked_choice), so engines that cannot be chosen are not imported. `scaling` (the recipe's
    FP8RecipeKwargs.scaling): the automatic choice passes over the engines that do not offer it.
    """
    requested = normalize_backend(requested)  # the one place a requested name is normalised
    info = device if isinstance(device, DeviceInfo) else device_info(device)
    return _select(requested, info, compiled, {} if requested else _lacking(scaling))


def select_for(recipe, device=None, compiled: Optional[bool] = None, accelerate_call: bool = False,
               backend: Optional[str] = None) -> Selection:
    """The engine for `recipe` (an FP8RecipeKwargs): the one rule fp8plug.convert_model and
    fp8plug.Accelerator share. The engine `backend` names (any spelling; "auto": the automatic
    choice), else the one `recipe.backend` names, else the automatic choice (select_backend, for
    the model's mode `compiled`, passing over engines without `recipe.scaling`), on `device` (None:
    the current one). `accelerate_call`: convert_model called as Accelerate's API (no recipe,
    backend nor compiled), which converts to TransformerEngine where TE runs, as Accelerate's
    convert_model documents ("converts ... to their transformers_engine counterpart"); where TE
    cannot run, the automatic choice, with why TE was passed over (`Selection.passed_over`, logged
    once per process: fp8plug.coverage.log_selection)."""
    requested = recipe.backend if backend is None else normalize_backend(backend)
    info = device if isinstance(device, DeviceInfo) else device_info(device)
    lacking = {} if requested else _lacking(recipe.scaling, label=recipe.label("scaling"))
    if not accelerate_call or requested is not None:
        return _select(requested, info, compiled, lacking)
    te = lacking.get("te") or _probe("te", info)
    if te.usable:
        return _select("te", info, None, {})
    selection = _select(None, info, None, lacking)
    selection.passed_over = (
        "fp8plug: convert_model(model) converts to TransformerEngine where it runs, as Accelerate's does; "
        f"TransformerEngine cannot run here ({te.reason}), so it converts with {selection.name}, the "
        "automatic choice (has_transformer_engine_layers(model) stays False). Pass backend='auto' for the "
        "automatic choice without this note, or name an engine (`fp8plug env` lists what runs here).")
    return selection


def _select(requested: Optional[str], info: DeviceInfo, compiled: Optional[bool],
            lacking: Dict[str, Verdict]) -> Selection:
    """The choice select_backend describes, for a canonical name (or None), where `lacking` holds
    the verdicts of the engines without the recipe's scaling (_lacking)."""
    selection = Selection(None, info, requested)
    if requested is None and info.type == "cuda" and info.fp8_gemm:
        return _ranked_choice(selection, "any" if compiled is None else "compiled" if compiled else "eager", lacking)
    for name in BACKENDS:
        if requested is not None and name != requested:
            selection.verdicts[name] = not_checked(name, f"backend {requested!r} was requested")
        else:
            selection.verdicts[name] = lacking.get(name) or _probe(name, info)
    if requested is not None:
        verdict = selection.verdicts[requested]
        if not verdict.usable:  # one line: the other engines were not judged, so not listed
            engine = _engine(requested)
            raise engine.unavailable(verdict.probe.reason if verdict.install else verdict.reason,
                                     install=verdict.install)
        selection.backend = _engine(requested)
        return selection
    for name in BACKENDS:
        if selection.verdicts[name].usable:
            selection.backend = _engine(name)
            return selection
    raise _none_usable(selection)


def _ranked_choice(selection: Selection, mode: str, lacking: Optional[Dict[str, Verdict]] = None) -> Selection:
    """The automatic choice by measured speed in `mode`: engines are probed fastest first and the
    first usable one wins; slower ones are not imported. That matters: importing TransformerEngine
    loads its cuDNN, after which torch ran a Llama's attention with its memory-efficient kernel
    instead of cuDNN's (2.5x the attention time, seen on the H100 with the native engine chosen)."""
    selection.mode = mode
    for name in _fastest_first(list(BACKENDS), mode):
        if selection.backend is None:
            selection.verdicts[name] = verdict = (lacking or {}).get(name) or _probe(name, selection.device)
            if verdict.usable:
                selection.backend = _engine(name)
        else:
            selection.verdicts[name] = not_checked(name, f"{selection.backend.name} ranks before it")
    selection.verdicts = {name: selection.verdicts[name] for name in BACKENDS}
    if selection.backend is None:
        raise _none_usable(selection)
    return selection


def _speed(name: str, mode: str) -> Optional[Speed]:
    """The engine's measured speed in `mode`; for "any", its compiled figure with the scaling of
    both modes' measurements where they agree (else None: the engine's default)."""
    measured = _measured(name)
    if mode != "any":
        return measured.get(mode)
    if not all(m in measured for m in MODES):
        return None
    scalings = {measured[m].scaling for m in MODES}
    return Speed(measured["compiled"].speedup, scalings.pop() if len(scalings) == 1 else None)


def _scores(names, mode: str) -> Dict[str, Optional[float]]:
    """Each engine's figure to rank by in `mode` (None: unmeasured). In a known mode its speed-up;
    for "any", the worse of its two fractions of the fastest engine in each mode (an engine 14%
    behind when compiled and level when eager scores 0.86)."""
    if mode != "any":
        return {n: (_measured(n)[mode].speedup if mode in _measured(n) else None) for n in names}
    best = {m: max((_measured(n)[m].speedup for n in names if m in _measured(n)), default=0.0) for m in MODES}
    return {n: (min(_measured(n)[m].speedup / best[m] for m in MODES)
                if all(m in _measured(n) for m in MODES) else None) for n in names}


def _fastest_first(names, mode: str):
    """`names` (in the automatic order) ranked by measured speed in `mode` (_scores), fastest
    first; a figure within 1% of a faster one counts as a tie, and ties and unmeasured engines
    keep the automatic order (Python's sort is stable)."""
    scores = _scores(names, mode)
    best = max((s for s in scores.values() if s is not None), default=0.0)

    def rank(name):
        score = scores[name]
        if score is None:
            return (2, 0.0)
        return (0, 0.0) if score >= best * 0.99 else (1, -score)

    return sorted(names, key=rank)


__all__ = ["Engine", "BackendUnavailableError", "Probe", "Selection", "Verdict", "get_backend", "select_backend",
           "select_for"]
