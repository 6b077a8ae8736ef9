"""The `msamp` engine: Microsoft MS-AMP (msamp.initialize). Stub: probe only."""

from __future__ import annotations

from .base import Backend, Probe, probe_import


class MSAMPBackend(Backend):
    name = "msamp"
    title = "MS-AMP"
    install_hint = "pip install git+https://github.com/Azure/MS-AMP  (source only; needs torch 2.1 and TransformerEngine 1.x)"
    scalings = ("o2",)

    def probe(self) -> Probe:
        return probe_import("msamp")
