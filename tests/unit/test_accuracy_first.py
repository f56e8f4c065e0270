"""Accuracy-first statistics and noise-reduction sessions (mechanisms/reduction/accuracy_first.py).

Parameters, the checks (relative with the ŷ > 0 fix, absolute with confidence, private through
InteractiveAboveThreshold), charges (realized ≤ worst case, exact values), the session protocol (start
without data, one level per step, the secret never in an answer, realized from the transcript only).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve, pad_up
from mechanisms.base import InteractiveMechanism, Mechanism, ParamsError, PublicContext
from mechanisms.catalog import INTERACTIVE, MECHANISMS
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise
from mechanisms.queries.language import CountQuery, HistogramQuery
from mechanisms.reduction.accuracy_first import (
    ACCURACY_FIRST_GAUSSIAN,
    ACCURACY_FIRST_LAPLACE,
    NOT_REACHABLE,
    NR_GAUSSIAN_SESSION,
    NR_LAPLACE_SESSION,
    AccuracyFirst,
    NextQuery,
    NoiseReductionSession,
    RelativeTarget,
    output_dim,
    relative_pass,
)
from mechanisms.reduction.noise_reduction import brownian_cumulative_costs, brownian_grid, laplace_nr_scales
from mechanisms.threshold.interactive import iat_paper_calibration

SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            {"name": "thread", "type": "int", "min": 1, "max": 5},
            {"name": "g", "type": "categorical", "values": ["a", "b", "c"]},
            {"name": "zero", "type": "float", "min": 0.0, "max": 0.0},
            {"name": "x", "type": "float", "min": 0.0, "max": 10.0},
            {"name": "big", "type": "int", "min": 0, "max": 999},
        ],
        "neighboring": "add_remove",
    }
)
CTX = PublicContext(SCHEMA, None, DEFAULT_ORDERS)
RNG = np.random.default_rng(2024)
ROWS = 3000
TABLE: dict[str, np.ndarray] = {
    "thread": RNG.integers(1, 6, ROWS),
    "g": RNG.integers(0, 3, ROWS),
    "zero": np.zeros(ROWS),
    "x": RNG.uniform(0, 10, ROWS),
    "big": RNG.integers(0, 1000, ROWS),
}
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "accuracy_first_counts.py"
GRID = tuple(0.001 * math.sqrt(2) ** i for i in range(25))
COUNT = {"kind": "count", "where": [{"column": "thread", "op": "eq", "value": 2}]}
TRUE_COUNT = float(np.count_nonzero(TABLE["thread"] == 2))


def _laplace(**fields: Any) -> BaseModel:
    return ACCURACY_FIRST_LAPLACE.params_model.model_validate({"query": COUNT, "epsilons": GRID, **fields})


def _gaussian(**fields: Any) -> BaseModel:
    variances = tuple(1e8 / 2**i for i in range(30))
    model = ACCURACY_FIRST_GAUSSIAN.params_model
    return model.model_validate({"query": COUNT, "variances": variances, **fields})


# ----- registration and parameter models ---------------------------------------------------------------
def test_registered_in_the_catalog() -> None:
    for name in ("accuracy_first.laplace", "accuracy_first.gaussian"):
        assert isinstance(MECHANISMS[name], Mechanism)
        assert MECHANISMS[name].name == name
        MECHANISMS[name].params_model.model_json_schema()
    for name in ("noise_reduction.laplace", "noise_reduction.gaussian"):
        assert isinstance(INTERACTIVE[name], InteractiveMechanism)
        assert INTERACTIVE[name].name == name
        INTERACTIVE[name].query_model.model_json_schema()


@pytest.mark.parametrize(
    "fields",
    [
        {"epsilons": (0.1, 0.1)},
        {"epsilons": (0.2, 0.1)},
        {"epsilons": ()},
        {"epsilons": (0.0, 0.1)},
        {"epsilons": (0.1, math.inf)},
        {"target": {"relative": 0.0}},
        {"target": {"relative": 0.1, "extra": 1}},
        {"target": {"absolute": 1.0}},  # released check needs a confidence
        {"target": {"absolute": 1.0, "confidence": 1.0}},
        {"target": {"relative": 0.1}, "check": "private"},  # no private block
        {"target": {"relative": 0.1}, "private": {"epsilon_a": 1.0}},  # private block without the check
        {"check": "private", "private": {"epsilon_a": 1.0, "calibration": "paper"}},
        {"check": "private", "private": {"calibration": "paper", "width": 1.0}},
        {"check": "private", "private": {"epsilon_a": 1.0, "width": 1.0}},
        {"target": {"absolute": 1.0, "confidence": 0.9}, "check": "private", "private": {"epsilon_a": 1.0}},
        {"target": {"relative": 0.1}, "seed": 3},
    ],
)
def test_invalid_params_are_refused(fields: dict[str, Any]) -> None:
    base: dict[str, Any] = {"query": COUNT, "epsilons": GRID, "target": {"relative": 0.1}}
    with pytest.raises(ValidationError):
        ACCURACY_FIRST_LAPLACE.params_model.model_validate({**base, **fields})


def test_variance_grid_must_decrease() -> None:
    with pytest.raises(ValidationError, match="decreasing"):
        _gaussian(target={"relative": 0.1}, variances=(1.0, 2.0))


def test_schema_dependent_refusals() -> None:
    with pytest.raises(ParamsError, match="unknown column"):
        ACCURACY_FIRST_LAPLACE.check(
            ACCURACY_FIRST_LAPLACE.params_model.model_validate(
                {"query": {"kind": "sum", "column": "nope"}, "epsilons": GRID, "target": {"relative": 0.1}}
            ),
            CTX,
        )
    zero = ACCURACY_FIRST_LAPLACE.params_model.model_validate(
        {"query": {"kind": "sum", "column": "zero"}, "epsilons": GRID, "target": {"relative": 0.1}}
    )
    with pytest.raises(ParamsError, match="zero sensitivity"):
        ACCURACY_FIRST_LAPLACE.check(zero, CTX)
    # An absolute target that no level reaches is refused before any data is read (on the integer grid
    # an error below 1 means exact: P(Z = 0) = (1 − q)/(1 + q) must reach the confidence).
    unreachable = _laplace(target={"absolute": 1e-6, "confidence": 0.999})
    with pytest.raises(ParamsError, match=NOT_REACHABLE):
        ACCURACY_FIRST_LAPLACE.check(unreachable, CTX)
    huge = ACCURACY_FIRST_LAPLACE.params_model.model_validate(
        {
            "query": {"kind": "histogram", "column": "big"},
            "epsilons": tuple(0.001 * (1 + i) for i in range(10_000)),
            "target": {"relative": 0.1},
        }
    )
    with pytest.raises(ParamsError, match="levels × output size"):
        ACCURACY_FIRST_LAPLACE.check(huge, CTX)


def test_a_calibration_beyond_the_epsilon_range_is_refused() -> None:
    private = {"calibration": "paper", "width": 1e-3, "failure": 0.1}
    params = _laplace(target={"relative": 0.1}, check="private", private=private)
    with pytest.raises(ParamsError, match="ε_A"):
        ACCURACY_FIRST_LAPLACE.check(params, CTX)
    with pytest.raises(ParamsError, match="ε_A"):
        ACCURACY_FIRST_LAPLACE.worst_case(params, CTX)


def test_output_dim_comes_from_the_schema() -> None:
    assert output_dim(CountQuery(kind="count"), CTX) == 1
    assert output_dim(HistogramQuery(kind="histogram", column="g"), CTX) == 3
    assert output_dim(HistogramQuery(kind="histogram", column="thread"), CTX) == 5


# ----- the relative check --------------------------------------------------------------------------------
def test_relative_check_is_ghazi_rule_with_the_positive_fix() -> None:
    """r = 0.1: accept iff ŷ > 0 and σ ≤ ŷ/21 (Ghazi et al. §6.1)."""
    target = RelativeTarget(relative=0.1)
    sigma = np.array([1.0, 1.0, 1.0, 1.0])
    noisy = np.array([[21.0], [20.99], [-100.0], [0.0]])
    assert relative_pass(noisy, sigma, target).tolist() == [True, False, False, False]
    # The unfixed check |(ŷ+σ)/(ŷ−σ)| ∈ [0.9, 1.1] would accept ŷ = −100: we do not.
    y, s = -100.0, 1.0
    assert 0.9 <= abs((y + s) / (y - s)) <= 1.1
    # Histograms: every coordinate must pass.
    assert relative_pass(np.array([[30.0, 30.0], [30.0, 5.0]]), np.ones(2), target).tolist() == [True, False]
    doubled = RelativeTarget(relative=0.1, scale_multiplier=2.0)
    assert relative_pass(np.array([[21.0], [42.0]]), np.ones(2), doubled).tolist() == [False, True]


# ----- one-shot runs: charges and outputs ------------------------------------------------------------------
def _runs(mechanism: AccuracyFirst, params: BaseModel, n: int = 40) -> list[Any]:
    noise = Noise.seeded(7)
    return [mechanism.run(params, CTX, TABLE, noise) for _ in range(n)]


def test_relative_released_charges_the_stopped_level() -> None:
    params = _laplace(target={"relative": 0.1})
    worst = ACCURACY_FIRST_LAPLACE.worst_case(params, CTX)
    assert worst == RdpCurve.from_pure(GRID[-1], DEFAULT_ORDERS)
    scales = laplace_nr_scales(1.0, GRID)  # a count: γ = 1, Δ_g = 1
    for release in _runs(ACCURACY_FIRST_LAPLACE, params):
        out = release.output
        assert release.realized <= worst
        assert out["check"] == "released"
        level = out["level"]
        assert release.realized == RdpCurve.from_pure(GRID[level], DEFAULT_ORDERS)
        assert out["epsilon"] == GRID[level]
        assert out["noise"] == {
            "distribution": "discrete_laplace",
            "scale": scales[level],
            "granularity": 1.0,
            "grid_exponent": 0,
        }
        assert float(out["value"]).is_integer()  # on the public grid γ = 1
        if out["reached"]:
            # The released value itself passes the public check (post-processing).
            assert out["value"] > 0
            assert out["noise"]["scale"] * 2.1 <= 0.1 * out["value"]
        else:
            assert out["reason"] == NOT_REACHABLE
            assert level == len(GRID) - 1
        public = {"value", "noise", "epsilon", "reached", "level", "levels", "check", "reason", "interval"}
        assert set(out) <= public
    assert any(r.output["reached"] for r in _runs(ACCURACY_FIRST_LAPLACE, params))


def test_relative_target_unreachable_in_a_short_grid_reports_and_charges_the_last_level() -> None:
    params = ACCURACY_FIRST_LAPLACE.params_model.model_validate(
        {"query": COUNT, "epsilons": (1e-4, 2e-4), "target": {"relative": 0.01}}
    )
    for release in _runs(ACCURACY_FIRST_LAPLACE, params, 10):
        assert release.output["reached"] is False
        assert release.output["reason"] == NOT_REACHABLE
        assert release.realized == RdpCurve.from_pure(2e-4, DEFAULT_ORDERS)


def test_absolute_released_target_is_fixed_by_public_parameters() -> None:
    """The level is the first whose discrete Laplace satisfies P(|Z| ≤ ⌊a⌋)^d ≥ confidence (γ = 1):
    (1 − 2q^{⌊a⌋+1}/(1 + q))^d with q = e^{−1/scale}; charge = worst case."""
    a, confidence = 20.0, 0.95
    params = ACCURACY_FIRST_LAPLACE.params_model.model_validate(
        {
            "query": {"kind": "histogram", "column": "g"},
            "epsilons": GRID,
            "target": {"absolute": a, "confidence": confidence},
        }
    )
    scales = laplace_nr_scales(1.0, GRID)
    q = np.exp(-1 / scales)
    ok = (1 - 2 * q ** (math.floor(a) + 1) / (1 + q)) ** 3 >= confidence
    expected = int(np.argmax(ok))
    assert ok[expected]
    assert not ok[expected - 1]
    worst = ACCURACY_FIRST_LAPLACE.worst_case(params, CTX)
    assert worst == RdpCurve.from_pure(GRID[expected], DEFAULT_ORDERS)
    releases = _runs(ACCURACY_FIRST_LAPLACE, params, 200)
    for release in releases:
        assert release.output["level"] == expected
        assert release.realized == worst
        assert set(release.output["values"]) == {"a", "b", "c"}
    # The stated accuracy holds empirically (200 runs, P(miss) ≤ 5%; fails only with tiny probability).
    truth = np.bincount(TABLE["g"], minlength=3)
    errors = [max(abs(np.array(list(r.output["values"].values())) - truth)) for r in releases]
    assert np.mean(np.array(errors) > a) < 0.12


def test_private_check_charges_epsilon_a_plus_the_level() -> None:
    calibration = iat_paper_calibration(1.1, 10.0, 0.1, len(GRID))  # Δ_q = (1 + r)·γ·m = 1.1
    params = _laplace(
        target={"relative": 0.1},
        check="private",
        private={"calibration": "paper", "width": 10.0, "failure": 0.1},
    )
    worst = ACCURACY_FIRST_LAPLACE.worst_case(params, CTX)
    assert worst.pure == pytest.approx(calibration.epsilon_a + GRID[-1], rel=1e-12)
    for release in _runs(ACCURACY_FIRST_LAPLACE, params):
        level = release.output["level"]
        assert release.realized <= worst
        assert release.realized.pure == pytest.approx(calibration.epsilon_a + GRID[level], rel=1e-12)
        assert release.realized.pure >= calibration.epsilon_a + GRID[level] - 1e-15
        assert release.output["check"] == "private"
    # An explicit ε_A with an impossible threshold never passes: ⊥ costs ε_A + ε_{T−1}.
    never = _laplace(target={"relative": 0.1}, check="private", private={"epsilon_a": 0.5, "threshold": 1e12})
    for release in _runs(ACCURACY_FIRST_LAPLACE, never, 5):
        assert release.output["reached"] is False
        assert release.output["level"] == len(GRID) - 1
        assert release.realized.pure == pytest.approx(0.5 + GRID[-1], rel=1e-12)


@pytest.mark.slow
def test_private_check_accepts_only_accurate_releases() -> None:
    """With a wide-margin calibration the accepted releases meet the true relative error (Thm A.1)."""
    params = _laplace(
        target={"relative": 0.2},
        check="private",
        private={"calibration": "paper", "width": 10.0, "failure": 0.05},
    )
    releases = _runs(ACCURACY_FIRST_LAPLACE, params, 60)
    accepted = [r for r in releases if r.output["reached"]]
    assert len(accepted) > 30
    for release in accepted:
        assert abs(release.output["value"] - TRUE_COUNT) <= 0.2 * TRUE_COUNT


@pytest.mark.slow
def test_gaussian_one_shot_charges_the_brownian_curve() -> None:
    params = _gaussian(target={"relative": 0.1})
    variances = params.variances  # type: ignore[attr-defined]
    worst = ACCURACY_FIRST_GAUSSIAN.worst_case(params, CTX)
    assert worst == _brownian(variances, len(variances) - 1)
    # The grid charge is the continuous curve α/(2t) within the rounding term (1 + 2^-10)².
    for alpha, value in zip(DEFAULT_ORDERS, worst.values, strict=True):
        continuous = alpha / (2 * variances[-1])
        assert continuous * (1 - 2.0**-11) <= value <= continuous * (1 + 2.0**-10) ** 2 * (1 + 1e-12)
    grid = brownian_grid(1.0, variances, 1)
    for release in _runs(ACCURACY_FIRST_GAUSSIAN, params):
        level = release.output["level"]
        assert release.realized == _brownian(variances, level)
        assert release.realized <= worst
        assert release.output["noise"] == {
            "distribution": "discrete_gaussian_bridge",
            "sigma": math.sqrt(variances[level]),
            **grid.describe(),
        }
        units = release.output["value"] / grid.granularity
        assert units == int(units)  # a multiple of the published γ
    private = _gaussian(target={"relative": 0.1}, check="private", private={"epsilon_a": 0.3})
    pworst = ACCURACY_FIRST_GAUSSIAN.worst_case(private, CTX)
    assert pworst.pure == math.inf
    assert pworst.at(2.0) == pytest.approx(worst.at(2.0) + 0.3, rel=1e-12)
    for release in _runs(ACCURACY_FIRST_GAUSSIAN, private, 10):
        level = release.output["level"]
        base = _brownian(variances, level)
        assert release.realized <= pworst
        assert all(r >= b + 0.3 - 1e-12 for r, b in zip(release.realized.values, base.values, strict=True))
    absolute = _gaussian(target={"absolute": 50.0, "confidence": 0.9})
    level = next(i for i, t in enumerate(variances) if 2 * stats.norm.sf(50 / math.sqrt(t)) <= 0.1)
    assert ACCURACY_FIRST_GAUSSIAN.worst_case(absolute, CTX) == _brownian(variances, level)


def _brownian(variances: tuple[float, ...], level: int) -> RdpCurve:
    """The grid Brownian charge of a count (Δ₂ = 1, d = 1): α·C_level (cumulative step costs)."""
    grid = brownian_grid(1.0, variances, 1)
    m = (
        float(math.floor(1.0 / grid.granularity + 1 / 64) + 1)
        if grid.exponent > 0
        else 1.0 / grid.granularity
    )
    cost = brownian_cumulative_costs(m, variances, 1, grid)[level]
    return RdpCurve(DEFAULT_ORDERS, tuple(pad_up(a * cost) for a in DEFAULT_ORDERS))


# ----- sessions -------------------------------------------------------------------------------------------
SESSION_GRID = (0.05, 0.2, 0.5, 1.0)


def _session_params(session: NoiseReductionSession, query: dict[str, Any]) -> BaseModel:
    laplace = session is NR_LAPLACE_SESSION
    grid: dict[str, Any] = {"epsilons": SESSION_GRID} if laplace else {"variances": (100.0, 10.0, 1.0, 0.1)}
    return session.params_model.model_validate({"query": query, **grid})


@pytest.mark.parametrize("session", [NR_LAPLACE_SESSION, NR_GAUSSIAN_SESSION])
@pytest.mark.parametrize("query", [COUNT, {"kind": "histogram", "column": "g"}])
def test_session_releases_one_level_per_step(session: NoiseReductionSession, query: dict[str, Any]) -> None:
    params = _session_params(session, query)
    rng = Noise.seeded(17)
    worst = session.worst_case(params, CTX)
    state = session.start(params, CTX, rng)  # no table: the data is never read at start
    state = json.loads(json.dumps(state))  # the service persists it as JSON
    steps: list[tuple[dict[str, Any], dict[str, Any]]] = []
    assert session.realized(params, CTX, steps, False) == RdpCurve.zero(DEFAULT_ORDERS)
    for level in range(4):
        q = session.query_model.model_validate({})
        session.check_query(params, CTX, q, level)
        result = session.step(params, CTX, state, q, TABLE, rng)
        answer = result.answer
        assert answer["level"] == level
        assert answer["levels"] == 4
        assert result.halted == (level == 3)
        # The secret (the current noise) is never in the answer: it only has public fields.
        public = {"level", "levels", "epsilon", "variance", "value", "values", "noise", "interval"}
        assert set(answer) <= public
        if session is NR_LAPLACE_SESSION:
            noise = result.state["sampler"]["noise"]
            if level < 3:  # (a coordinate's noise can be 0, which prints as a digit of anything)
                assert "noise" not in json.dumps(answer["noise"])
            assert all(isinstance(x, int) for x in noise)
        values = [answer["value"]] if "value" in answer else list(answer["values"].values())
        gamma = answer["noise"]["granularity"]
        assert all(v / gamma == int(v / gamma) for v in values)
        steps.append((q.model_dump(mode="json"), answer))
        realized = session.realized(params, CTX, steps, result.halted)
        assert realized <= worst
        state = json.loads(json.dumps(result.state))
    assert realized == worst
    with pytest.raises(ParamsError, match="already released all 4 levels"):
        session.check_query(params, CTX, NextQuery(), 4)
    with pytest.raises(ValueError, match="halted"):
        session.step(params, CTX, state, NextQuery(), TABLE, rng)


def test_session_realized_is_the_last_released_level() -> None:
    params = _session_params(NR_LAPLACE_SESSION, COUNT)
    steps = [({}, {"level": i}) for i in range(2)]
    assert NR_LAPLACE_SESSION.realized(params, CTX, steps, False) == RdpCurve.from_pure(0.2, DEFAULT_ORDERS)
    with pytest.raises(ValueError, match=r"not a noise_reduction\.laplace answer"):
        NR_LAPLACE_SESSION.realized(params, CTX, [({}, {"level": 1})], False)
    with pytest.raises(ValueError, match="longer than the grid"):
        NR_LAPLACE_SESSION.realized(params, CTX, [({}, {"level": i}) for i in range(5)], False)
    with pytest.raises(ValidationError):
        NextQuery.model_validate({"level": 3})


def test_session_state_must_match_its_params() -> None:
    params = _session_params(NR_LAPLACE_SESSION, COUNT)
    rng = Noise.seeded(0)
    state = NR_LAPLACE_SESSION.start(params, CTX, rng)
    forged = {**state, "sampler": {**state["sampler"], "epsilons": [0.05, 0.2, 0.5, 100.0]}}
    with pytest.raises(ValueError, match=r"not a noise_reduction\.laplace session state"):
        NR_LAPLACE_SESSION.step(params, CTX, forged, NextQuery(), TABLE, rng)
    for bad in ({**state, "mechanism": "noise_reduction.gaussian"}, {**state, "released": -1}, {}):
        with pytest.raises(ValueError, match="session state"):
            NR_LAPLACE_SESSION.step(params, CTX, bad, NextQuery(), TABLE, rng)


# ----- benchmark smoke test --------------------------------------------------------------------------------
@pytest.mark.slow
def test_benchmark_quick_smoke(tmp_path: Path) -> None:
    """``benchmarks/accuracy_first_counts.py --quick`` runs through the real HTTP service and the ledger's
    pure spend equals the sum of the published realized charges (never above the budget)."""
    out = tmp_path / "afc.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["quick"] is True
    assert result["ledger_consistent"] is True
    runs = result["results"]["8000"]["per_run"]
    assert len(runs) == 2
    for run in runs:
        assert 0 < run["answers"] <= run["requests"]
        assert run["ledger_pure_spent"] <= 10.0
        assert run["ledger_pure_spent"] == pytest.approx(run["spent_client"], rel=1e-9)
