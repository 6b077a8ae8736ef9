"""`fp8plug bench`: how fast one Linear's forward+backward runs in FP8, engine by engine, against
bf16 on the same machine.

Why it exists: FP8 only pays where the GEMMs are big enough to outweigh the casts, and each engine
pays a different price for its casts. This measures that price at the shapes you care about
(default: the LLaMa-2-70B shapes used by torchao's benchmarks, M=16384 tokens), eager and
compiled, so you can pick an engine and calibrate fp8plug.roofline's automatic layer filter.

Every number is the median of timed repeats after warm-up: CUDA events on a GPU, the wall clock
on the CPU (where the default shapes are tiny: a smoke test, not a measurement). An engine that
fails at a shape gets a row with the reason instead of stopping the run.

    fp8plug bench                                   # every usable engine, default shapes
    fp8plug bench --shapes 16384x8192x8192 --modes compiled --json out.json
    python -m fp8plug.bench --engines native:dynamic,ao --csv out.csv
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

Shape = Tuple[int, int, int]
TIMINGS = ("queued", "synced")

# LLaMa-2-70B Linear shapes at 16384 tokens (M x K x N): attention qkv, attention out, MLP
# gate+up, MLP down, as in torchao's float8 benchmarks.
LLAMA70B_SHAPES: List[Shape] = [
    (16384, 8192, 10240),
    (16384, 8192, 8192),
    (16384, 8192, 57344),
    (16384, 28672, 8192),
]
CPU_SHAPES: List[Shape] = [(256, 256, 256)]
# Shapes from memory- and overhead-bound to compute-bound: what fp8plug.roofline.calibrate needs
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
CSV_COLUMNS = (
    "shape", "M", "K", "N", "mode", "engine", "backend", "scaling", "default_scaling",
    "ms", "tflops", "speedup", "vs_bf16_compiled", "error",
)


# --- parsing ------------------------------------------------------------------------------------


def parse_shapes(text: str) -> List[Shape]:
    """`MxKxN[,MxKxN...]` or a preset name (llama70b, tiny, sweep) -> [(M, K, N), ...].

    M is the token count, K the input features, N the output features. Raises ValueError naming
    the bad part and the expected form."""
    if text is None or not str(text).strip():
        raise ValueError("--shapes: empty; give MxKxN[,MxKxN...] (e.g. 16384x8192x8192) or a preset: "
                         + ", ".join(SHAPE_PRESETS))
    key = str(text).strip().lower()
    if key in SHAPE_PRESETS:
        return list(SHAPE_PRESETS[key])
    shapes = []
    for part in key.split(","):
        part = part.strip()
        if not part:
            continue
        dims = part.split("x")
        try:
            values = tuple(int(d) for d in dims)
        except ValueError:
            values = ()
        if len(dims) != 3 or len(values) != 3:
            raise ValueError(
                f"--shapes: {part!r} is not MxKxN (three integers joined by 'x', e.g. 16384x8192x8192; "
                f"presets: {', '.join(SHAPE_PRESETS)})."
            )
        if min(values) <= 0:
            raise ValueError(f"--shapes: {part!r} has a dimension <= 0; every one of M, K, N must be positive.")
        shapes.append(values)
    if not shapes:
        raise ValueError("--shapes: no shape given; use MxKxN[,MxKxN...].")
    return shapes


def parse_modes(text: str) -> List[str]:
    """`eager,compiled` -> ["eager", "compiled"]; anything else is a ValueError."""
    modes = [m.strip().lower() for m in str(text).split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes: {', '.join(bad) or 'nothing'} not allowed; use one or both of {', '.join(MODES)}.")
    return list(dict.fromkeys(modes))


def _argtype(parse):
    def convert(text):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


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
    from .backends import get_backend, judge
    from .recipe import BACKENDS, normalize_backend

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


# --- the arguments --------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `fp8plug bench`'s options to `parser` (the CLI's subcommand parser or our own)."""
    parser.add_argument(
        "--shapes", type=_argtype(parse_shapes), default=None, metavar="MxKxN,...",
        help="Linear shapes: M tokens, K in features, N out features, comma separated, or a preset "
             "(llama70b, tiny, sweep). Default: llama70b on a GPU, tiny (256x256x256) on the CPU.",
    )
    parser.add_argument(
        "--engines", default=None, metavar="LIST",
        help="auto (every usable engine, default scaling, plus the bare fp8-gemm bound), all (every "
             "scaling), or a comma list like native:dynamic,ao:tensorwise,te:current,fp8-gemm. "
             "bf16 nn.Linear is always measured as the baseline.",
    )
    parser.add_argument(
        "--modes", type=_argtype(parse_modes), default=None, metavar="eager,compiled",
        help="eager, compiled (torch.compile), or both. Default: both on a GPU, eager on the CPU.",
    )
    parser.add_argument("--compile", action="store_true", help="also run compiled (same as adding 'compiled' to --modes)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default: 5 GPU, 2 CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed iterations; the median is reported (default: 20 GPU, 5 CPU)")
    parser.add_argument(
        "--timing", choices=TIMINGS, default="queued",
        help="GPU timing: queued (the GPU's own time per step, as inside a model whose host runs "
             "ahead; default) or synced (each step alone, host time included)",
    )
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--csv", dest="csv_path", default=None, metavar="PATH", help="write the results as CSV")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


# --- measuring ------------------------------------------------------------------------------------


def flops_fwd_bwd(m: int, k: int, n: int) -> int:
    """Forward, input-gradient and weight-gradient GEMMs: 3 x 2*M*K*N."""
    return 6 * m * k * n


class _Timer:
    """Median of `repeats` runs of `step` after `warmup` runs; `reset` runs untimed before each.

    On a GPU there are two ways to time, and they answer different questions:
      queued  every repeat is enqueued behind a GPU sleep long enough for the CPU to enqueue them
              all, so each CUDA-event interval is the GPU's own time for one step. This is what a
              Linear costs inside a model whose host runs ahead of the GPU (compiled blocks,
              large batches), and what fp8plug.roofline is calibrated on. The default.
      synced  each repeat is enqueued alone on an idle GPU, so its interval also holds the host's
              time to issue the step: what one Linear called by itself costs.
    """

    def __init__(self, device: torch.device, warmup: int, repeats: int, timing: str = "queued"):
        if timing not in TIMINGS:
            raise ValueError(f"--timing: {timing!r} is not one of {', '.join(TIMINGS)}.")
        self.device, self.warmup, self.repeats, self.timing = device, warmup, repeats, timing

    def __call__(self, step, reset) -> float:
        start_wall = time.perf_counter()
        for _ in range(self.warmup):
            reset()
            step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            host_ms = (time.perf_counter() - start_wall) * 1e3 / max(self.warmup, 1)
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
            if self.timing == "queued":
                # a warm-up step's wall time bounds the host's time to enqueue one step
                _gpu_sleep(self.device, 1.5 * host_ms * self.repeats + 5.0)
            for start, end in zip(starts, ends):
                reset()
                start.record()
                step()
                end.record()
            torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        else:
            times = []
            for _ in range(self.repeats):
                reset()
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


_SLEEP_CYCLES_PER_MS: Dict[int, float] = {}


def _gpu_sleep(device: torch.device, ms: float) -> None:
    """Keep the GPU busy for about `ms` milliseconds (torch.cuda._sleep spins for a cycle count,
    measured once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SLEEP_CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize(device)
        _SLEEP_CYCLES_PER_MS[index] = cycles / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(int(min(ms, 10_000.0) * _SLEEP_CYCLES_PER_MS[index]))


class BenchSkip(RuntimeError):
    """The engine declined this shape (e.g. left the Linear unconverted): a reason, not a crash."""


def _linear_case(spec: EngineSpec, shape: Shape, mode: str, device: torch.device):
    """(step, reset) for one Linear forward+backward under `spec`."""
    m, k, n = shape
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16))
    model.train()
    autocast = None
    if spec.backend is not None:
        from .backends import get_backend
        from .recipe import FP8RecipeKwargs

        engine = get_backend(spec.backend)
        recipe = FP8RecipeKwargs(backend=spec.backend, scaling=spec.scaling)
        report = engine.convert(model, recipe)
        if not report.converted:
            why = "; ".join(f"{name}: {reason}" for name, reason in report.skipped.items()) or "nothing converted"
            raise BenchSkip(f"not converted ({why})")
        # engines that adapt a (model, optimizer) pair (MS-AMP) need one; it never steps
        optimizer = torch.optim.Adam(model.parameters(), lr=0.0)
        model = engine.prepare(model, optimizer, recipe)[0]

        def autocast():
            return engine.autocast(recipe, enabled=True)

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

    return step, reset


def _gemm_bound_case(shape: Shape, mode: str, device: torch.device):
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


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, BenchSkip):
        return str(exc)
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "CUDA out of memory at this shape"
    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def measure(spec: EngineSpec, shape: Shape, mode: str, device: torch.device, timer: _Timer,
            unavailable_reason: Optional[str] = None) -> dict:
    """One row: the median ms and TFLOP/s of `spec` at `shape` in `mode`, or the reason it failed."""
    m, k, n = shape
    row = {
        "shape": f"{m}x{k}x{n}", "M": m, "K": k, "N": n, "mode": mode,
        "engine": spec.label,
        "backend": spec.backend, "scaling": spec.scaling, "default_scaling": spec.default_scaling,
        "ms": None, "tflops": None, "speedup": None, "vs_bf16_compiled": None, "error": None,
    }
    if unavailable_reason:
        row["error"] = f"unavailable: {unavailable_reason}"
        return row
    if mode == "compiled":
        torch._dynamo.reset()  # one compile per case; never hit the recompile limit and run eager
    try:
        if spec.label == GEMM_BOUND:
            step, reset = _gemm_bound_case(shape, mode, device)
        else:
            step, reset = _linear_case(spec, shape, mode, device)
        ms = timer(step, reset)
        row["ms"] = ms
        row["tflops"] = flops_fwd_bwd(m, k, n) / (ms * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001 - a failing engine is a row with its reason
        row["error"] = _error_text(exc)
    finally:
        step = reset = None
        if mode == "compiled":
            torch._dynamo.reset()  # drop the compiled code, and with it the last case's tensors
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def add_speedups(rows: List[dict]) -> List[dict]:
    """speedup = bf16 ms / this row's ms, against bf16 at the same shape and mode; and
    vs_bf16_compiled, against compiled bf16 at the same shape (the usual baseline, e.g. for an
    engine that only runs eager)."""
    base = {(r["shape"], r["mode"]): r["ms"] for r in rows if r["engine"] == BF16 and r["ms"]}
    for row in rows:
        ref = base.get((row["shape"], row["mode"]))
        row["speedup"] = ref / row["ms"] if ref and row["ms"] else None
        ref = base.get((row["shape"], "compiled"))
        row["vs_bf16_compiled"] = ref / row["ms"] if ref and row["ms"] else None
    return rows


# --- progress and output ------------------------------------------------------------------------------


class _Progress:
    """tqdm on stderr if it is installed, else one plain line per case."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="case", dynamic_ncols=True, leave=False)
            except ImportError:
                self.bar = None

    def start(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(text)
        else:
            print(f"[{self.done + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec if abs(value) >= 10 else ".3g")


def format_table(rows: List[dict]) -> str:
    """A plain text table: shape, mode, engine, ms, TFLOP/s, speed-up over bf16 of the same mode
    (and over compiled bf16 when eager rows sit beside compiled ones), note."""
    both = {r["mode"] for r in rows} == set(MODES)
    header = ("shape (MxKxN)", "mode", "engine", "ms", "TFLOP/s", "vs bf16") + (
        ("vs bf16 compiled",) if both else ()) + ("note",)

    def ratio(value):
        return "-" if value is None else f"{value:.2f}x"

    body = [
        (r["shape"], r["mode"], r["engine"], _fmt(r["ms"], ".3f"), _fmt(r["tflops"], ".1f"), ratio(r["speedup"]))
        + ((ratio(r["vs_bf16_compiled"]),) if both else ()) + (r["error"] or "",)
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in [header] + body) for i in range(len(header) - 1)]
    lines = []
    for line in [header] + body:
        cells = [str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        lines.append("  ".join(cells + [line[-1]]).rstrip())
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def environment(device: torch.device, device_text: str) -> dict:
    """Who measured what, where: versions, device, date."""
    from . import __version__

    meta = {
        "fp8plug": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "device": device_text,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    for module in ("torchao", "transformer_engine", "msamp"):
        if module in sys.modules:
            meta[module] = getattr(sys.modules[module], "__version__", "?")
    return meta


def write_json(path: str, meta: dict, rows: List[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
        f.write("\n")


def write_csv(path: str, rows: List[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


# --- running --------------------------------------------------------------------------------------


def _settings(args) -> Tuple[torch.device, List[Shape], List[str], int, int]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda asked for but torch sees no CUDA GPU; use --device cpu.")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device: {device.type!r} is not supported; use cuda or cpu.")
    gpu = device.type == "cuda"
    shapes = args.shapes or (LLAMA70B_SHAPES if gpu else CPU_SHAPES)
    modes = list(args.modes or (["eager", "compiled"] if gpu else ["eager"]))
    if getattr(args, "compile", False) and "compiled" not in modes:
        modes.append("compiled")
    warmup = args.warmup if args.warmup is not None else (5 if gpu else 2)
    repeats = args.repeats if args.repeats is not None else (20 if gpu else 5)
    if warmup < 0:
        raise ValueError("--warmup: must be >= 0.")
    if repeats < 1:
        raise ValueError("--repeats: must be >= 1.")
    return device, shapes, modes, warmup, repeats


def run(args: argparse.Namespace) -> int:
    """Run the benchmark `args` describe, print the table, write --json / --csv.

    Returns 0 if at least one case was measured, 1 if none was, 2 for bad options."""
    from .hardware import device_info

    try:
        device, shapes, modes, warmup, repeats = _settings(args)
        info = device_info(device)
        specs, unavailable = resolve_engines(args.engines, info)
    except ValueError as exc:
        print(f"fp8plug bench: {exc}", file=sys.stderr)
        return 2
    explicit = args.engines is not None and args.engines.strip().lower() not in ("auto", "all")
    cases = [EngineSpec(BF16)] + [s for s in specs if explicit or s.backend not in unavailable]
    timing = getattr(args, "timing", "queued")
    timer = _Timer(device, warmup, repeats, timing)
    print(f"fp8plug bench on {info.describe()}: Linear forward+backward, bf16 weights and inputs, "
          f"median of {repeats} after {warmup} warm-up")
    for name, why in unavailable.items():
        print(f"  {name}: not measured: {why}")
    progress = _Progress(len(shapes) * len(modes) * len(cases), enabled=not getattr(args, "no_progress", False))
    rows = []
    try:
        for shape in shapes:
            for mode in modes:
                for spec in cases:
                    progress.start(f"{shape[0]}x{shape[1]}x{shape[2]} {mode} {spec.label}")
                    rows.append(measure(spec, shape, mode, device, timer, unavailable.get(spec.backend)))
                    progress.advance()
    finally:
        progress.close()
    add_speedups(rows)
    print(format_table(rows))
    meta = environment(device, info.describe())
    meta.update(warmup=warmup, repeats=repeats, modes=modes, shapes=[list(s) for s in shapes],
                unavailable=unavailable,
                timing=f"cuda events, {timing}" if device.type == "cuda" else "wall clock")
    if args.json_path:
        write_json(args.json_path, meta, rows)
        print(f"wrote {args.json_path}")
    if args.csv_path:
        write_csv(args.csv_path, rows)
        print(f"wrote {args.csv_path}")
    return 0 if any(r["ms"] is not None for r in rows) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m fp8plug.bench [options]`: the same as `fp8plug bench`."""
    parser = argparse.ArgumentParser(prog="fp8plug bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
