"""The recipe fields of the numerics watch and its guard: defaults and checks, in one place.

The watch (fp8plug.numerics.watch) measures every FP8 layer every `numerics_watch_interval`
optimizer steps; the guard (fp8plug.numerics.guard) moves a layer whose forward GEMM's SQNR stays
below `guard_min_sqnr_db`, or whose operands' saturated fraction stays above
`guard_max_saturation`, for `guard_patience` checks in a row. Every engine honours them (they are
shared plan fields, fp8plug.recipe.plans.SHARED): the watch reads no engine's internals.
"""

from __future__ import annotations

import math

from fp8plug.recipe.checks import Integer, parse_bool

NUMERICS_DEFAULTS = {
    "numerics_watch_interval": 0,  # off
    "numerics_guard": False,
    # An FP8 (E4M3 x E4M3) GEMM of well-scaled operands measures about 28 dB against float32 and
    # the worst ordinary layers of a Llama about 24 dB; 20 dB is an error of 10% of the output's size.
    "guard_min_sqnr_db": 20.0,
    # One value in a hundred clipped to the format's largest, check after check: delayed scaling clips a
    # little (weights an optimizer step moved past the last amax: up to a percent early in a run).
    "guard_max_saturation": 1e-2,
    "guard_patience": 3,
}
NUMERICS_FIELDS = tuple(NUMERICS_DEFAULTS)


class FloatBetween:
    """A finite number from `low` to `high` (a string of one too)."""

    def __init__(self, low: float, high: float, why: str):
        self.low, self.high, self.why = low, high, why

    def __call__(self, value, label: str) -> float:
        allowed = f"use a number from {self.low} to {self.high} ({self.why})"
        try:
            number = float(str(value).strip()) if not isinstance(value, bool) else math.nan
        except ValueError:
            raise ValueError(f"{label}: {value!r} is not a number; {allowed}.") from None
        if not (self.low <= number <= self.high):
            raise ValueError(f"{label}: {value!r} is out of range; {allowed}.")
        return number


NUMERICS_CHECKS = {
    "numerics_watch_interval": Integer(0, 10**9, "0 turns the watch off; 1 checks every step"),
    "numerics_guard": parse_bool,
    "guard_min_sqnr_db": FloatBetween(-100.0, 100.0, "an SQNR in dB; an FP8 GEMM measures about 28"),
    "guard_max_saturation": FloatBetween(0.0, 1.0, "a fraction of an operand's values"),
    "guard_patience": Integer(1, 10_000, "how many checks in a row must be bad before the guard acts"),
}
