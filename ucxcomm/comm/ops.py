"""Reduction operations (``SUM``, ``MAX``...) usable by object and buffer reductions."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

__all__ = ["BAND", "BOR", "BXOR", "LAND", "LOR", "LXOR", "MAX", "MAXLOC", "MIN", "MINLOC",
           "NO_OP", "PROD", "REPLACE", "SUM", "Op"]


class Op:
    """A named, associative reduction.

    Parameters
    ----------
    name : str
        Shown in errors and reprs.
    pyfunc : callable
        ``f(a, b)`` on Python objects (object collectives, scalars).
    ufunc : numpy ufunc name, optional
        Element-wise kernel for buffers (``"add"``, ``"maximum"``...); without one the
        op works in object collectives only.
    commutative : bool
        Whether ``f(a, b) == f(b, a)``. Object reductions always combine in rank order,
        so non-commutative user ops are fine there.

    Any callable ``f(a, b)`` is also accepted where object collectives take an ``op``.
    """

    __slots__ = ("commutative", "name", "pyfunc", "ufunc")

    def __init__(self, name: str, pyfunc: Callable[[Any, Any], Any],
                 ufunc: str | None = None, commutative: bool = True) -> None:
        self.name, self.pyfunc, self.ufunc, self.commutative = name, pyfunc, ufunc, commutative

    def __call__(self, a: Any, b: Any) -> Any:
        return self.pyfunc(a, b)

    def __repr__(self) -> str:
        return f"ucxcomm.{self.name}"


SUM = Op("SUM", operator.add, "add")
PROD = Op("PROD", operator.mul, "multiply")
MIN = Op("MIN", min, "minimum")
MAX = Op("MAX", max, "maximum")
LAND = Op("LAND", lambda a, b: a and b, "logical_and")
LOR = Op("LOR", lambda a, b: a or b, "logical_or")
LXOR = Op("LXOR", lambda a, b: bool(a) != bool(b), "logical_xor")
BAND = Op("BAND", operator.and_, "bitwise_and")
BOR = Op("BOR", operator.or_, "bitwise_or")
BXOR = Op("BXOR", operator.xor, "bitwise_xor")


def _maxloc(a: Any, b: Any) -> Any:
    if a[0] != b[0]:
        return a if a[0] > b[0] else b
    return a if a[1] <= b[1] else b


def _minloc(a: Any, b: Any) -> Any:
    if a[0] != b[0]:
        return a if a[0] < b[0] else b
    return a if a[1] <= b[1] else b


MAXLOC = Op("MAXLOC", _maxloc)
"""On ``(value, index)`` pairs: the largest value, lowest index among ties (objects)."""
MINLOC = Op("MINLOC", _minloc)
"""On ``(value, index)`` pairs: the smallest value, lowest index among ties (objects)."""
REPLACE = Op("REPLACE", lambda a, b: b, None, commutative=False)
NO_OP = Op("NO_OP", lambda a, b: a, None, commutative=False)
