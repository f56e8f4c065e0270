"""Review 37b: a unit's measures charge must cover how far it moves each block's grid answer
(docs/privacy/individual.md#lemma-measures-shift: integer blocks m = ⌈|Δ|/γ⌉).

``block_unit_shifts`` computes ⌈|Δ|/γ⌉ for an int ``sum`` block after converting the unit's integer sum Δ to
a double. Above 2^53 that conversion rounds: with int bounds [0, 2^53 − 1] and two rows per unit, Δ = 2^53 + 1
becomes 2^53, so m = 2^53/γ while round-half-up can move the block by 2^53/γ + 1 grid units (the other
units' total chosen just below a half grid unit). ``mechanisms.queries.individual._row_shifts`` takes an exact
integer path above 2^52 for the same reason (tests/unit/test_individual_big_shifts.py); the measures
copy does not. The test removes the unit, recomputes the block on the dataset-level path and compares the
move with the unit's charge in exact rationals, for both families."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from mechanisms.accounting import DEFAULT_ORDERS, UNITS_PER_EPSILON
from mechanisms.accounting.individual import UnitFilter, UnitLedger
from mechanisms.base import PublicContext
from mechanisms.data.schema import ORDER_COLUMN, DatasetSchema
from mechanisms.queries.individual import IndividualTable
from mechanisms.queries.measures import (
    MeasuresGaussian,
    MeasuresGaussianParams,
    MeasuresLaplace,
    MeasuresLaplaceParams,
    evaluate_blocks,
    gaussian_plans,
    laplace_plans,
)

LARGEST = 2**53 - 1
SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            {"name": "id", "type": "int", "min": 0, "max": 1000},
            {"name": "v", "type": "int", "min": 0, "max": LARGEST},
        ],
        "neighboring": "add_remove",
        "privacy_unit": {"column": "id", "max_rows": 2},
        "accounting": "individual",
    }
)
CONTEXT = PublicContext(SCHEMA, None, tuple(DEFAULT_ORDERS))
FRESH = UnitFilter(CONTEXT.orders, (10**15,) * (len(CONTEXT.orders) + 1), UnitLedger.empty())
MEASURES = {"measures": [{"kind": "sum", "column": "v"}]}


def _columns(ids: list[int], values: list[int]) -> dict[str, np.ndarray]:
    return {
        "id": np.array(ids, dtype=np.int64),
        "v": np.array(values, dtype=np.int64),
        ORDER_COLUMN: np.arange(len(ids), dtype=np.int64),
    }


def _laplace() -> tuple[Any, Any, Any, Fraction]:
    params = MeasuresLaplaceParams.model_validate({**MEASURES, "epsilon": 1.0})
    ((plan, scale),) = laplace_plans(params, CONTEXT)
    assert scale is not None
    return MeasuresLaplace(), params, plan, scale


def _gaussian() -> tuple[Any, Any, Any, Fraction]:
    params = MeasuresGaussianParams.model_validate({**MEASURES, "noise_multiplier": 1.0})
    ((plan, sigma, _),) = gaussian_plans(params, CONTEXT)
    assert sigma is not None
    return MeasuresGaussian(), params, plan, Fraction(sigma)


@pytest.mark.parametrize("family", ["laplace", "gaussian"])
def test_a_unit_is_charged_at_least_its_move_of_an_int_sum_block(family: str) -> None:
    mechanism, params, plan, scale = _laplace() if family == "laplace" else _gaussian()
    gamma = int(plan.grid.granularity)
    assert gamma >= 4  # the coarse grid the argument needs
    assert not plan.exact
    others = gamma // 2 - 1  # frac(others/γ) = ½ − 1/γ: adding 2^53 + 1 crosses a rounding boundary
    full = _columns([1, 1, 2], [LARGEST, 2, others])  # unit 1: Δ = 2^53 + 1
    without = _columns([2], [others])
    moved = abs(
        int(evaluate_blocks(params, CONTEXT, full, [plan])[0][0][0])
        - int(evaluate_blocks(params, CONTEXT, without, [plan])[0][0][0])
    )
    assert moved == (2**53 + 1 + gamma - 1) // gamma  # ⌈Δ/γ⌉: the block really moves this far
    step = mechanism.unit_step(params, CONTEXT, IndividualTable(full, FRESH))
    assert step.charges.units.tolist() == [1, 2]
    if family == "laplace":
        charged, needed = int(step.charges.pure[0]), Fraction(moved) / scale  # DLap: |ℓ| ≤ move/t
    else:
        charged, needed = int(step.charges.slope[0]), Fraction(moved**2) / (2 * scale**2)  # α·move²/(2σ²)
    assert charged >= needed * UNITS_PER_EPSILON
