"""The checks a recipe value goes through wherever it came from (an argument, the environment, a
config file): a boolean as `accelerate launch` writes one, an integer within bounds, one of a few
names. Each takes the value and a label naming the field, and returns the value in its canonical
form or raises ValueError starting with that label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Tuple

_TRUE = ("true", "1", "yes", "y", "on")
_FALSE = ("false", "0", "no", "n", "off", "")


def parse_bool(value, label: str) -> bool:
    """A boolean written as true/false/1/0/yes/no/on/off (any case), as launch and config files write it."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{label}: {value!r} is not a boolean; use true/false or 1/0.")


@dataclass(frozen=True)
class Integer:
    """An integer from `low` to `high` (a string of digits too); `why` says what is wrong beyond them."""

    low: int
    high: int
    why: str

    def __call__(self, value, label: str) -> int:
        allowed = f"use an integer from {self.low} to {self.high}"
        try:
            number = value if isinstance(value, int) and not isinstance(value, bool) else int(str(value).strip())
        except ValueError:
            raise ValueError(f"{label}: {value!r} is not an integer; {allowed}.") from None
        if isinstance(value, bool) or not self.low <= number <= self.high:
            raise ValueError(f"{label}: {value!r} is out of range; {allowed} ({self.why}).")
        return number


@dataclass(frozen=True)
class OneOf:
    """One of `allowed`, compared after `canon` (str.upper, str.lower) so that any case is read."""

    allowed: Tuple[str, ...]
    canon: Callable[[str], str]

    def __call__(self, value, label: str) -> str:
        text = self.canon(str(value).strip())
        if text not in self.allowed:
            raise ValueError(f"{label}: {value!r} is not allowed; use one of {', '.join(self.allowed)}.")
        return text
