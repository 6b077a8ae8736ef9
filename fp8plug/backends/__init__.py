"""The engine registry and the automatic choice between engines, with a reason for each.

Engines are imported only when asked for, so `import fp8plug` never imports TransformerEngine,
MS-AMP or torchao, and a broken install of one is reported rather than raised. Engines never
import this module (the protocol and its errors live in backends/base.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Dict, Optional

from ..hardware import DeviceInfo, device_info
from ..recipe import BACKENDS, normalize_backend
from .base import Backend, BackendUnavailableError, Probe

# The automatic order, as Accelerate documents it (MS-AMP first), then torchao, then our own.
_MODULES = {
    "msamp": "fp8plug.backends.msamp:MSAMPBackend",
    "te": "fp8plug.backends.te:TEBackend",
    "ao": "fp8plug.backends.ao:AOBackend",
    "native": "fp8plug.backends.native:NativeBackend",
}
_INSTANCES: Dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The engine object for a backend name (any spelling `FP8RecipeKwargs.backend` accepts)."""
    canonical = normalize_backend(name)
    if canonical is None:
        raise ValueError(f"get_backend: name a backend, one of {', '.join(BACKENDS)}.")
    return _engine(canonical)


def _engine(canonical: str) -> Backend:
    """The engine object for a canonical name (one of BACKENDS), imported on first use."""
    if canonical not in _INSTANCES:
        module_name, class_name = _MODULES[canonical].split(":")
        _INSTANCES[canonical] = getattr(importlib.import_module(module_name), class_name)()
    return _INSTANCES[canonical]


@dataclass
class Verdict:
    """One engine's standing on this machine."""

    name: str
    title: str
    probe: Probe
    usable: bool
    reason: str  # why usable, or why not
    checked: bool = True  # False: not probed, since another engine was requested


@dataclass
class Selection:
    """The chosen engine and the reasoning for every engine considered."""

    backend: Optional[Backend]
    device: DeviceInfo
    requested: Optional[str]
    verdicts: Dict[str, Verdict] = field(default_factory=dict)

    @property
    def name(self) -> Optional[str]:
        return self.backend.name if self.backend else None

    def explain(self) -> str:
        lines = [f"device: {self.device.describe()}"]
        how = f"requested backend={self.requested!r}" if self.requested else "automatic (msamp, te, ao, native)"
        lines.append(f"selection: {how}")
        for verdict in self.verdicts.values():
            mark = "chosen" if self.backend and verdict.name == self.backend.name else (
                "usable" if verdict.usable else "no" if verdict.checked else "skipped"
            )
            version = f" {verdict.probe.version}" if verdict.probe.version else ""
            lines.append(f"  {verdict.name:7s} {verdict.title}{version}: {mark} - {verdict.reason}")
        return "\n".join(lines)


def judge(name: str, device: DeviceInfo) -> Verdict:
    """Probe one engine (by canonical name) and check it against the device."""
    backend = _engine(name)
    probe = backend.probe()
    if not probe.available:
        return Verdict(name, backend.title, probe, False, f"{probe.reason} (install: {backend.install_hint})")
    ok, why = backend.supports(device)
    if not ok:
        return Verdict(name, backend.title, probe, False, why)
    where = "FP8 GEMMs on this GPU" if device.type == "cuda" else "on the CPU"
    return Verdict(name, backend.title, probe, True, f"available, {where}")


def not_checked(name: str, requested: str) -> Verdict:
    """The verdict for an engine left unprobed because another one was requested."""
    backend = _engine(name)
    return Verdict(name, backend.title, Probe(False, reason="not checked"), False,
                   f"not checked: backend {requested!r} was requested", checked=False)


def select_backend(requested: Optional[str] = None, device=None) -> Selection:
    """Choose the engine: the requested one if it can run (else an error saying why and how to
    install it), or the first usable one in the order msamp, te, ao, native.

    In the automatic choice every engine is judged, not only the winner, so the choice can be
    explained. A requested engine is the only one probed: probing imports an engine, and an
    import can change the whole process (TransformerEngine loads its own cuDNN, which once cost
    a native-engine run 3.7% of its speed; see _te_import.share_torch_cudnn), so engines nobody asked for
    are not imported.
    """
    info = device if isinstance(device, DeviceInfo) else device_info(device)
    requested = normalize_backend(requested)  # the one place a requested name is normalised
    selection = Selection(None, info, requested)
    for name in BACKENDS:
        checked = requested is None or name == requested
        selection.verdicts[name] = judge(name, info) if checked else not_checked(name, requested)
    if requested is not None:
        verdict = selection.verdicts[requested]
        if not verdict.usable:
            raise BackendUnavailableError(
                f"FP8 backend {requested!r} ({verdict.title}) cannot run here: {verdict.reason}. "
                f"Install it with `{_engine(requested).install_hint}`, or leave backend=None to "
                "choose automatically.\n" + selection.explain()
            )
        selection.backend = _engine(requested)
        return selection
    for name in BACKENDS:
        if selection.verdicts[name].usable:
            selection.backend = _engine(name)
            return selection
    raise BackendUnavailableError(
        "No FP8 backend can run here; FP8 is not silently replaced by bf16.\n" + selection.explain()
    )


__all__ = ["Backend", "BackendUnavailableError", "Probe", "Selection", "Verdict", "get_backend", "select_backend"]
