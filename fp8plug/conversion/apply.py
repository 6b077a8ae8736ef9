"""Carrying out a ConversionPlan: the steps that change the model, in order, deciding nothing.

Why a stage of its own: each step reads the plan (fp8plug.conversion.plan) and the engine it
names, and calls nothing back into selection or planning, so what a conversion does is what its
plan says, and a step can be read on its own. The steps: the engine swaps the modules the plan
lists (Engine.convert_listed); the experts get the engine's grouped FP8 GEMM
(fp8plug.hf.experts.convert_experts); the model is marked with its settings; one line is logged
(fp8plug.coverage); a transformers model's attention runs without a built causal mask and, where
asked, in FP8 (fp8plug.hf.attention, fp8plug.hf.fp8_attention); the numerics watch is attached
(fp8plug.numerics.watch).
"""

from __future__ import annotations

from torch import nn

from fp8plug.conversion.plan import CONVERTED_WITH, ConversionPlan
from fp8plug.coverage import describe_engine, log_conversion, logger
from fp8plug.hf.attention import skip_causal_mask
from fp8plug.hf.experts import convert_experts
from fp8plug.hf.fp8_attention import use_fp8_attention
from fp8plug.layers.rules import ConversionReport
from fp8plug.numerics.watch import watch_model


def apply_plan(model: nn.Module, conversion: ConversionPlan) -> ConversionReport:
    """Convert `model` in place as `conversion` says; returns the ConversionReport of what was
    converted and why anything was left alone."""
    engine, plan = conversion.engine, conversion.plan
    report = conversion.modules.report(conversion.experts)
    engine.convert_listed(model, plan, conversion.modules, report)
    convert_experts(model, engine, plan, conversion.experts, report)
    setattr(model, CONVERTED_WITH, dict(conversion.settings))
    log_conversion(report, describe_engine(engine, plan), type(model).__name__)
    if plan.skip_causal_mask:
        skip_causal_mask(model)
    if plan.fp8_dpa:
        use_fp8_attention(model, plan)
    if plan.numerics_watch_interval:
        watch_model(model, engine, plan, report)
    for warning in conversion.warnings:
        logger.warning(warning)
    return report


__all__ = ["apply_plan"]
