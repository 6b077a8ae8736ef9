"""An opt-in automatic layer filter: keep in bf16 the Linears where FP8 would be slower.

Why: FP8 halves GEMM time but adds casts (amax, scale, cast, transpose) whose cost grows with
M*K + K*N + M*N, not with M*K*N, plus a fixed per-layer overhead. For small K or N the casts and
the overhead outweigh the GEMM saving and an FP8 layer is slower than bf16. A roofline-style cost
model says which side of that line a layer falls on:

    t(M, K, N) = sum over the 3 GEMMs of max(flops / peak, bytes / bandwidth)
                 + cast bytes / bandwidth   (FP8 only)
                 + overhead

for bf16 and for each FP8 engine, with peak, bandwidth and overhead fitted to `fp8plug bench`
measurements by `calibrate`. Use it through FP8RecipeKwargs:

    from fp8plug.roofline import calibrate, load_bench, make_module_filter
    constants = calibrate(load_bench("bench.json"))          # optional; defaults otherwise
    keep_fast = make_module_filter("native", tokens=batch * seq_len, constants=constants)
    FP8RecipeKwargs(backend="native", module_filter_fn=keep_fast)

The model is deliberately small: it only has to rank bf16 against FP8 for one layer at a time.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from torch import nn

from .recipe import normalize_backend

BF16_KEY = "bf16"
# Bytes moved per element of each cast tensor (input, weight, grad_output) in FP8: read bf16 for the
# amax (2), read bf16 again to cast (2), write the FP8 copy and its transposed copy (1 + 1).
CAST_BYTES_PER_ELEMENT = 6


@dataclass(frozen=True)
class Costs:
    """The achieved (not datasheet) speed of one kernel family on one device.

    peak_tflops: dense GEMM throughput reached on large shapes.
    bandwidth_gbs: memory bandwidth reached by memory-bound GEMMs and the FP8 casts.
    overhead_us: fixed cost of one Linear forward+backward (launches, autograd, scale bookkeeping).
    note: where the numbers come from ("PLACEHOLDER ..." or "calibrated ...").
    """

    peak_tflops: float
    bandwidth_gbs: float
    overhead_us: float
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> "Costs":
        return cls(float(data["peak_tflops"]), float(data["bandwidth_gbs"]), float(data["overhead_us"]),
                   str(data.get("note", "")))


_PLACEHOLDER = "PLACEHOLDER H100 SXM guess, compiled mode; not calibrated: run `fp8plug bench` and calibrate()"
# PLACEHOLDERS, NOT MEASUREMENTS: rough H100 SXM figures (about 75% of datasheet bf16/FP8 peak,
# about 85% of 3.35 TB/s HBM3, a guessed fixed cost). They rank FP8 against bf16 sensibly at the
# extremes (at 16384 tokens: K = N = 8192 converts at about 1.6x; K = N = 1024, or K or N <= 512,
# stays bf16) but have not been fitted to any measurement. Replace them with calibrate() on `fp8plug bench --shapes sweep` JSON.
DEFAULT_H100: Dict[str, Costs] = {
    BF16_KEY: Costs(peak_tflops=750.0, bandwidth_gbs=3000.0, overhead_us=40.0, note=_PLACEHOLDER),
    "native": Costs(peak_tflops=1400.0, bandwidth_gbs=2800.0, overhead_us=100.0, note=_PLACEHOLDER),
    "ao": Costs(peak_tflops=1400.0, bandwidth_gbs=2800.0, overhead_us=100.0, note=_PLACEHOLDER),
    "te": Costs(peak_tflops=1400.0, bandwidth_gbs=2600.0, overhead_us=150.0, note=_PLACEHOLDER),
    "msamp": Costs(peak_tflops=1200.0, bandwidth_gbs=2000.0, overhead_us=300.0, note=_PLACEHOLDER),
}


# --- the cost model ---------------------------------------------------------------------------------


def _terms(m: int, k: int, n: int, fp8: bool) -> Tuple[List[Tuple[float, float]], float]:
    """([(flops, bytes) per GEMM], cast bytes) for one Linear forward+backward.

    The GEMMs: forward (M,K)x(K,N), input gradient (M,N)x(N,K), weight gradient (N,M)x(M,K); each
    reads its two operands (2 bytes an element in bf16, 1 in FP8) and writes a bf16 result."""
    gemms = ((m, k, n), (m, n, k), (n, m, k))
    operand = 1 if fp8 else 2
    terms = [(2.0 * a * b * c, operand * (a * b + b * c) + 2.0 * a * c) for a, b, c in gemms]
    cast = CAST_BYTES_PER_ELEMENT * float(m * k + k * n + m * n) if fp8 else 0.0
    return terms, cast


def predict_ms(m: int, k: int, n: int, costs: Costs, fp8: bool) -> float:
    """Predicted milliseconds for one Linear forward+backward at M tokens, K in, N out features."""
    terms, cast = _terms(m, k, n, fp8)
    peak, bw = costs.peak_tflops * 1e12, costs.bandwidth_gbs * 1e9
    seconds = sum(max(f / peak, b / bw) for f, b in terms) + cast / bw + costs.overhead_us * 1e-6
    return seconds * 1e3


def _lookup(constants: Mapping[str, Costs], backend: str, scaling: Optional[str]) -> Costs:
    for key in ((f"{backend}:{scaling}",) if scaling else ()) + (backend,):
        if key in constants:
            return constants[key]
    raise KeyError(
        f"roofline: no constants for engine {backend!r}{f' scaling {scaling!r}' if scaling else ''}; "
        f"have {sorted(constants)}. Calibrate with `fp8plug bench --engines {backend}` rows, or pass "
        "constants that include it."
    )


def predicted_speedup(m: int, k: int, n: int, backend: str, scaling: Optional[str] = None,
                      constants: Optional[Mapping[str, Costs]] = None) -> float:
    """bf16 time / FP8 time for one Linear forward+backward (> 1: FP8 is faster)."""
    constants = dict(DEFAULT_H100, **(constants or {}))
    backend = normalize_backend(backend)
    bf16 = predict_ms(m, k, n, constants[BF16_KEY], fp8=False)
    return bf16 / predict_ms(m, k, n, _lookup(constants, backend, scaling), fp8=True)


def make_module_filter(
    backend: str,
    tokens: int,
    *,
    scaling: Optional[str] = None,
    constants: Optional[Mapping[str, Costs]] = None,
    min_speedup: float = 1.0,
) -> Callable[[nn.Module, str], bool]:
    """A `module_filter_fn(module, fqn)` for FP8RecipeKwargs that converts an nn.Linear only if the
    cost model predicts FP8 at least `min_speedup` times faster than bf16 for `backend`.

    tokens: the token count M each Linear sees per step on one GPU (batch size x sequence length).
    constants: name -> Costs, e.g. from calibrate(); missing names fall back to DEFAULT_H100
    (placeholders). Modules other than nn.Linear are always accepted (the engine decides).
    The returned function records its verdicts in `fn.decisions` (fqn -> predicted speed-up).
    """
    backend = normalize_backend(backend)
    if backend is None:
        raise ValueError("make_module_filter: name the engine (native, ao, te or msamp); the model is per engine.")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(
            f"make_module_filter: tokens must be a positive integer (batch size x sequence length per "
            f"GPU), got {tokens!r}."
        )
    if not min_speedup > 0:
        raise ValueError(f"make_module_filter: min_speedup must be > 0, got {min_speedup!r}.")
    table = dict(DEFAULT_H100, **(constants or {}))
    bf16 = table[BF16_KEY]
    fp8 = _lookup(table, backend, scaling)
    guessed = [name for name, c in ((BF16_KEY, bf16), (backend, fp8)) if c.note.startswith("PLACEHOLDER")]
    if guessed:
        warnings.warn(
            f"roofline: the constants for {' and '.join(guessed)} are placeholders (H100 guesses, not "
            "measurements); calibrate them: fp8plug.roofline.calibrate(load_bench('bench.json')) on "
            "`fp8plug bench --shapes sweep --json bench.json` from your GPU.",
            stacklevel=2,
        )
    decisions: Dict[str, float] = {}

    def module_filter_fn(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True
        k, n = module.in_features, module.out_features
        speedup = predict_ms(tokens, k, n, bf16, fp8=False) / predict_ms(tokens, k, n, fp8, fp8=True)
        decisions[fqn] = speedup
        return speedup >= min_speedup

    module_filter_fn.decisions = decisions
    module_filter_fn.__doc__ = (f"roofline filter: {backend} FP8 where predicted >= {min_speedup}x over bf16 "
                                f"at {tokens} tokens")
    return module_filter_fn


# --- calibration ----------------------------------------------------------------------------------


def load_bench(path: str) -> List[dict]:
    """The rows of a `fp8plug bench --json` file."""
    with open(path) as f:
        return _rows(json.load(f))


def _rows(data) -> List[dict]:
    if isinstance(data, Mapping):
        if "rows" not in data:
            raise ValueError("calibrate: expected fp8plug bench JSON ({'meta': ..., 'rows': [...]}) or its rows.")
        data = data["rows"]
    return list(data)


def calibrate(json_rows, mode: Optional[str] = None, min_shapes: int = 3) -> Dict[str, Costs]:
    """Fit peak, bandwidth and overhead per engine (and bf16) to `fp8plug bench` rows.

    json_rows: the bench JSON (a dict with "rows") or its list of rows. mode: "eager" or
    "compiled" (default: compiled if any compiled rows, else eager), since the constants differ.
    Returns {"bf16": Costs, "native:delayed": Costs, "native": Costs, ...}: each engine label,
    and the bare engine name for its default scaling. An engine with fewer than `min_shapes`
    measured shapes is left out. For well-determined constants, bench shapes that span
    memory-bound to compute-bound (`--shapes sweep`); the 70B shapes alone only fix the peak.
    """
    rows = [r for r in _rows(json_rows) if r.get("ms") and not r.get("error")]
    if mode is None:
        mode = "compiled" if any(r.get("mode") == "compiled" for r in rows) else "eager"
    rows = [r for r in rows if r.get("mode", mode) == mode]
    groups: Dict[str, List[Tuple[int, int, int, float]]] = {}
    aliases: Dict[str, str] = {}
    for r in rows:
        label = r["engine"]
        if label != BF16_KEY and not r.get("backend"):
            continue  # the bare GEMM bound is no engine
        groups.setdefault(label, []).append((int(r["M"]), int(r["K"]), int(r["N"]), float(r["ms"]) * 1e-3))
        if r.get("backend") and r.get("default_scaling", True):
            aliases[r["backend"]] = label
    out: Dict[str, Costs] = {}
    for label, samples in groups.items():
        if len({s[:3] for s in samples}) < min_shapes:
            continue
        peak, bw, overhead, err = _fit(samples, fp8=label != BF16_KEY)
        note = f"calibrated on {len(samples)} {mode} rows, rms relative error {100 * err:.1f}%"
        out[label] = Costs(peak / 1e12, bw / 1e9, overhead * 1e6, note)
    for backend, label in aliases.items():
        if label in out:
            out[backend] = out[label]
    return out


def _fit(samples: List[Tuple[int, int, int, float]], fp8: bool) -> Tuple[float, float, float, float]:
    """(peak flop/s, bandwidth B/s, overhead s, rms relative error) minimising the relative error.

    For a given peak and bandwidth the best overhead is a weighted mean (closed form, clamped at
    zero); peak and bandwidth are searched on a log grid that is refined around the best point."""
    data = [(_terms(m, k, n, fp8), t) for m, k, n, t in samples]

    def evaluate(log_peak: float, log_bw: float) -> Tuple[float, float]:
        peak, bw = math.exp(log_peak), math.exp(log_bw)
        base = [sum(max(f / peak, b / bw) for f, b in terms) + cast / bw for (terms, cast), _ in data]
        weights = [1.0 / (t * t) for _, t in data]
        overhead = sum((t - a) * w for a, (_, t), w in zip(base, data, weights)) / sum(weights)
        overhead = max(overhead, 0.0)
        loss = sum(((a + overhead - t) / t) ** 2 for a, (_, t) in zip(base, data))
        return loss, overhead

    lo_p, hi_p = math.log(1e8), math.log(1e17)
    lo_b, hi_b = math.log(1e8), math.log(1e14)
    steps = 36
    dp, db = (hi_p - lo_p) / (steps - 1), (hi_b - lo_b) / (steps - 1)
    grid = sorted((evaluate(lo_p + i * dp, lo_b + j * db)[0], lo_p + i * dp, lo_b + j * db)
                  for i in range(steps) for j in range(steps))
    best = grid[0]
    for start in grid[:6]:  # refine the best few cells: the loss has ridges where max() switches
        loss, p, b = start
        sp, sb = dp, db
        while sp > 1e-7 or sb > 1e-7:
            moves = [(evaluate(p + i * sp, b + j * sb)[0], p + i * sp, b + j * sb)
                     for i in (-1, 0, 1) for j in (-1, 0, 1) if i or j]
            candidate = min(moves)
            if candidate[0] < loss:
                loss, p, b = candidate
            else:
                sp, sb = sp * 0.5, sb * 0.5
        best = min(best, (loss, p, b))
    loss, p, b = best
    loss, overhead = evaluate(p, b)
    return math.exp(p), math.exp(b), overhead, math.sqrt(loss / len(data))


def save_constants(constants: Mapping[str, Costs], path: str) -> None:
    """Write constants as JSON (name -> fields), for reuse without the bench rows."""
    with open(path, "w") as f:
        json.dump({k: v.to_dict() for k, v in constants.items()}, f, indent=2)
        f.write("\n")


def load_constants(path: str) -> Dict[str, Costs]:
    """Read constants written by save_constants."""
    with open(path) as f:
        return {k: Costs.from_dict(v) for k, v in json.load(f).items()}


def explain(model: nn.Module, backend: str, tokens: int, *, scaling: Optional[str] = None,
            constants: Optional[Mapping[str, Costs]] = None, min_speedup: float = 1.0) -> str:
    """One line per nn.Linear of `model`: shape, predicted speed-up, and fp8 or bf16."""
    fn = make_module_filter(backend, tokens, scaling=scaling, constants=constants, min_speedup=min_speedup)
    lines = []
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear):
            verdict = "fp8" if fn(module, fqn) else "bf16"
            lines.append(f"{fqn}: {tokens}x{module.in_features}x{module.out_features} "
                         f"predicted {fn.decisions[fqn]:.2f}x -> {verdict}")
    return "\n".join(lines)


__all__ = [
    "CAST_BYTES_PER_ELEMENT", "Costs", "DEFAULT_H100", "calibrate", "explain", "load_bench",
    "load_constants", "make_module_filter", "predict_ms", "predicted_speedup", "save_constants",
]
