"""User-level DP-GD (``dp_gd`` on a privacy-unit dataset; docs/privacy/units_learners.md#theorem-dpgd-unit).

Each step clips every unit's summed gradient (over its at most k kept rows, chosen by the engines' keyed-hash
order) to C, so neighbouring datasets that differ by one unit with all its rows — however many — differ by
one clipped vector: the noiseless clipped sum moves by < C (add/remove) or < 2C (replace), which is the
sensitivity the unchanged charge T·α/(2z²) is calibrated to. Checked here in exact integers (term units), on
pairs with heavy units of up to 10k rows aligned so that the bound is reached, in random row orders; a
variant without the unit clip (rows clipped, units not) exceeds it; the kept rows are the engine's.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import ParamsError, PublicContext
from mechanisms.data.plan import ORDER_COLUMN, Aggregation, Key, UnitBound, evaluate_numpy
from mechanisms.data.schema import DatasetSchema
from mechanisms.learners import dp_gd
from mechanisms.learners.dp_gd import (
    DpGdConfig,
    DpGdMechanism,
    DpGdParams,
    Loss,
    bound_units,
    clip_unit_sums,
    clipped_sum_units,
    dp_gd_curve,
    grid_records,
    unit_clipped_sum_units,
)
from mechanisms.noise import Noise
from mechanisms.noise.learners import discrete_gaussian_std
from service.data.ingest import unit_order
from tests.engine_support import engine_table

K = 4
Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""x, y, unit ids, ``__order``."""


def _sum_units(theta: np.ndarray, table: Rows, clip: float, loss: Loss) -> tuple[list[int], Fraction]:
    """The noiseless user-level clipped sum in term units (exact Python integers) and F = C/ω (exact)."""
    x, y, units, order = table
    records = grid_records(x, y, clip)
    bounded = bound_units(records, units, order, K, clip)
    total = unit_clipped_sum_units(theta, bounded, loss)
    return [int(v) for v in total], Fraction(bounded.budget)


def _squared_distance(a: list[int], b: list[int]) -> int:
    return sum((u - v) ** 2 for u, v in zip(a, b, strict=True))


def _base(rng: np.random.Generator, d: int) -> Rows:
    n = int(rng.integers(5, 60))
    x = rng.normal(size=(n, d))
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1))[:, None]
    return x, rng.choice([-1.0, 1.0], n), rng.integers(0, 12, n), rng.integers(-(2**62), 2**62, n)


def _heavy(rng: np.random.Generator, d: int, rows: int, label: float) -> Rows:
    """One unit (id 999) of ``rows`` rows along one direction with one label: its gradients add up."""
    direction = rng.normal(size=d)
    direction /= np.linalg.norm(direction)
    x = direction[None, :] * rng.uniform(0.5, 1.0, (rows, 1))
    return x, np.full(rows, label), np.full(rows, 999), rng.integers(-(2**62), 2**62, rows)


def _join(first: Rows, second: Rows) -> Rows:
    x, y, units, order = (np.concatenate(pair) for pair in zip(first, second, strict=True))
    return x, y, units, order


def _shuffled(rng: np.random.Generator, table: Rows) -> Rows:
    perm = rng.permutation(table[0].shape[0])
    x, y, units, order = (column[perm] for column in table)
    return x, y, units, order


@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_one_unit_moves_the_clipped_sum_by_less_than_c_and_reaches_it(loss: Loss) -> None:
    """Add/remove one unit of up to 10k rows: ‖S(D) − S(D′)‖ < C/ω exactly (integers), in any row order;
    the largest change over the pairs is > 0.999·C/ω (the bound is reached)."""
    rng = np.random.default_rng(7)
    largest = 0.0
    for trial in range(120):
        d = int(rng.integers(1, 6))
        clip = float(rng.choice([0.05, 0.5, 1.0, 4.0]))
        rows = int(rng.choice([1, K, 10 * K, 10_000 if trial % 20 == 0 else 30]))
        base = _base(rng, d)
        heavy = _heavy(rng, d, rows, float(rng.choice([-1.0, 1.0])))
        theta = rng.normal(size=d) * float(rng.choice([0.0, 1.0, 30.0]))
        a, budget = _sum_units(theta, _shuffled(rng, base), clip, loss)
        b, _ = _sum_units(theta, _shuffled(rng, _join(base, heavy)), clip, loss)
        moved = _squared_distance(a, b)
        assert moved < budget * budget, (trial, moved, budget)
        largest = max(largest, float(moved / budget**2) ** 0.5)
    assert largest > 0.999


@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_replacing_one_unit_moves_the_clipped_sum_by_less_than_2c_and_reaches_it(loss: Loss) -> None:
    """Replace one unit's rows by any other set (here: opposite gradients): < 2C/ω exactly; reaches 1.99."""
    rng = np.random.default_rng(11)
    largest = 0.0
    for trial in range(60):
        d = int(rng.integers(1, 5))
        clip = float(rng.choice([0.05, 0.5, 1.0]))
        base = _base(rng, d)
        heavy = _heavy(rng, d, int(rng.choice([K, 10 * K, 200])), 1.0)
        fresh = np.asarray(rng.integers(-(2**62), 2**62, heavy[0].shape[0]))
        other: Rows = (heavy[0], -heavy[1], heavy[2], fresh)
        theta = np.zeros(d) if loss == "logistic" else rng.normal(size=d) * 0.01
        a, budget = _sum_units(theta, _shuffled(rng, _join(base, heavy)), clip, loss)
        b, _ = _sum_units(theta, _shuffled(rng, _join(base, other)), clip, loss)
        moved = _squared_distance(a, b)
        assert moved < 4 * budget * budget, (trial, moved, budget)
        largest = max(largest, float(moved / budget**2) ** 0.5)
    assert largest > 1.99


def test_without_the_unit_clip_one_unit_moves_the_sum_by_k_times_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation the fuzz above must catch: rows clipped but units not (the unit clip replaced by the
    identity) lets one unit of k aligned rows move the sum by ≈ k·C/2 (logistic at θ = 0: each row's
    gradient has norm ½·‖x‖), far above the charged C."""
    rng = np.random.default_rng(3)
    base = _base(rng, 2)
    heavy = _heavy(rng, 2, 10 * K, 1.0)
    heavy = (heavy[0] / np.linalg.norm(heavy[0], axis=1)[:, None], heavy[1], heavy[2], heavy[3])  # ‖x‖ = 1
    monkeypatch.setattr(dp_gd, "clip_unit_sums", lambda sums, budget: sums)
    a, budget = _sum_units(np.zeros(2), base, 1.0, "logistic")
    b, _ = _sum_units(np.zeros(2), _join(base, heavy), 1.0, "logistic")
    assert _squared_distance(a, b) > (1.9 * budget) ** 2  # k·½·C = 2C


def test_clip_unit_sums_is_exact_below_the_budget_and_keeps_small_sums() -> None:
    """Every clipped column has exact integer norm² < F², small columns are unchanged, large ones keep their
    direction, for sums up to k·F per coordinate in every dimension up to 200."""
    rng = np.random.default_rng(5)
    for d in (1, 2, 7, 50, 200):
        budget = float(2**37)
        units = 300
        scale = rng.choice([1e-3, 0.5, 0.9999, 1.0, 3.0, 4e5], units) * budget / np.sqrt(d)
        sums = np.rint(rng.normal(size=(d, units)) * scale).astype(np.int64)
        sums[:, 0] = 0
        clipped = clip_unit_sums(sums, budget)
        for u in range(units):
            exact = sum(int(v) ** 2 for v in clipped[:, u])
            assert exact < int(budget) ** 2, (d, u)
            original = sum(int(v) ** 2 for v in sums[:, u])
            if original < (0.99 * budget) ** 2:
                assert np.array_equal(clipped[:, u], sums[:, u])
            elif original >= int(budget) ** 2:
                assert exact > (0.999 * budget) ** 2
                inner = sum(int(a) * int(b) for a, b in zip(clipped[:, u], sums[:, u], strict=True))
                cosine = inner / (float(exact) ** 0.5 * float(original) ** 0.5)
                assert cosine > 1 - 1e-9


def test_the_kept_rows_are_the_engines() -> None:
    """With C so large that nothing is clipped, the user-level sum is the row-level sum over exactly the rows
    the aggregation plan's bounding keeps (``UnitBound``, the same keyed-hash order)."""
    rng = np.random.default_rng(9)
    n, d = 400, 3
    users = rng.integers(0, 25, n)
    x = rng.uniform(-1, 1, (n, d)) / 2
    y = rng.choice([-1.0, 1.0], n)
    ids = np.arange(n)
    order = unit_order([pa.array(users), pa.array(ids)], 0xABC).to_numpy()
    table = {"user": users, "row": ids, ORDER_COLUMN: order}
    plan = Aggregation(keys=(Key("row", n),), unit=UnitBound("user", K))
    kept = np.asarray(evaluate_numpy(plan, table)[0]) == 1
    assert 0 < kept.sum() < n
    clip = 1e3
    theta = rng.normal(size=d)
    rows = clipped_sum_units(theta, grid_records(x[kept], y[kept], clip), "logistic")
    units = unit_clipped_sum_units(
        theta, bound_units(grid_records(x, y, clip), users, order, K, clip), "logistic"
    )
    assert np.array_equal(rows, units)


# ----- the service mechanism on a unit dataset ----------------------------------------------------------
COLUMNS: list[dict[str, Any]] = [
    {"name": "user", "type": "int", "min": 0, "max": 10**6},
    {"name": "a", "type": "float", "min": -1.0, "max": 1.0},
    {"name": "b", "type": "float", "min": -1.0, "max": 1.0},
    {"name": "y", "type": "categorical", "values": ["no", "yes"]},
]


def _ctx(neighboring: str = "add_remove") -> PublicContext:
    schema = DatasetSchema.model_validate(
        {"columns": COLUMNS, "neighboring": neighboring, "privacy_unit": {"column": "user", "max_rows": K}}
    )
    return PublicContext(schema, None, DEFAULT_ORDERS)


def _table(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    columns = {
        "user": rng.integers(0, n // 5, n),
        "a": rng.uniform(-1, 1, n),
        "b": rng.uniform(-1, 1, n),
        "y": rng.integers(0, 2, n),
    }
    columns[ORDER_COLUMN] = unit_order([pa.array(columns[c["name"]]) for c in COLUMNS], 0x51).to_numpy()
    return columns


def _params(**changes: Any) -> DpGdParams:
    raw: dict[str, Any] = {"features": ["a", "b"], "label": "y", "steps": 3, "noise_multiplier": 1.0,
                           "n_hint": 500, "clip": 0.5}  # fmt: skip
    raw.update(changes)
    return DpGdParams.model_validate(raw)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"features": ["a", "user"]}, "features[1]"),
        ({"clipping": "adaptive"}, "clipping"),
        ({"n_hint": None}, "n_hint"),
    ],
)
@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
def test_refusals_name_the_field(changes: dict[str, Any], field: str, neighboring: str) -> None:
    with pytest.raises(ParamsError) as refused:
        DpGdMechanism().check(_params(**changes), _ctx(neighboring))
    assert refused.value.field == field


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
def test_the_charge_is_the_per_unit_gaussian_curve(neighboring: str) -> None:
    """Δ = C (add/remove) or 2C (replace) per unit with noise z·Δ: T·α/(2z²), the row-level curve."""
    params, ctx = _params(), _ctx(neighboring)
    curve = DpGdMechanism().worst_case(params, ctx)
    config = DpGdConfig("logistic", 0.01, 3, 1.0, 0.5, 1.0, neighboring)  # type: ignore[arg-type]
    expected = dp_gd_curve(config, neighboring, ctx.orders)  # type: ignore[arg-type]
    assert curve.values == expected.values
    for alpha, value in zip(ctx.orders, curve.values, strict=True):
        assert value == pytest.approx(3 * alpha / 2, rel=1e-9)


def test_the_run_is_the_user_level_sum_plus_the_noise_and_the_engine_path_agrees(tmp_path: Path) -> None:
    """One step: the released θ₁ = −τ(ω(S + Z)/n_hint) with S the user-level clipped sum and Z the seeded
    draws; a DuckDB-scanned Parquet snapshot (streamed with its ``__order``) releases the same output."""
    ctx = _ctx()
    table = _table(1000, 2)
    params = _params(steps=1, regularization=0.0, max_norm=1e6, step_size=1.0)
    release = DpGdMechanism().run(params, ctx, table, Noise.seeded(4))
    output = release.output
    assert output["privacy_unit"]["max_rows"] == K
    x = np.column_stack([table["a"], table["b"], np.ones(1000)])
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1))[:, None]
    y = np.where(table["y"] == 1, 1.0, -1.0)
    records = grid_records(x, y, 0.5, noise_multiplier=1.0)
    bounded = bound_units(records, table["user"], table[ORDER_COLUMN], K, 0.5)
    total = unit_clipped_sum_units(np.zeros(3), bounded, "logistic")
    config = DpGdMechanism()._config(params, ctx)
    draws = discrete_gaussian_std(Noise.seeded(4), dp_gd.noise_units(config), 3)
    expected = -((total + draws).astype(np.float64) * records.unit) / 500.0
    assert np.allclose(output["theta"], expected, rtol=0, atol=1e-12)
    scanned = engine_table(table, ctx.schema, tmp_path, extra={ORDER_COLUMN: table[ORDER_COLUMN]})
    assert DpGdMechanism().run(params, ctx, scanned, Noise.seeded(4)).output == output


def test_the_unit_order_is_one_lexsort_over_every_key() -> None:
    """``kept_rows`` sorts by (unit, order) and re-sorts only tied rows by the tie keys: the same
    permutation as one stable lexsort over all keys, on tables full of ties."""
    from mechanisms.data.plan import _unit_order

    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 200))
        units, order = rng.integers(0, 5, n), rng.integers(0, 4, n)
        ties = [rng.integers(0, 3, n), rng.normal(size=n).round(0)]
        assert np.array_equal(_unit_order(units, order, ties), np.lexsort([*reversed(ties), order, units]))
