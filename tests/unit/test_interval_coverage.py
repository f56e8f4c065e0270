"""Monte Carlo coverage of the intervals published with grouped measures, accuracy-first releases and
noise-reduction sessions (issue 35 item 3).

Each test runs the real mechanism RUNS times with fixed seeds and counts the runs whose interval misses the
true value computed independently from the rows (NumPy on the clipped data): the miss count must stay below
the binomial quantile of a miss rate 1 − level at false-alarm FALSE_ALARM. The power check narrows the same
intervals around their midpoints (to half, or for the conservative union-bound intervals a quarter, of
their width) and asserts that this broken variant misses more than the bound allows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise
from mechanisms.queries.intervals import union_level
from mechanisms.queries.measures import (
    MeasuresGaussian,
    MeasuresGaussianParams,
    MeasuresLaplace,
    MeasuresLaplaceParams,
)
from mechanisms.reduction.accuracy_first import (
    ACCURACY_FIRST_GAUSSIAN,
    ACCURACY_FIRST_LAPLACE,
    NR_GAUSSIAN_SESSION,
    NR_LAPLACE_SESSION,
    NextQuery,
)
from mechanisms.reduction.accuracy_first_params import LaplaceOneShotParams
from service.api.sql_view import Output, SqlView

RUNS = 400
FALSE_ALARM = 1e-3
LEVEL = 0.8
COLUMNS: list[dict[str, Any]] = [
    {"name": "x", "type": "float", "min": -0.1, "max": 0.3},
    {"name": "k", "type": "int", "min": -3, "max": 7},
    {"name": "g", "type": "categorical", "values": ["a", "b", "c"]},
]
MEASURES = [
    {"kind": "count"},
    {"kind": "sum", "column": "k"},
    {"kind": "mean", "column": "x"},
    {"kind": "variance", "column": "x"},
    {"kind": "std", "column": "k"},
]


def _ctx(neighboring: str = "add_remove", n_rows: int | None = None) -> PublicContext:
    schema = DatasetSchema.model_validate({"columns": COLUMNS, "neighboring": neighboring})
    return PublicContext(schema, n_rows, DEFAULT_ORDERS)


def _rows(n: int, seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.uniform(-0.1, 0.3, n),
        "k": rng.integers(-3, 8, n).astype(np.int64),
        "g": rng.choice(3, n, p=[0.6, 0.3, 0.1]).astype(np.int64),
    }


def _truth(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    cells = [rows["g"] == g for g in range(3)]
    return {
        "count": np.array([c.sum() for c in cells], dtype=float),
        "sum(k)": np.array([rows["k"][c].sum() for c in cells], dtype=float),
        "mean(x)": np.array([rows["x"][c].mean() for c in cells]),
        "variance(x)": np.array([rows["x"][c].var() for c in cells]),
        "std(k)": np.array([rows["k"][c].std() for c in cells]),
    }


def _bound(level: float, trials: int) -> int:
    """The largest miss count a correct interval reaches with probability ≤ FALSE_ALARM."""
    return int(stats.binom.ppf(1.0 - FALSE_ALARM, trials, 1.0 - level))


def _misses(lower: np.ndarray, upper: np.ndarray, truth: np.ndarray, shrink: float = 1.0) -> int:
    mid, half = (lower + upper) / 2.0, (upper - lower) / 2.0 * shrink
    return int(np.sum((truth < mid - half) | (truth > mid + half)))


# ----- grouped measures ---------------------------------------------------------------------------------
def _measure_runs(mechanism: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[str]]:
    rows = _rows(600)
    ctx = _ctx()
    base = {"measures": MEASURES, "group_by": ["g"], "confidence": LEVEL}
    lows: dict[str, list[np.ndarray]] = {}
    highs: dict[str, list[np.ndarray]] = {}
    union: list[str] = []
    for seed in range(RUNS):
        if mechanism == "laplace":
            release = MeasuresLaplace().run(
                MeasuresLaplaceParams.model_validate({**base, "epsilon": 4.0}), ctx, rows, Noise.seeded(seed)
            )
        else:
            params = MeasuresGaussianParams.model_validate({**base, "noise_multiplier": 1.0})
            release = MeasuresGaussian().run(params, ctx, rows, Noise.seeded(seed))
        out = release.output
        assert out["interval"]["level"] == LEVEL
        union = out["interval"]["union_bound"]
        for label in _truth(rows):
            lows.setdefault(label, []).append(
                np.array([g["interval"]["lower"][label] for g in out["groups"]])
            )
            highs.setdefault(label, []).append(
                np.array([g["interval"]["upper"][label] for g in out["groups"]])
            )
            values = np.array([g[label] for g in out["groups"]])
            assert np.all(lows[label][-1] <= values)
            assert np.all(values <= highs[label][-1])
    return (
        {k: np.concatenate(v) for k, v in lows.items()},
        {k: np.concatenate(v) for k, v in highs.items()},
        union,
    )


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
def test_measures_intervals_cover_at_their_level(mechanism: str) -> None:
    lows, highs, union = _measure_runs(mechanism)
    assert union == ["mean(x)", "variance(x)", "std(k)"]  # derived from several noisy blocks
    truth = _truth(_rows(600))
    trials = RUNS * 3  # three cells per run, each with its own noise
    bound = _bound(LEVEL, trials)
    observed = {}
    for label, exact in truth.items():
        repeated = np.tile(exact, RUNS)
        misses = _misses(lows[label], highs[label], repeated)
        observed[label] = misses
        assert misses <= bound, (label, misses, bound)
        # power: a narrowed interval (half width; a quarter for the conservative union bounds) is caught
        shrink = 0.25 if label in union else 0.5
        narrowed = _misses(lows[label], highs[label], repeated, shrink)
        assert narrowed > bound, (label, narrowed, bound)
    print(mechanism, "misses per", trials, "cells:", observed, "bound", bound)


def test_measures_public_size_and_point_interval() -> None:
    """replace-one without where or group-by: the count is the public n (point interval), a mean reads one
    noisy block only (not a union bound)."""
    rows = _rows(50)
    params = MeasuresLaplaceParams.model_validate(
        {"measures": [{"kind": "count"}, {"kind": "mean", "column": "x"}], "epsilon": 1.0}
    )
    out = MeasuresLaplace().run(params, _ctx("replace_one", 50), rows, Noise.seeded(1)).output
    assert out["interval"]["lower"]["count"] == out["interval"]["upper"]["count"] == 50.0
    assert out["interval"]["union_bound"] == []
    assert out["interval"]["level"] == 0.95
    assert -0.1 <= out["interval"]["lower"]["mean(x)"] <= out["values"]["mean(x)"]


def test_measures_level_too_close_to_one_is_refused() -> None:
    from mechanisms.base import ParamsError

    params = MeasuresLaplaceParams.model_validate(
        {"measures": MEASURES, "group_by": ["g"], "epsilon": 1.0, "confidence": 1.0 - 2.0**-53}
    )
    with pytest.raises(ParamsError) as refused:
        MeasuresLaplace().check(params, _ctx())
    assert refused.value.field == "confidence"


def test_union_level_sums_the_misses_exactly() -> None:
    from fractions import Fraction

    for level, m in [(0.95, 3), (0.8, 7), (0.999, 1000), (0.5, 2)]:
        each = union_level(level, m)
        assert m * (1 - Fraction(each)) <= 1 - Fraction(level)
        assert each < 1.0


# ----- accuracy-first ------------------------------------------------------------------------------------
def _count_rows(n: int) -> dict[str, np.ndarray]:
    return _rows(n)


@pytest.mark.parametrize(
    ("mechanism", "grid"),
    [
        (ACCURACY_FIRST_LAPLACE, {"epsilons": [0.05, 0.1, 0.2, 0.4, 0.8, 1.6]}),
        (ACCURACY_FIRST_GAUSSIAN, {"variances": [400.0, 200.0, 100.0, 50.0, 25.0, 12.0]}),
    ],
)
def test_accuracy_first_interval_covers_whatever_level_is_released(
    mechanism: Any, grid: dict[str, Any]
) -> None:
    n = 40
    rows = _count_rows(n)
    params = mechanism.params_model.model_validate(
        {"query": {"kind": "count"}, "target": {"relative": 0.3}, "confidence": LEVEL, **grid}
    )
    lows, highs, levels = [], [], []
    for seed in range(RUNS):
        out = mechanism.run(params, _ctx(), rows, Noise.seeded(seed)).output
        interval = out["interval"]
        assert interval["level"] == LEVEL
        assert interval["union_over_levels"] == 6
        assert interval["lower"] <= out["value"] <= interval["upper"]
        lows.append(interval["lower"])
        highs.append(interval["upper"])
        levels.append(out["level"])
    assert len(set(levels)) > 1  # the stopping level varies: the interval must hold whichever
    truth = np.full(RUNS, float(n))
    bound = _bound(LEVEL, RUNS)
    misses = _misses(np.array(lows), np.array(highs), truth)
    print(mechanism.name, "misses", misses, "of", RUNS, "bound", bound, "levels", np.bincount(levels))
    assert misses <= bound
    assert _misses(np.array(lows), np.array(highs), truth, 0.25) > bound  # power


def test_accuracy_first_fixed_level_is_not_a_union_bound() -> None:
    params = LaplaceOneShotParams.model_validate(
        {
            "query": {"kind": "count"},
            "target": {"absolute": 10.0, "confidence": 0.9},
            "epsilons": [0.1, 1.0, 2.0],
        }
    )
    out = ACCURACY_FIRST_LAPLACE.run(params, _ctx(), _count_rows(30), Noise.seeded(2)).output
    assert out["interval"]["union_over_levels"] == 1


# ----- noise-reduction sessions --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("session", "grid"),
    [
        (NR_LAPLACE_SESSION, {"epsilons": [0.05, 0.1, 0.2, 0.4, 0.8]}),
        (NR_GAUSSIAN_SESSION, {"variances": [400.0, 100.0, 25.0, 6.0, 1.5]}),
    ],
)
def test_session_intervals_hold_at_every_step_at_once(session: Any, grid: dict[str, Any]) -> None:
    n = 40
    rows = _count_rows(n)
    ctx = _ctx()
    params = session.params_model.model_validate({"query": {"kind": "count"}, "confidence": LEVEL, **grid})
    any_miss, narrowed_miss = 0, 0
    for seed in range(RUNS):
        noise = Noise.seeded(seed)
        state = session.start(params, ctx, noise)
        lows, highs = [], []
        for _ in range(5):
            result = session.step(params, ctx, state, NextQuery(), rows, noise)
            state = result.state
            interval = result.answer["interval"]
            assert interval["union_over_levels"] == 5
            assert interval["level"] == LEVEL
            lows.append(interval["lower"])
            highs.append(interval["upper"])
        truth = np.full(5, float(n))
        any_miss += _misses(np.array(lows), np.array(highs), truth) > 0
        narrowed_miss += _misses(np.array(lows), np.array(highs), truth, 0.25) > 0
    bound = _bound(LEVEL, RUNS)
    print(session.name, "runs with a miss at some step:", any_miss, "of", RUNS, "bound", bound)
    assert any_miss <= bound
    assert narrowed_miss > bound  # power


# ----- the SQL view's intervals and warnings --------------------------------------------------------------
def test_sql_view_rows_carry_intervals_and_name_a_negative_count() -> None:
    release = {
        "groups": [
            {
                "key": {"g": "a"},
                "count": -5.0,
                "interval": {"lower": {"count": -9.0}, "upper": {"count": -1.0}},
            },
            {
                "key": {"g": "b"},
                "count": 12.0,
                "interval": {"lower": {"count": 8.0}, "upper": {"count": 16.0}},
            },
        ],
        "interval": {"level": 0.95, "union_bound": []},
    }
    outputs = (Output("g", "key", "g", "g"), Output("COUNT(*)", "value", "count", "COUNT(*)"))
    view = SqlView(outputs)
    rows, intervals = view.table(release)
    assert rows == [{"g": "a", "COUNT(*)": -5.0}, {"g": "b", "COUNT(*)": 12.0}]
    assert intervals == [{"COUNT(*)": [-9.0, -1.0]}, {"COUNT(*)": [8.0, 16.0]}]
    warnings = view.warnings(release, rows)
    assert any("COUNT(*) is negative in 1 row" in w for w in warnings)
    assert not view.warnings(release, rows[1:])
