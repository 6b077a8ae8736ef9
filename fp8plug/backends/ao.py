"""The `ao` engine: torchao float8 training (convert_to_float8_training). Stub: probe only."""

from __future__ import annotations

from .base import Backend, Probe, probe_import


class AOBackend(Backend):
    name = "ao"
    title = "torchao float8"
    install_hint = "pip install torchao"
    runs_on_cpu = True
    scalings = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

    def probe(self) -> Probe:
        return probe_import("torchao.float8", lambda m: __import__("torchao").__version__)
