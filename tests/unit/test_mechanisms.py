"""Laplace and Gaussian mechanisms: the seam, worst-case curves, releases and affordable costs."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError

from mechanisms.accounting import RdpCurve
from mechanisms.base import Mechanism, ParamsError, PublicContext, best_affordable_cost
from mechanisms.catalog import MECHANISMS
from mechanisms.gaussian import Gaussian, GaussianParams
from mechanisms.laplace import Laplace, LaplaceParams
from mechanisms.table import LoadedTable

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
def test_check_refuses_mean_under_add_remove(mechanism: Mechanism, add_remove_ctx: PublicContext) -> None:
    params = mechanism.params_model.model_validate(
        {"query": {"kind": "mean", "column": "age"}, mechanism.cost_parameter: 1.0}
    )
    with pytest.raises(ParamsError) as caught:
        mechanism.check(params, add_remove_ctx)
    assert caught.value.field == "query.kind"


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
    assert two_bins == RdpCurve.laplace((1.0, 1.0), 1.0, replace.orders)
    assert one_bin == RdpCurve.laplace((1.0,), 1.0, add_remove.orders)
    assert two_bins.pure == one_bin.pure == 1.0
    assert all(a < b for a, b in zip(two_bins.values, one_bin.values, strict=True))


def test_gaussian_worst_case_formula(make_ctx: Any) -> None:
    replace = make_ctx("replace_one")
    curve = GAUSSIAN.worst_case(gaussian(HISTOGRAM, 2.0), replace)
    assert math.isinf(curve.pure)
    for alpha, value in zip(curve.orders, curve.values, strict=True):
        assert value == pytest.approx(alpha * 2.0 / (2 * 4.0), rel=1e-12)
        assert value >= alpha * 2.0 / 8.0
    mean = GAUSSIAN.worst_case(gaussian({"kind": "mean", "column": "age"}, 4.0), replace)
    assert mean.at(2.0) == pytest.approx(2.0 * 20.0**2 / (2 * 16.0), rel=1e-12)


def _dp_accounting_rdp(event_name: str, noise_multiplier: float, orders: tuple[float, ...]) -> list[float]:
    """RDP of one event per Google's dp-accounting (independent implementation, tests only)."""
    dp_accounting = pytest.importorskip("dp_accounting")
    accountant = dp_accounting.rdp.RdpAccountant(list(orders))
    accountant.compose(getattr(dp_accounting, event_name)(noise_multiplier))
    return [float(v) for v in accountant._rdp]


def test_gaussian_matches_dp_accounting(make_ctx: Any) -> None:
    ctx = make_ctx("add_remove")
    curve = GAUSSIAN.worst_case(gaussian(SUM, 300.0), ctx)  # Δ₂ = 100: noise multiplier 3
    expected = _dp_accounting_rdp("GaussianDpEvent", 3.0, ctx.orders)
    assert list(curve.values) == pytest.approx(expected, rel=1e-12)
    assert all(ours >= theirs for ours, theirs in zip(curve.values, expected, strict=True))


def test_laplace_matches_dp_accounting(make_ctx: Any) -> None:
    ctx = make_ctx("add_remove")
    curve = LAPLACE.worst_case(laplace(COUNT, 0.5), ctx)  # Δ₁ = 1, scale 2: noise multiplier 2
    expected = _dp_accounting_rdp("LaplaceDpEvent", 2.0, ctx.orders)
    assert list(curve.values) == pytest.approx(expected, rel=1e-9)


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
@pytest.mark.parametrize("query", QUERIES)
@pytest.mark.parametrize("mechanism", [LAPLACE, GAUSSIAN])
def test_realized_within_worst_case(
    mechanism: Mechanism, query: dict[str, Any], ctx: PublicContext, table: LoadedTable
) -> None:
    params = mechanism.params_model.model_validate({"query": query, mechanism.cost_parameter: 0.5})
    mechanism.check(params, ctx)
    release = mechanism.run(params, ctx, table.columns, np.random.default_rng(12345))
    assert release.realized <= mechanism.worst_case(params, ctx)


def test_laplace_scalar_output(replace_ctx: PublicContext, table: LoadedTable) -> None:
    release = LAPLACE.run(laplace(SUM, 0.5), replace_ctx, table.columns, np.random.default_rng(12345))
    noise = release.output["noise"]
    assert set(release.output) == {"value", "noise"}
    assert noise["distribution"] == "laplace"
    assert noise["scale"] >= 100.0 / 0.5
    assert noise["scale"] == pytest.approx(200.0, rel=1e-14)
    expected = 120.0 + np.random.default_rng(12345).laplace(0.0, noise["scale"], size=1)[0]
    assert release.output["value"] == pytest.approx(expected, rel=1e-12)
    assert isinstance(release.output["value"], float)


def test_laplace_histogram_output(add_remove_ctx: PublicContext, table: LoadedTable) -> None:
    release = LAPLACE.run(laplace(HISTOGRAM, 2.0), add_remove_ctx, table.columns, np.random.default_rng(7))
    values = release.output["values"]
    assert list(values) == ["a", "b", "c"]
    assert all(isinstance(v, float) for v in values.values())
    noise = np.random.default_rng(7).laplace(0.0, release.output["noise"]["scale"], size=3)
    assert list(values.values()) == pytest.approx((np.array([2.0, 2.0, 1.0]) + noise).tolist())
    assert release.output["noise"]["scale"] == pytest.approx(0.5, rel=1e-14)


def test_gaussian_outputs(replace_ctx: PublicContext, table: LoadedTable) -> None:
    scalar = GAUSSIAN.run(gaussian(COUNT, 3.0), replace_ctx, table.columns, np.random.default_rng(1))
    assert scalar.output["noise"] == {"distribution": "gaussian", "sigma": 3.0}
    expected = 5.0 + np.random.default_rng(1).normal(0.0, 3.0, size=1)[0]
    assert scalar.output["value"] == pytest.approx(expected)
    hist = GAUSSIAN.run(
        gaussian({"kind": "histogram", "column": "n"}, 3.0),
        replace_ctx,
        table.columns,
        np.random.default_rng(1),
    )
    assert list(hist.output["values"]) == [str(i) for i in range(11)]


def test_same_seed_same_release(replace_ctx: PublicContext, table: LoadedTable) -> None:
    runs = [
        LAPLACE.run(laplace(COUNT), replace_ctx, table.columns, np.random.default_rng(3)) for _ in range(2)
    ]
    assert runs[0].output == runs[1].output
    other = LAPLACE.run(laplace(COUNT), replace_ctx, table.columns, np.random.default_rng(4))
    assert other.output != runs[0].output


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
