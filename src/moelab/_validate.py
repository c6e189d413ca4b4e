"""Input validation with messages that name the argument, the value and what is allowed."""

from __future__ import annotations

import math
from collections.abc import Iterable


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed; expected a positive integer")
    return value


def int_in_range(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} is not allowed; expected an integer in [{low}, {high}]")
    return value


def _finite(name: str, value: object, bound: str) -> None:
    """Refuse inf (NaN fails every comparison already): no coefficient, rate or size is infinite."""
    if isinstance(value, float) and math.isinf(value):
        raise ValueError(f"{name}={value!r} is not allowed; expected a finite number {bound}")


def non_negative(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name}={value!r} is not allowed; expected a number >= 0")
    _finite(name, value, ">= 0")
    return float(value)


def positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} is not allowed; expected a number > 0")
    _finite(name, value, "> 0")
    return float(value)


def probability(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name}={value!r} is not allowed; expected a number in [0, 1]")
    return float(value)


def one_of(name: str, value: object, allowed: Iterable[object]) -> object:
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; expected one of {allowed}")
    return value
