"""Checks of the DST objects' numeric arguments, shared by the algorithms and their schedule.

NumPy numbers pass (a configuration read with NumPy), as the Python numbers they equal; ``bool``
does not (``True`` is an ``int`` to Python, but never a meant step count or fraction).
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_fraction", "check_int", "check_nonnegative"]


def check_int(value, name: str, minimum: int) -> int:
    """``value`` as an ``int``, checked to be a whole number ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_fraction(value, name: str) -> float:
    """``value`` as a ``float``, checked to be a real number in ``[0, 1]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__} {value!r}")
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


def check_nonnegative(value, name: str) -> float:
    """``value`` as a ``float``, checked to be a finite real number ``>= 0``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float >= 0, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)
