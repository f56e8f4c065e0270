"""Rényi orders on which every curve of a dataset is evaluated.

A dataset's grid is chosen when it is created and never changes afterwards: the filter's union bound
spends δ/|A| per order (docs/privacy/filter.md#filter), so the grid size is part of the guarantee.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

DEFAULT_ORDERS: tuple[float, ...] = (
    1.25,
    1.5,
    1.75,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    6.0,
    8.0,
    10.0,
    12.0,
    16.0,
    20.0,
    24.0,
    32.0,
    48.0,
    64.0,
    128.0,
    256.0,
)


def validate_orders(orders: Sequence[float]) -> tuple[float, ...]:
    """Return ``orders`` as a tuple after checking they are finite, > 1 and strictly increasing."""
    grid = tuple(float(a) for a in orders)
    if not grid:
        raise ValueError("the order grid must not be empty")
    if any(not math.isfinite(a) or a <= 1.0 for a in grid):
        raise ValueError("every Rényi order must be finite and > 1")
    if any(b <= a for a, b in itertools.pairwise(grid)):
        raise ValueError("Rényi orders must be strictly increasing")
    return grid
