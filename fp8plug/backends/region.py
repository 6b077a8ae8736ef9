"""The FP8 region: one process-wide flag saying whether converted layers run FP8 right now.

Why shared: the native and ao engines' layers make the same choice (FP8 inside an enabled region,
high precision inside a disabled one, and outside any region FP8 in training mode only), and one
region opened by either engine's autocast governs both kinds of layer, so the flag must be one
object that neither engine owns.
"""

from __future__ import annotations

from typing import Optional


class _Region:
    """Whether an FP8 autocast region is open: None outside any region (modules then follow
    their own training flag), True or False inside one.

    One instance holds the flag, not the class: torch.compile (torch 2.11) cannot trace setting a
    class attribute and broke the graph at every region's entry, so a compiled model wrapped by
    the autocast compiled as two graphs."""

    def __init__(self):
        self.enabled: Optional[bool] = None


_REGION = _Region()


def fp8_now(training: bool) -> bool:
    """Whether a layer in `training` mode runs FP8 now: the region's choice, else training mode."""
    region = _REGION.enabled
    return training if region is None else region


class fp8_region:
    """Run the layers that follow this flag in FP8 (enabled) or in high precision (disabled)
    inside the block.

    A plain class rather than a generator so torch.compile traces it without a graph break."""

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)
        self.previous = None

    def __enter__(self):
        self.previous = _REGION.enabled
        _REGION.enabled = self.enabled
        return self

    def __exit__(self, *exc):
        _REGION.enabled = self.previous
        return False
