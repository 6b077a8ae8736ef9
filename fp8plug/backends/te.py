"""The `te` engine: NVIDIA TransformerEngine (transformer_engine.pytorch). Stub: probe only."""

from __future__ import annotations

from .base import Backend, Probe, probe_import


class TEBackend(Backend):
    name = "te"
    title = "TransformerEngine"
    install_hint = 'pip install --no-build-isolation "transformer_engine[pytorch]"'
    scalings = ("delayed", "current", "block", "mxfp8", "nvfp4")

    def probe(self) -> Probe:
        return probe_import("transformer_engine.pytorch", lambda m: __import__("transformer_engine").__version__)
