"""Review 37: a unit's charge must cover how far it moves the released integer answer
(docs/privacy/individual.md#individual-queries).

On a coarse grid (γ = 2^16 here: int bounds ±(2^53 − 1), two rows per unit, ε = 1) a unit whose integer sum
exceeds 2^53 has its |Δ| rounded as a double before ⌈|Δ|/γ⌉: Δ = 2^53 + 1 becomes 2^53, so m = 2^37 while
round-half-up can move the answer by 2^37 + 1 grid units. The test removes the unit and compares the
answers' change with what the unit was charged, in exact rationals."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from mechanisms.accounting import DEFAULT_ORDERS, UNITS_PER_EPSILON
from mechanisms.accounting.individual import UnitFilter, UnitLedger
from mechanisms.base import PublicContext
from mechanisms.data.plan import ORDER_COLUMN
from mechanisms.data.schema import DatasetSchema
from mechanisms.queries.individual import IndividualTable
from mechanisms.queries.language import laplace_plan
from mechanisms.queries.laplace import Laplace, LaplaceParams

LARGEST = 2**53 - 1
SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            {"name": "id", "type": "int", "min": 0, "max": 1000},
            {"name": "v", "type": "int", "min": -LARGEST, "max": LARGEST},
        ],
        "neighboring": "add_remove",
        "privacy_unit": {"column": "id", "max_rows": 2},
        "accounting": "individual",
    }
)
ORDERS = tuple(DEFAULT_ORDERS)
CONTEXT = PublicContext(SCHEMA, None, ORDERS)
PARAMS = LaplaceParams.model_validate({"query": {"kind": "sum", "column": "v"}, "epsilon": 1.0})
FRESH = UnitFilter(ORDERS, (None,) * len(ORDERS) + (10**12,), UnitLedger.empty())


def _table(ids: list[int], values: list[int]) -> IndividualTable:
    columns = {
        "id": np.array(ids, dtype=np.int64),
        "v": np.array(values, dtype=np.int64),
        ORDER_COLUMN: np.arange(len(ids), dtype=np.int64),
    }
    return IndividualTable(columns, FRESH)


def test_a_unit_is_charged_at_least_its_move_of_a_coarse_grid_answer() -> None:
    plan, scale = laplace_plan(PARAMS.query, CONTEXT, PARAMS.epsilon)
    assert plan.grid.exponent == 16  # the coarse grid the argument needs
    assert not plan.exact
    others = -(2**15) - 1  # frac(others/γ + ½) = 1 − 2^-16: the largest move of round-half-up
    halves = [others // 2, others - others // 2]
    with_unit = Laplace().unit_step(PARAMS, CONTEXT, _table([1, 1, 2, 2], [LARGEST, 2, *halves]))
    without_unit = Laplace().unit_step(PARAMS, CONTEXT, _table([2, 2], halves))
    moved = abs(int(with_unit.answer_units[0]) - int(without_unit.answer_units[0]))
    assert moved == 2**37 + 1
    assert with_unit.charges.units.tolist() == [1, 2]
    charged = int(with_unit.charges.pure[0])  # unit 1, ledger units of 1e-12 ε
    assert charged >= Fraction(moved) / scale * UNITS_PER_EPSILON
