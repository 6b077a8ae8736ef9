"""The automatic layer filter: keep in bf16 the Linears where FP8 would be slower.

FP8 halves GEMM time but adds casts whose cost grows with M*K + K*N + M*N, not M*K*N, plus a fixed
cost per layer, so a layer with a small K or N can be slower in FP8. A roofline-style cost model
(`predict_ms`; each engine's constants in its row, fp8plug.recipe.engines), fitted to
`fp8plug bench --shapes sweep` times (fp8plug.tuning.roofline_fit; `SM90`, fitted on an H200,
serves H100 and H200), predicts each Linear's speed-up, and the filter keeps a
layer in bf16 where FP8 is predicted at least 15% slower (AUTO_MIN_SPEEDUP). On by default on those
GPUs (`FP8RecipeKwargs.auto_filter`); `explain` and `make_module_filter` use it by hand (docs/recipe.md).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Tuple

from torch import nn

from fp8plug.recipe.engines import ENGINES, H200_CALIBRATION, Costs
from fp8plug.recipe.engines import SM90 as _SM90
from fp8plug.recipe.kwargs import normalize_backend

BF16_KEY = "bf16"
# Bytes moved per element of each cast tensor (input, weight, grad_output) in FP8: read bf16 for the
# amax (2), read bf16 again to cast (2), write the FP8 copy and its transposed copy (1 + 1).
CAST_BYTES_PER_ELEMENT = 6
# bf16's costs by compute capability, measured beside the engines' (their rows hold theirs)
BF16_COSTS: Dict[Tuple[int, int], Costs] = {
    _SM90: Costs(peak_tflops=778.0, bandwidth_gbs=3564.0, overhead_us=12.3, note=H200_CALIBRATION.format(err="2.9%")),
}


def _calibrated(capability: Tuple[int, int]) -> Dict[str, Costs]:
    """bf16's and every engine's costs on `capability`, each engine under its name and under
    "name:scaling" for the scaling they were measured with (its default), those they also predict,
    and the scalings measured with constants of their own (`scaling_costs`)."""
    table = {BF16_KEY: BF16_COSTS[capability]}
    for row in ENGINES.values():
        if capability in row.costs:
            table[row.name] = row.costs[capability]
            for scaling in (row.costs_scaling, *row.costs_also):
                table[f"{row.name}:{scaling}"] = row.costs[capability]
        for scaling, by_capability in row.scaling_costs.items():
            if capability in by_capability:
                table[f"{row.name}:{scaling}"] = by_capability[capability]
    return table


CALIBRATED: Dict[Tuple[int, int], Dict[str, Costs]] = {capability: _calibrated(capability) for capability in BF16_COSTS}
SM90 = CALIBRATED[_SM90]  # fitted on an H200, used on H100 and H200 alike (fp8plug.recipe.engines)
DEFAULT_TOKENS = 8192  # tokens per GPU per step the automatic filter assumes (e.g. 4 x 2048)
# The automatic filter keeps a Linear in bf16 only if FP8 is predicted at least 15% slower. The
# constants come from Linears timed alone; inside a compiled block the casts fuse with their
# neighbours (the norm before, the activation after), which a lone Linear cannot show. Measured on
# the H200, 1b model of benchmarks/training/train_step.py: keeping its 2048x2048 projections in bf16
# (predicted 0.99x, 0.91x timed alone) made the step 2.1% slower than converting them.
AUTO_MIN_SPEEDUP = 0.85


# --- the cost model ---------------------------------------------------------------------------------


def linear_terms(m: int, k: int, n: int, fp8: bool) -> Tuple[List[Tuple[float, float]], float]:
    """([(flops, bytes) per GEMM], cast bytes) for one Linear forward+backward.

    The GEMMs: forward (M,K)x(K,N), input gradient (M,N)x(N,K), weight gradient (N,M)x(M,K); each
    reads its two operands (2 bytes an element in bf16, 1 in FP8) and writes a bf16 result."""
    gemms = ((m, k, n), (m, n, k), (n, m, k))
    operand = 1 if fp8 else 2
    terms = [(2.0 * a * b * c, operand * (a * b + b * c) + 2.0 * a * c) for a, b, c in gemms]
    cast = CAST_BYTES_PER_ELEMENT * float(m * k + k * n + m * n) if fp8 else 0.0
    return terms, cast


def predict_ms(m: int, k: int, n: int, costs: Costs, fp8: bool) -> float:
    """Predicted milliseconds for one Linear forward+backward at M tokens, K in, N out features:

        t(M, K, N) = sum over the 3 GEMMs of max(flops / peak, bytes / bandwidth)
                     + cast bytes / bandwidth   (FP8 only)
                     + overhead

    The model is deliberately small: it only has to rank bf16 against FP8 for one layer at a time."""
    terms, cast = linear_terms(m, k, n, fp8)
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
    constants = dict(SM90, **(constants or {}))
    backend = normalize_backend(backend)
    return speedup(m, k, n, constants[BF16_KEY], _lookup(constants, backend, scaling))


def speedup(m: int, k: int, n: int, bf16: Costs, fp8: Costs) -> float:
    """bf16 time / FP8 time for one Linear forward+backward, given both sides' costs."""
    return predict_ms(m, k, n, bf16, fp8=False) / predict_ms(m, k, n, fp8, fp8=True)


class SpeedFilter:
    """A `module_filter_fn(module, fqn)` that converts an nn.Linear only where the cost model
    predicts FP8 at least `min_speedup` times as fast as bf16 at `tokens` tokens, after an optional
    `user_fn` (the user's own module_filter_fn) has accepted it. Other modules are left to the
    engine. `decisions` holds fqn -> predicted speed-up; `skip_reason(fqn)` says why a module was
    refused (the conversion report shows it)."""

    def __init__(self, backend: str, tokens: int, bf16: Costs, fp8: Costs, min_speedup: float = 1.0,
                 user_fn: Optional[Callable[[nn.Module, str], bool]] = None, source: str = ""):
        self.backend, self.tokens, self.bf16, self.fp8 = backend, tokens, bf16, fp8
        self.min_speedup, self.user_fn, self.source = min_speedup, user_fn, source
        self.decisions: Dict[str, float] = {}
        self._refused_by_user: set = set()

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        if self.user_fn is not None and not self.user_fn(module, fqn):
            self._refused_by_user.add(fqn)
            return False
        if not isinstance(module, nn.Linear):
            return True
        k, n = module.in_features, module.out_features
        predicted = speedup(self.tokens, k, n, self.bf16, self.fp8)
        self.decisions[fqn] = predicted
        return predicted >= self.min_speedup

    def skip_reason(self, fqn: str) -> str:
        if fqn in self._refused_by_user:
            return "module_filter_fn returned False"
        return (f"{self.source or 'roofline filter'}: {self.backend} FP8 predicted {self.decisions.get(fqn, 0):.2f}x "
                f"bf16's speed at {self.tokens} tokens (needs {self.min_speedup:g}x)")

    def skip_kind(self, fqn: str) -> Optional[str]:
        """The group a refused module goes under in the one-line conversion summary."""
        if fqn in self._refused_by_user:
            return None
        return (f"kept in bf16 by {self.source or 'roofline filter'} (FP8 predicted under {self.min_speedup:g}x "
                f"bf16's speed at {self.tokens} tokens)")

    def skip_note(self, fqn: str) -> str:
        """The predicted speed-up of a module this filter refused ('' for one the user's filter refused)."""
        return "" if fqn in self._refused_by_user else f"{self.decisions.get(fqn, 0):.2f}x"

    def __repr__(self) -> str:
        return f"SpeedFilter({self.backend!r}, tokens={self.tokens}, min_speedup={self.min_speedup})"


def _check_tokens(tokens, where: str) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(
            f"{where}: tokens must be a positive integer (batch size x sequence length per GPU), got {tokens!r}."
        )
    return tokens


def make_module_filter(
    backend: str,
    tokens: int,
    *,
    scaling: Optional[str] = None,
    constants: Optional[Mapping[str, Costs]] = None,
    min_speedup: float = 1.0,
) -> SpeedFilter:
    """A `module_filter_fn(module, fqn)` for FP8RecipeKwargs that converts an nn.Linear only if the
    cost model predicts FP8 at least `min_speedup` times faster than bf16 for `backend`.

    tokens: the token count M each Linear sees per step on one GPU (batch size x sequence length).
    constants: name -> Costs, e.g. from fp8plug.tuning.roofline_fit.calibrate() on your GPU; missing
    names fall back to SM90
    (measured on an H200). Modules other than nn.Linear are always accepted (the engine decides).
    The returned filter records its verdicts in `.decisions` (fqn -> predicted speed-up).
    """
    backend = normalize_backend(backend)
    if backend is None:
        raise ValueError(f"make_module_filter: name the engine ({', '.join(ENGINES)}); the model is per engine.")
    _check_tokens(tokens, "make_module_filter")
    if not min_speedup > 0:
        raise ValueError(f"make_module_filter: min_speedup must be > 0, got {min_speedup!r}.")
    table = dict(SM90, **(constants or {}))
    return SpeedFilter(backend, tokens, table[BF16_KEY], _lookup(table, backend, scaling), min_speedup)


def auto_filter(recipe, backend: str, device) -> Optional[SpeedFilter]:
    """The filter FP8RecipeKwargs.auto_filter asks for on `device` (a hardware.DeviceInfo), combined
    with the recipe's own module_filter_fn; None where it does not apply.

    auto_filter None (the default): on for an engine with calibrated constants on a GPU whose
    compute capability has them (9.0), off elsewhere: without a measurement there is nothing to
    decide with, and on the CPU FP8 is emulation anyway. True: on, or a ValueError saying why it
    cannot be. False: off.
    """
    wanted = getattr(recipe, "auto_filter", None)
    if wanted is False:
        return None
    table = CALIBRATED.get(getattr(device, "capability", None)) if getattr(device, "type", None) == "cuda" else None
    scaling = getattr(recipe, "scaling", None)
    # only what was measured: another scaling of the same engine can be much slower (te block)
    fp8 = (table or {}).get(f"{backend}:{scaling}" if scaling else backend)
    if fp8 is None:
        if wanted:
            where = device.describe() if hasattr(device, "describe") else str(device)
            raise ValueError(
                f"FP8RecipeKwargs.auto_filter: no calibrated cost model for engine {backend!r}"
                f"{f' scaling {scaling!r}' if scaling else ''} on {where} (fp8plug has one for compute "
                f"capability 9.0: {', '.join(n for n, row in ENGINES.items() if _SM90 in row.costs)} at their "
                "default scalings). Set auto_filter=False and pass "
                "module_filter_fn=fp8plug.tuning.roofline.make_module_filter(...) with constants from "
                "fp8plug.tuning.roofline_fit.calibrate()."
            )
        return None
    tokens = _check_tokens(getattr(recipe, "auto_filter_tokens", None) or DEFAULT_TOKENS,
                           "FP8RecipeKwargs.auto_filter_tokens")
    return SpeedFilter(backend, tokens, table[BF16_KEY], fp8, AUTO_MIN_SPEEDUP,
                       user_fn=getattr(recipe, "module_filter_fn", None), source="auto_filter")


def with_auto_filter(recipe, backend: str, device):
    """`recipe`, or a shallow copy whose module_filter_fn is the automatic filter (which still asks
    the recipe's own module_filter_fn first): what the engines convert with."""
    import copy

    speed_filter = auto_filter(recipe, backend, device)
    if speed_filter is None:
        return recipe
    recipe = copy.copy(recipe)
    recipe.module_filter_fn = speed_filter
    return recipe


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
    "AUTO_MIN_SPEEDUP", "CALIBRATED", "CAST_BYTES_PER_ELEMENT", "Costs", "DEFAULT_TOKENS", "SM90", "SpeedFilter",
    "auto_filter",
    "explain", "linear_terms", "make_module_filter", "predict_ms", "predicted_speedup", "speedup", "with_auto_filter",
]
