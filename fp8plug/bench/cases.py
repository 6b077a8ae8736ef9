"""What `fp8plug bench` measures: the shapes, the engines (bf16, each FP8 engine with a scaling, the
bare FP8 GEMM bound), and for each a (step, reset) pair of callables that the timer runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

Shape = Tuple[int, int, int]

# LLaMa-2-70B Linear shapes at 16384 tokens (M x K x N): attention qkv, attention out, MLP
# gate+up, MLP down, as in torchao's float8 benchmarks.
LLAMA70B_SHAPES: List[Shape] = [
    (16384, 8192, 10240),
    (16384, 8192, 8192),
    (16384, 8192, 57344),
    (16384, 28672, 8192),
]
CPU_SHAPES: List[Shape] = [(256, 256, 256)]
# Shapes from memory- and overhead-bound to compute-bound: what fp8plug.tuning.roofline_fit.calibrate needs
# to pin down peak, bandwidth and overhead separately.
SWEEP_SHAPES: List[Shape] = [
    (m, k, n)
    for m in (2048, 16384)
    for k, n in ((1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192), (1024, 8192), (8192, 1024))
] + [(16384, 128, 8192), (16384, 8192, 128)] + [
    # the Linears of train_step.py's probe (d=4096, ffn 16384) and 1b (d=2048, ffn 8192) models
    (8192, k, n) for k, n in ((4096, 4096), (4096, 16384), (16384, 4096), (2048, 2048), (2048, 8192), (8192, 2048))
]
SHAPE_PRESETS: Dict[str, List[Shape]] = {
    "llama70b": LLAMA70B_SHAPES,
    "tiny": CPU_SHAPES,
    "sweep": SWEEP_SHAPES,
}
MODES = ("eager", "compiled")
BF16 = "bf16"
GEMM_BOUND = "fp8-gemm"  # the three FP8 GEMMs alone, operands cast beforehand: an upper bound


@dataclass(frozen=True)
class EngineSpec:
    """One column of the comparison: bf16, the bare FP8 GEMM bound, or an engine with a scaling."""

    label: str
    backend: Optional[str] = None  # None for bf16 and the GEMM bound
    scaling: Optional[str] = None
    default_scaling: bool = True


def resolve_engines(text: Optional[str], device_info) -> Tuple[List[EngineSpec], Dict[str, str]]:
    """Which FP8 variants to run, and the engines left out with the reason.

    `text`: None or "auto" (every engine usable here, with its default scaling, plus the FP8 GEMM
    bound), "all" (every scaling of every usable engine, plus the bound), or a comma list of
    `engine[:scaling]` and `fp8-gemm`. An engine named explicitly that cannot run here still gets
    rows, each with the reason, so the table says why it is missing.
    """
    from fp8plug.backends import get_backend, judge
    from fp8plug.recipe.kwargs import BACKENDS, normalize_backend

    key = (text or "auto").strip().lower()
    specs: List[EngineSpec] = []
    unavailable: Dict[str, str] = {}
    if key in ("auto", "all"):
        for name in BACKENDS:
            verdict = judge(name, device_info)
            if not verdict.usable:
                unavailable[name] = verdict.reason
                continue
            scalings = get_backend(name).scalings if key == "all" else get_backend(name).scalings[:1]
            for i, scaling in enumerate(scalings):
                specs.append(EngineSpec(f"{name}:{scaling}", name, scaling, i == 0))
        specs.append(EngineSpec(GEMM_BOUND))
        return specs, unavailable
    for part in (p.strip() for p in key.split(",")):
        if not part:
            continue
        if part in (GEMM_BOUND, "gemm"):
            specs.append(EngineSpec(GEMM_BOUND))
            continue
        name, _, scaling = part.partition(":")
        try:
            canonical = normalize_backend(name)
        except ValueError:
            canonical = None
        if canonical is None:
            raise ValueError(
                f"--engines: unknown engine {name!r}; use auto, all, or a comma list of "
                f"{', '.join(BACKENDS)} (optionally name:scaling) and {GEMM_BOUND}."
            )
        engine = get_backend(canonical)
        scaling = scaling.strip() or engine.scalings[0]
        if scaling not in engine.scalings:
            raise ValueError(
                f"--engines: {scaling!r} is not a {engine.title} scaling; use one of {', '.join(engine.scalings)}."
            )
        verdict = judge(canonical, device_info)
        if not verdict.usable:
            unavailable[canonical] = verdict.reason
        specs.append(EngineSpec(f"{canonical}:{scaling}", canonical, scaling, scaling == engine.scalings[0]))
    if not specs:
        raise ValueError("--engines: nothing to run; name at least one engine.")
    return list(dict.fromkeys(specs)), unavailable


class BenchSkip(RuntimeError):
    """The engine declined this shape (e.g. left the Linear unconverted): a reason, not a crash."""


def linear_case(spec: EngineSpec, shape: Shape, mode: str, device: torch.device):
    """(step, reset) for one Linear forward+backward under `spec`."""
    m, k, n = shape
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16))
    model.train()
    autocast = engine = None
    if spec.backend is not None:
        from fp8plug.backends import get_backend
        from fp8plug.backends.base import offers
        from fp8plug.backends.steps import end_step
        from fp8plug.recipe.kwargs import FP8RecipeKwargs
        from fp8plug.recipe.plans import make_plan

        engine = get_backend(spec.backend)
        plan = make_plan(engine, FP8RecipeKwargs(backend=spec.backend, scaling=spec.scaling), device)
        report = engine.convert(model, plan)
        if not report.converted:
            why = "; ".join(f"{name}: {reason}" for name, reason in report.skipped.items()) or "nothing converted"
            raise BenchSkip(f"not converted ({why})")
        if offers(engine, "prepare"):  # an engine adapting a (model, optimizer) pair (MS-AMP): one that never steps
            model = engine.prepare(model, torch.optim.Adam(model.parameters(), lr=0.0), plan)[0]

        def autocast():
            return engine.autocast(plan, enabled=True)

    fn = torch.compile(model) if mode == "compiled" else model
    params = [p for p in model.parameters() if p.requires_grad]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(m, n, device=device, dtype=torch.bfloat16)

    def reset():
        x.grad = None
        for p in params:
            p.grad = None

    def step():
        if autocast is None:
            y = fn(x)
        else:
            with autocast():
                y = fn(x)
        y.backward(grad_out)
        if engine is not None:
            # the end of a training step: delayed scaling's update, which the optimizer step hook
            # runs in training (TransformerEngine runs its own when its autocast exits)
            end_step([model], [engine])

    return step, reset


def build_case(spec: EngineSpec, shape: Shape, mode: str, device: torch.device):
    """(step, reset) for any column: the bare FP8 GEMMs, or a Linear under `spec`."""
    if spec.label == GEMM_BOUND:
        return gemm_bound_case(shape, mode, device)
    return linear_case(spec, shape, mode, device)


def gemm_bound_case(shape: Shape, mode: str, device: torch.device):
    """(step, reset) for the three FP8 GEMMs of a Linear with every operand already cast and laid
    out as torch._scaled_mm wants: no amax, no cast, no transpose. No engine can beat it."""
    m, k, n = shape
    torch.manual_seed(0)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    x = torch.randn(m, k, device=device).to(e4m3)
    w = torch.randn(n, k, device=device).to(e4m3)
    g = torch.randn(m, n, device=device).to(e5m2)
    w_col = w.t().contiguous().t()  # (N, K) column-major: dgrad's second operand
    g_t = g.t().contiguous()  # (N, M) row-major: wgrad's first operand
    x_col = x.t().contiguous().t()  # (M, K) column-major: wgrad's second operand
    one = torch.ones((), device=device)

    def gemms(x, w, g, w_col, g_t, x_col):
        kw = dict(scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        y = torch._scaled_mm(x, w.t(), use_fast_accum=True, **kw)
        dx = torch._scaled_mm(g, w_col, **kw)
        dw = torch._scaled_mm(g_t, x_col, **kw)
        return y, dx, dw

    fn = torch.compile(gemms) if mode == "compiled" else gemms
    return (lambda: fn(x, w, g, w_col, g_t, x_col)), (lambda: None)
