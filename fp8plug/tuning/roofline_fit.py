"""Fitting fp8plug.tuning.roofline's cost model to measurements, offline: from the rows `fp8plug bench
--shapes sweep --json` wrote to a Costs per engine (and bf16), and to and from a constants file.

Kept apart from the filter, which only reads fitted constants (`SM90` ships the fit from an H200);
fitting is done once per GPU type, and the result passed as a module filter (docs/recipe.md):

    constants = calibrate(load_bench("bench_sweep.json"))
    save_constants(constants, "my_gpu.json")
    module_filter_fn = fp8plug.tuning.roofline.make_module_filter("native", tokens=8192, constants=constants)
"""

from __future__ import annotations

import json
import math
from typing import Dict, List, Mapping, Optional, Tuple

from fp8plug.tuning.roofline import BF16_KEY, Costs, linear_terms


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
    data = [(linear_terms(m, k, n, fp8), t) for m, k, n, t in samples]

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


__all__ = ["calibrate", "load_bench", "load_constants", "save_constants"]
