"""Laplace and Gaussian mechanisms: the seam, worst-case curves, grid releases and affordable costs."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError

from mechanisms.accounting import RdpCurve
from mechanisms.base import Mechanism, ParamsError, PublicContext, best_affordable_cost
from mechanisms.catalog import MECHANISMS
from mechanisms.data.table import LoadedTable
from mechanisms.noise import Grid, Noise, dyadic_scale_up
from mechanisms.queries.gaussian import Gaussian, GaussianParams
from mechanisms.queries.language import (
    CountQuery,
    MeanQuery,
    SumQuery,
    is_integer_valued,
    l1,
    plan_grid,
    shifts,
)
from mechanisms.queries.laplace import Laplace, LaplaceParams

LAPLACE = Laplace()
GAUSSIAN = Gaussian()
COUNT: dict[str, Any] = {"kind": "count"}
HISTOGRAM: dict[str, Any] = {"kind": "histogram", "column": "group"}
SUM: dict[str, Any] = {
    "kind": "sum",
    "column": "age",
    "where": [{"column": "group", "op": "eq", "value": "a"}],
}
QUERIES = [COUNT, HISTOGRAM, SUM, {"kind": "histogram", "column": "n"}]


def laplace(query: dict[str, Any], epsilon: float = 1.0) -> LaplaceParams:
    return LaplaceParams.model_validate({"query": query, "epsilon": epsilon})


def gaussian(query: dict[str, Any], sigma: float = 1.0) -> GaussianParams:
    return GaussianParams.model_validate({"query": query, "sigma": sigma})


def test_catalog() -> None:
    assert {"laplace", "gaussian"} <= set(MECHANISMS)
    for name, mechanism in MECHANISMS.items():
        assert mechanism.name == name
        assert mechanism.summary
        assert issubclass(mechanism.params_model, BaseModel)
        schema = mechanism.params_model.model_json_schema()
        assert mechanism.cost_parameter in schema["properties"]
    assert MECHANISMS["laplace"].cost_increases_with_parameter is True
    assert MECHANISMS["gaussian"].cost_increases_with_parameter is False


@pytest.mark.parametrize(
    ("model", "fields"),
    [
        (LaplaceParams, {"query": COUNT, "epsilon": 0}),
        (LaplaceParams, {"query": COUNT, "epsilon": -1}),
        (LaplaceParams, {"query": COUNT, "epsilon": 100.5}),
        (LaplaceParams, {"query": COUNT, "epsilon": float("nan")}),
        (LaplaceParams, {"query": COUNT, "epsilon": 1, "seed": 3}),
        (LaplaceParams, {"query": COUNT}),
        (GaussianParams, {"query": COUNT, "sigma": 0}),
        (GaussianParams, {"query": COUNT, "sigma": float("inf")}),
        (GaussianParams, {"query": COUNT, "sigma": 2e9}),
        (GaussianParams, {"query": COUNT, "epsilon": 1}),
    ],
)
def test_params_validation(model: type[BaseModel], fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        model.model_validate(fields)


def test_params_are_frozen() -> None:
    params = laplace(COUNT)
    with pytest.raises(ValidationError):
        params.epsilon = 2.0  # type: ignore[misc]


@pytest.mark.parametrize("mechanism", [LAPLACE, GAUSSIAN])
def test_check_raises_params_error(mechanism: Mechanism, ctx: PublicContext) -> None:
    params = mechanism.params_model.model_validate(
        {"query": {"kind": "sum", "column": "group"}, mechanism.cost_parameter: 1.0}
    )
    with pytest.raises(ParamsError) as caught:
        mechanism.check(params, ctx)
    assert caught.value.field == "query.column"


@pytest.mark.parametrize("mechanism", [LAPLACE, GAUSSIAN])
def test_a_mean_under_add_remove_is_a_sum_over_a_count(
    mechanism: Mechanism, add_remove_ctx: PublicContext
) -> None:
    """Issue 35 item 9: no longer refused (tests/unit/test_ratio_mean.py has the details); a mean of a
    categorical column still is, naming the column."""
    params = mechanism.params_model.model_validate(
        {"query": {"kind": "mean", "column": "age"}, mechanism.cost_parameter: 1.0}
    )
    mechanism.check(params, add_remove_ctx)
    assert mechanism.worst_case(params, add_remove_ctx).values[-1] > 0
    region = mechanism.params_model.model_validate(
        {"query": {"kind": "mean", "column": "region"}, mechanism.cost_parameter: 1.0}
    )
    with pytest.raises(ParamsError) as caught:
        mechanism.check(region, add_remove_ctx)
    assert caught.value.field == "query.column"


def test_check_rejects_the_other_mechanisms_params(ctx: PublicContext) -> None:
    with pytest.raises(TypeError):
        LAPLACE.check(gaussian(COUNT), ctx)
    with pytest.raises(TypeError):
        GAUSSIAN.worst_case(laplace(COUNT), ctx)


# ----- worst case --------------------------------------------------------------------------------------
def test_laplace_worst_case_is_pure_epsilon(ctx: PublicContext) -> None:
    for query in QUERIES:
        curve = LAPLACE.worst_case(laplace(query, 0.7), ctx)
        assert curve.pure == 0.7
        assert curve.orders == ctx.orders
        assert max(curve.values) <= 0.7


def test_laplace_histogram_under_replace_one_splits_epsilon(make_ctx: Any) -> None:
    replace, add_remove = make_ctx("replace_one"), make_ctx("add_remove")
    two_bins = LAPLACE.worst_case(laplace(HISTOGRAM, 1.0), replace)
    one_bin = LAPLACE.worst_case(laplace(HISTOGRAM, 1.0), add_remove)
    # discrete Laplace on γ = 1: per-coordinate pure ε_j = 1/t, charged with the randomized-response bound
    assert two_bins.values == RdpCurve.pure_product((0.5, 0.5), replace.orders).values
    assert one_bin.values == RdpCurve.pure_product((1.0,), add_remove.orders).values
    assert two_bins.pure == one_bin.pure == 1.0
    assert all(a < b for a, b in zip(two_bins.values, one_bin.values, strict=True))


def test_gaussian_worst_case_formula(make_ctx: Any) -> None:
    replace = make_ctx("replace_one")
    curve = GAUSSIAN.worst_case(gaussian(HISTOGRAM, 2.0), replace)
    assert math.isinf(curve.pure)
    for alpha, value in zip(curve.orders, curve.values, strict=True):
        assert value == pytest.approx(alpha * 2.0 / (2 * 4.0), rel=1e-12)
        assert value >= alpha * 2.0 / 8.0
    # mean of age over n = 5: Δ₂ = 20, real-valued: γ = 2^-6 ≤ 20/1024, Δ₂_grid = ⌊20/γ + 1/64⌋ + 1 = 1281
    mean = GAUSSIAN.worst_case(gaussian({"kind": "mean", "column": "age"}, 4.0), replace)
    assert mean.at(2.0) == pytest.approx(2.0 * 1281.0**2 / (2 * (4.0 * 64) ** 2), rel=1e-12)
    assert 2.0 * 20.0**2 / (2 * 16.0) < mean.at(2.0) < 2.0 * 20.0**2 / (2 * 16.0) * (1 + 2**-8)


def _dp_accounting_rdp(event_name: str, noise_multiplier: float, orders: tuple[float, ...]) -> list[float]:
    """RDP of one event per Google's dp-accounting (independent implementation, tests only)."""
    dp_accounting = pytest.importorskip("dp_accounting")
    accountant = dp_accounting.rdp.RdpAccountant(list(orders))
    accountant.compose(getattr(dp_accounting, event_name)(noise_multiplier))
    return [float(v) for v in accountant._rdp]


def test_gaussian_matches_dp_accounting(make_ctx: Any) -> None:
    ctx = make_ctx("add_remove")
    count = GAUSSIAN.worst_case(gaussian(COUNT, 3.0), ctx)  # γ = 1, Δ₂ = 1: noise multiplier 3, no rounding
    expected = _dp_accounting_rdp("GaussianDpEvent", 3.0, ctx.orders)
    assert list(count.values) == pytest.approx(expected, rel=1e-12)
    assert all(ours >= theirs for ours, theirs in zip(count.values, expected, strict=True))
    # a real-valued sum (Δ₂ = 100) pays the grid's rounding: Δ₂_grid·γ = 100 + γ with γ = 2^-4
    curve = GAUSSIAN.worst_case(gaussian(SUM, 300.0), ctx)
    expected = _dp_accounting_rdp("GaussianDpEvent", 300.0 / (100.0 + 2**-4), ctx.orders)
    assert list(curve.values) == pytest.approx(expected, rel=1e-12)


def test_laplace_charge_is_above_dp_accounting_continuous_laplace(make_ctx: Any) -> None:
    """The discrete Laplace (Δ₁ = 1, t = 2) is charged the randomized-response bound: ≥ dp-accounting's
    continuous Laplace at every order, strictly above at large orders (the continuous formula would
    under-charge the discrete noise; tests/unit/test_noise.py computes the exact discrete divergence)."""
    ctx = make_ctx("add_remove")
    curve = LAPLACE.worst_case(laplace(COUNT, 0.5), ctx)
    expected = _dp_accounting_rdp("LaplaceDpEvent", 2.0, ctx.orders)
    assert all(ours >= theirs for ours, theirs in zip(curve.values, expected, strict=True))
    assert curve.values[-1] > expected[-1] + 5e-4  # 0.4981 vs 0.4973 at α = 256
    assert curve.values == RdpCurve.pure_product((0.5,), ctx.orders).values


@pytest.mark.parametrize("query", QUERIES)
def test_laplace_worst_case_increases_with_epsilon(ctx: PublicContext, query: dict[str, Any]) -> None:
    curves = [LAPLACE.worst_case(laplace(query, eps), ctx) for eps in (0.01, 0.1, 0.5, 1.0, 3.0, 10.0)]
    for smaller, larger in itertools.pairwise(curves):
        assert smaller <= larger
        assert smaller.pure < larger.pure


@pytest.mark.parametrize("query", QUERIES)
def test_gaussian_worst_case_decreases_with_sigma(ctx: PublicContext, query: dict[str, Any]) -> None:
    curves = [GAUSSIAN.worst_case(gaussian(query, s), ctx) for s in (0.1, 0.5, 1.0, 5.0, 100.0)]
    for noisier, quieter in ((b, a) for a, b in itertools.pairwise(curves)):
        assert noisier <= quieter
        assert noisier.at(2.0) < quieter.at(2.0)


# ----- run ---------------------------------------------------------------------------------------------
def _unit_moves(query: dict[str, Any], ctx: PublicContext, granularity: float) -> list[int]:
    """How far each released coordinate of round(f/γ) can move between neighbours, derived by hand from the
    test schema (not from ``mechanisms.queries.language``): counts and histogram bins move by 1 (replace-one
    moves two bins), the sum of age over group = a by Δ = 100 (age ∈ [0, 100]); a real-valued answer
    rounded to γ moves by at most ⌊Δ/γ⌋ + 1 units, an integer answer on γ = 1 by exactly Δ."""
    if query["kind"] == "sum":
        return [math.floor(100.0 / granularity) + 1]
    bins = 2 if query["kind"] == "histogram" and ctx.schema.neighboring == "replace_one" else 1
    return [1] * bins


def _discrete_laplace_divergence(alpha: float, t: float, shift: int) -> float:
    """D_α(P‖P shifted by ``shift``) of the discrete Laplace P(z) ∝ exp(−|z|/t), summed over the pmf."""
    z = np.arange(-60 * int(t) - 4 * shift - 200, 60 * int(t) + 4 * shift + 200, dtype=float)
    log_p = -np.abs(z) / t
    log_p -= np.logaddexp.reduce(log_p)
    log_q = -np.abs(z - shift) / t
    log_q -= np.logaddexp.reduce(log_q)
    return float(np.logaddexp.reduce(alpha * log_p + (1.0 - alpha) * log_q) / (alpha - 1.0))


@pytest.mark.parametrize("query", QUERIES)
@pytest.mark.parametrize("mechanism", [LAPLACE, GAUSSIAN])
def test_realized_is_the_closed_form_charge(
    mechanism: Mechanism[Any], query: dict[str, Any], ctx: PublicContext, table: LoadedTable
) -> None:
    """The realized charge against closed forms computed here from the release's public noise description:
    Laplace (pure ε): pure slot exactly ε, every order ≤ ε and ≥ the exact Rényi divergence of the released
    discrete Laplace at the neighbours' shifts (summed over the pmf: an under-charge, e.g. Mironov's
    continuous-Laplace formula, fails at large α); Gaussian: α·‖m‖²/(2σ_u²) at every order (σ_u = σ/γ)."""
    params = mechanism.params_model.model_validate({"query": query, mechanism.cost_parameter: 0.5})
    mechanism.check(params, ctx)
    release = mechanism.run(params, ctx, table.columns, Noise.seeded(12345))
    realized, noise = release.realized, release.output["noise"]
    moves = _unit_moves(query, ctx, noise["granularity"])
    if mechanism is LAPLACE:
        assert realized.pure == 0.5
        t = noise["scale_units"]
        for alpha, value in zip(realized.orders, realized.values, strict=True):
            exact = sum(_discrete_laplace_divergence(alpha, t, m) for m in moves)
            assert exact * (1.0 - 1e-9) <= value <= 0.5
    else:
        assert math.isinf(realized.pure)
        sigma_units = noise["sigma_units"]
        assert sigma_units == 0.5 / noise["granularity"]
        for alpha, value in zip(realized.orders, realized.values, strict=True):
            closed_form = alpha * sum(m * m for m in moves) / (2.0 * sigma_units**2)
            assert closed_form <= value <= closed_form * (1.0 + 1e-12)


def test_laplace_scalar_output(replace_ctx: PublicContext, table: LoadedTable) -> None:
    """A real-valued sum (Δ = 100): γ = 2^-4, M = ⌊1600 + 1/64⌋ + 1 = 1601, t = 3202 units = 200.125."""
    release = LAPLACE.run(laplace(SUM, 0.5), replace_ctx, table.columns, Noise.seeded(12345))
    noise = release.output["noise"]
    assert set(release.output) == {"value", "noise", "interval"}
    assert noise == {
        "distribution": "discrete_laplace",
        "scale": 200.125,
        "scale_units": 3202.0,
        "granularity": 0.0625,
        "grid_exponent": -4,
    }
    assert noise["scale"] >= 100.0 / 0.5
    expected = (120.0 / 0.0625 + int(Noise.seeded(12345).discrete_laplace(Fraction(3202), 1)[0])) * 0.0625
    assert release.output["value"] == expected
    assert isinstance(release.output["value"], float)
    assert (release.output["value"] / 0.0625).is_integer()


def test_laplace_histogram_output(add_remove_ctx: PublicContext, table: LoadedTable) -> None:
    release = LAPLACE.run(laplace(HISTOGRAM, 2.0), add_remove_ctx, table.columns, Noise.seeded(7))
    values = release.output["values"]
    assert list(values) == ["a", "b", "c"]
    assert all(isinstance(v, float) and v.is_integer() for v in values.values())
    draws = Noise.seeded(7).discrete_laplace(Fraction(1, 2), 3)
    assert list(values.values()) == (np.array([2, 2, 1]) + draws).astype(float).tolist()
    assert release.output["noise"]["scale"] == 0.5
    assert release.output["noise"]["granularity"] == 1.0


def test_gaussian_outputs(replace_ctx: PublicContext, table: LoadedTable) -> None:
    scalar = GAUSSIAN.run(gaussian(COUNT, 3.0), replace_ctx, table.columns, Noise.seeded(1))
    assert scalar.output["noise"] == {
        "distribution": "discrete_gaussian",
        "sigma": 3.0,
        "sigma_units": 3.0,
        "variance_units": 9.0,
        "granularity": 1.0,
        "grid_exponent": 0,
    }
    expected = 5.0 + float(Noise.seeded(1).discrete_gaussian(Fraction(9), 1)[0])
    assert scalar.output["value"] == expected
    hist = GAUSSIAN.run(
        gaussian({"kind": "histogram", "column": "n"}, 3.0), replace_ctx, table.columns, Noise.seeded(1)
    )
    assert list(hist.output["values"]) == [str(i) for i in range(11)]
    assert all(v.is_integer() for v in hist.output["values"].values())
    mean_params = gaussian({"kind": "mean", "column": "age"}, 2.0)
    mean = GAUSSIAN.run(mean_params, replace_ctx, table.columns, Noise.seeded(2))
    gamma = mean.output["noise"]["granularity"]
    assert gamma == 2.0**-6
    assert (mean.output["value"] / gamma).is_integer()
    assert mean.output["noise"]["variance_units"] >= (2.0 / gamma) ** 2


def test_same_seed_same_release(replace_ctx: PublicContext, table: LoadedTable) -> None:
    runs = [LAPLACE.run(laplace(COUNT), replace_ctx, table.columns, Noise.seeded(3)) for _ in range(2)]
    assert runs[0].output == runs[1].output
    others = {
        LAPLACE.run(laplace(COUNT), replace_ctx, table.columns, Noise.seeded(s)).output["value"]
        for s in range(4, 14)
    }
    assert len(others) > 1


# ----- the grid: integer answers from the public schema, rounding penalty, range ------------------------
def test_integer_valued_queries_come_from_the_schema(make_ctx: Any) -> None:
    ctx = make_ctx("replace_one")
    integer = [COUNT, HISTOGRAM, {"kind": "histogram", "column": "n"}, {"kind": "sum", "column": "n"}]
    real = [SUM, {"kind": "mean", "column": "age"}, {"kind": "mean", "column": "n"}]
    for query in integer:
        params = laplace(query)
        assert is_integer_valued(params.query, ctx)
        plan = plan_grid(params.query, ctx, 0.0)
        assert plan.grid == Grid(0)
        assert plan.exact
    for query in real:
        params = laplace(query)
        assert not is_integer_valued(params.query, ctx)
        assert not plan_grid(params.query, ctx, 0.0).exact


def test_grid_sensitivity_and_scale(make_ctx: Any) -> None:
    ctx = make_ctx("add_remove")
    int_sum = plan_grid(SumQuery(kind="sum", column="n"), ctx, 0.0)
    assert (int_sum.grid, int_sum.unit_shifts) == (Grid(0), (10,))  # max(|0|, |10|), no rounding
    replace = make_ctx("replace_one")
    mean = plan_grid(MeanQuery(kind="mean", column="age"), replace, 0.0)
    assert mean.grid == Grid(-6)  # largest 2^k ≤ 20/1024
    assert mean.unit_shifts == (1281,)
    # a tiny ε coarsens the grid instead of drawing noise beyond 2^40 units
    tiny = LAPLACE.worst_case(laplace(SUM, 1e-9), ctx)
    assert tiny.pure == 1e-9
    with pytest.raises(ParamsError, match="epsilon"):
        LAPLACE.check(laplace(COUNT, 1e-13), ctx)
    with pytest.raises(ParamsError, match="epsilon"):
        LAPLACE.worst_case(laplace(COUNT, 5e-324), ctx)
    count = plan_grid(CountQuery(kind="count"), replace, 0.0)
    assert count.unit_shifts == (1,)
    assert dyadic_scale_up(Fraction(1) / Fraction(0.1)) >= 10


def test_release_scale_never_below_the_continuous_one(make_ctx: Any, table: LoadedTable) -> None:
    """Every release is a multiple of its γ, and its noise scale is ≥ the continuous Δ₁/ε."""
    for neighboring in ("replace_one", "add_remove"):
        ctx = make_ctx(neighboring)
        for query in QUERIES:
            for eps in (0.01, 0.3, 2.0):
                params = laplace(query, eps)
                release = LAPLACE.run(params, ctx, table.columns, Noise.seeded(5))
                noise = release.output["noise"]
                assert Fraction(noise["scale"]) >= Fraction(l1(shifts(params.query, ctx))) / Fraction(eps)
                output = release.output
                values = [output["value"]] if "value" in output else list(output["values"].values())
                assert all((v / noise["granularity"]).is_integer() for v in values)


# ----- affordable cost ---------------------------------------------------------------------------------
@pytest.mark.parametrize("query", QUERIES)
def test_best_affordable_epsilon(ctx: PublicContext, query: dict[str, Any]) -> None:
    def admissible(curve: RdpCurve) -> bool:
        return curve.pure <= 0.35

    best = best_affordable_cost(LAPLACE, laplace(query, 5.0), ctx, admissible)
    assert best is not None
    assert admissible(LAPLACE.worst_case(laplace(query, best), ctx))
    assert not admissible(LAPLACE.worst_case(laplace(query, best * 1.01), ctx))


@pytest.mark.parametrize("query", QUERIES)
def test_best_affordable_sigma(ctx: PublicContext, query: dict[str, Any]) -> None:
    def admissible(curve: RdpCurve) -> bool:
        return curve.at(2.0) <= 0.25

    best = best_affordable_cost(GAUSSIAN, gaussian(query, 0.1), ctx, admissible)
    assert best is not None
    assert admissible(GAUSSIAN.worst_case(gaussian(query, best), ctx))
    assert not admissible(GAUSSIAN.worst_case(gaussian(query, best / 1.01), ctx))


def test_best_affordable_sigma_is_closed_form(replace_ctx: PublicContext) -> None:
    best = best_affordable_cost(GAUSSIAN, gaussian(HISTOGRAM), replace_ctx, lambda c: c.at(2.0) <= 0.25)
    assert best == pytest.approx(math.sqrt(2.0 * 2.0 / (2 * 0.25)), rel=1e-5)


def test_nothing_affordable_under_a_zero_budget(ctx: PublicContext) -> None:
    assert best_affordable_cost(LAPLACE, laplace(COUNT), ctx, lambda c: c.pure <= 0.0) is None
