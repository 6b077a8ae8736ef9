"""Shared numeric checks: signal-to-quantisation-noise ratio and relative error."""

import torch


def sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """20 log10(|ref| / |actual - ref|), in float64: higher is closer."""
    reference = reference.double()
    noise = (actual.double() - reference).norm()
    if noise == 0:
        return float("inf")
    return (20 * torch.log10(reference.norm() / noise)).item()


def rel_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    return ((actual.double() - reference).norm() / reference.norm()).item()
