"""What ran in FP8, told to the user: the one log line at conversion, and the counts' read-back.

Why: an FP8 run can silently be a high-precision run (a layer an engine leaves alone, a region
that turns FP8 off, an input the GEMM cannot take): nothing fails, the loss looks fine, and the
speed-up is gone. So conversion logs why its engine was chosen (`log_selection`) and one line
saying how many Linear layers run in FP8 and why the others do not (`log_conversion`), and
`fp8_coverage(model)` reads back the per-layer counts of FP8 and high-precision calls, which
fp8plug.layers.gemm_counts keeps (how they are counted, and why that stays cheap under
torch.compile, is written there).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from accelerate.state import PartialState

from fp8plug._upstream import process_state_exists
from fp8plug.layers.gemm_counts import COUNTS, fp8_coverage  # noqa: F401  (fp8plug.coverage.fp8_coverage is public)

logger = logging.getLogger("fp8plug")


# --- the log line ------------------------------------------------------------------------------------


def is_main_process() -> bool:
    """Whether this process logs: accelerate's main process where its state exists, else rank 0
    of torch.distributed, else the RANK variable a launcher set (0 without one)."""
    if process_state_exists():  # never build it here: that would start distributed
        return bool(PartialState().is_main_process)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")


_NOTED = set()  # the selection notes already logged, once per process each


def log_selection(selection) -> None:
    """Say why the engine was chosen, on the main process, the same way for every way in: where
    the automatic choice ranked engines by measured speed, one INFO line with the figure
    (Selection.summary); where the engine Accelerate's call names was passed over, why, as a
    WARNING once per process and reason (fp8plug.backends.select_for)."""
    if not is_main_process():
        return
    if selection.mode:
        logger.info("fp8plug: FP8 engine %s", selection.summary())
    if selection.passed_over and selection.passed_over not in _NOTED:
        _NOTED.add(selection.passed_over)
        logger.warning(selection.passed_over)


def describe_engine(engine, plan=None) -> str:
    """'ao (torchao float8 0.18.0, tensorwise scaling)': the engine, its version and the scaling
    of its plan (fp8plug.recipe.plans.Plan), where given."""
    version = engine.probe().version
    details = [f"{engine.title}{f' {version}' if version else ''}"]
    scaling = plan.describe_scaling() if plan is not None else None
    if scaling:
        details.append(f"{scaling} scaling")
    return f"{engine.name} ({', '.join(details)})"


def log_conversion(report, engine_text: str, subject: str = "model") -> Optional[str]:
    """Log the conversion's one-line summary under the `fp8plug` logger, on the main process only:
    INFO when some GEMM runs in FP8 (a Linear's or MoE experts'), WARNING when none does (the model
    then trains in high precision although FP8 was asked for). The full report goes to DEBUG.
    Returns the line."""
    if not is_main_process():
        return None
    line = f"fp8plug: FP8 with {engine_text}: {report.summary(subject)}"
    if report.fp8_linears or report.fp8_experts:
        logger.info(line)
    else:
        line += "; it trains in high precision although FP8 was asked for"
        logger.warning(line)
    logger.debug("fp8plug: conversion report\n%s", report)
    return line


__all__ = ["COUNTS", "describe_engine", "fp8_coverage", "is_main_process", "log_conversion", "log_selection"]
