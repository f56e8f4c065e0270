"""``pate.labels`` (docs/privacy/pate.md): the data-dependent bound against exact divergences, the distance's
sensitivity, the partition, validation and the charge."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from pydantic import ValidationError

from mechanisms.accounting.approximate import ApproximateCharge
from mechanisms.base import ParamsError, PublicContext
from mechanisms.catalog import MECHANISMS, WITH_UNITS
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise
from mechanisms.ptr.pate import PATE_LABELS, PateLabelsParams, pate_plan, teacher_of_rows, votes
from mechanisms.ptr.pate_analysis import (
    ORDERS,
    dependent_epsilon,
    distance_cap,
    envelope,
    independent_epsilon,
    instability_distance,
    theorem6_rdp,
    top_two_gaps,
)

ORDERS_ARRAY = np.asarray(ORDERS)


# ----- exact GNMax with discrete Gaussian noise (test oracle) -----------------------------------------------


def discrete_gaussian_pmf(sigma: float, width: int) -> tuple[np.ndarray, np.ndarray]:
    support = np.arange(-width, width + 1)
    log_w = -(support.astype(np.float64) ** 2) / (2 * sigma * sigma)
    pmf = np.exp(log_w - np.logaddexp.reduce(log_w))
    return support, pmf


def gnmax_distribution(counts: tuple[int, ...], sigma: float) -> np.ndarray:
    """P[arg-max_j n_j + Z_j = j] (ties to the smallest index), Z_j i.i.d. N_Z(0, σ²), exactly up to a
    truncation at ±(16σ + 16) (mass beyond < e^-128, far below every probability compared here)."""
    width = int(16 * sigma) + 16
    support, pmf = discrete_gaussian_pmf(sigma, width)
    cdf = np.cumsum(pmf)

    def below(value: np.ndarray, strict: bool) -> np.ndarray:  # P[Z < value] or P[Z ≤ value]
        index = np.searchsorted(support, value, side="left" if strict else "right") - 1
        return np.where(index >= 0, cdf[np.clip(index, 0, cdf.size - 1)], 0.0)

    out = np.zeros(len(counts))
    for j, n_j in enumerate(counts):
        level = n_j + support
        product = pmf.copy()
        for other, n_other in enumerate(counts):
            if other != j:
                product = product * below(level - n_other, strict=other < j)
        out[j] = product.sum()
    return out


def renyi(p: np.ndarray, q: np.ndarray, orders: np.ndarray) -> np.ndarray:
    keep = p > 0
    lp, lq = np.log(p[keep]), np.log(q[keep])
    a = orders[:, None]
    divergence: np.ndarray = np.logaddexp.reduce(a * lp - (a - 1) * lq, axis=1) / (orders - 1)
    return divergence


def neighbours(counts: tuple[int, ...], moves: int) -> set[tuple[int, ...]]:
    """Histograms reached by moving ≤ ``moves`` votes (one per changed teacher)."""
    frontier = {counts}
    for _ in range(moves):
        step = set()
        for c in frontier:
            for a, b in itertools.permutations(range(len(c)), 2):
                if c[a] > 0:
                    moved = list(c)
                    moved[a] -= 1
                    moved[b] += 1
                    step.add(tuple(moved))
        frontier |= step
    return frontier - {counts}


class TestTheorem6:
    @pytest.mark.parametrize(
        ("log_q", "sigma", "expected"),
        [  # the note's scratch port of tf-privacy (seed_000 §2.10 (4)), α = 42.9639
            (-101.375812, 20.0, 5.563665e-28),
            (-25.696812, 40.0, 7.044910e-09),
            (-3.860864, 100.0, 2.804470e-03),
            (-27.894037, 20.0, 8.570637e-05),
            (-8.497729, 40.0, 2.184850e-03),
        ],
    )
    def test_reproduces_the_reference_values(self, log_q: float, sigma: float, expected: float) -> None:
        value = float(theorem6_rdp(log_q, sigma, np.asarray([42.9639]))[0])
        assert value == pytest.approx(expected, rel=1e-5)

    def test_falls_back_to_the_data_independent_bound(self) -> None:
        value = theorem6_rdp(-1.540710, 100.0, np.asarray([42.9639]))
        assert float(value[0]) == pytest.approx(42.9639 / 100.0**2, rel=1e-12)
        assert np.all(theorem6_rdp(0.5, 3.0, ORDERS_ARRAY) == ORDERS_ARRAY / 9.0)

    def test_never_exceeds_the_data_independent_bound(self) -> None:
        for log_q in np.linspace(-400.0, -0.01, 60):
            for s in (0.5, 1.0, 4.0, 40.0):
                assert np.all(theorem6_rdp(float(log_q), s, ORDERS_ARRAY) <= ORDERS_ARRAY / s**2 * (1 + 1e-9))


class TestDataDependentBoundIsSound:
    """Lemma GNMAX-DD: for every neighbour Y of X (both directions), D_α(M(X)‖M(Y)) and D_α(M(Y)‖M(X))
    are ≤ the envelope at the effective gap (g − 2m)₊ — checked against exact discrete-Gaussian GNMax."""

    @pytest.mark.parametrize(
        ("sigma", "classes", "teachers", "m"),
        [(1.0, 2, 16, 1), (1.0, 3, 14, 1), (2.0, 3, 24, 1), (1.0, 3, 14, 2)],
    )
    def test_every_neighbour_both_directions(self, sigma: float, classes: int, teachers: int, m: int) -> None:
        table = envelope(teachers, sigma, m, classes)
        checked = 0
        for counts in itertools.product(range(teachers + 1), repeat=classes):
            if sum(counts) != teachers or list(counts) != sorted(counts, reverse=True):
                continue
            px = gnmax_distribution(counts, sigma)
            gap = int(top_two_gaps(np.asarray([counts]))[0])
            bound = table.at(np.asarray([max(gap - 2 * m, 0)]))[0]
            assert np.all(bound <= ORDERS_ARRAY * m * m / sigma**2 * (1 + 1e-9))
            for other in neighbours(counts, m):
                py = gnmax_distribution(other, sigma)
                forward, backward = renyi(px, py, ORDERS_ARRAY), renyi(py, px, ORDERS_ARRAY)
                assert np.all(forward <= bound + 1e-12), (counts, other)
                assert np.all(backward <= bound + 1e-12), (counts, other)
                checked += 1
        assert checked > 10

    def test_the_bound_is_informative_at_large_gaps(self) -> None:
        table = envelope(40, 1.0, 1, 3)
        small = table.at(np.asarray([30]))[0]
        assert small[ORDERS_ARRAY < 3].max() < 1e-20  # vs α/σ² ≥ 1.125 data-independent
        gaps = np.full(100, 34)
        assert dependent_epsilon(table, gaps, 2, 1e-5) < 0.25 * independent_epsilon(100, 1.0, 1, 1e-5)


class TestDistance:
    """Lemma PATE-DIST: |h(X) − h(Y)| ≤ 1 for neighbours, and h(X) = 0 iff F(X, 0) > ε_m."""

    @pytest.mark.parametrize("m", [1, 2])
    def test_sensitivity_one_and_the_bad_set(self, m: int) -> None:
        rng = np.random.default_rng(7)
        teachers, classes, queries, sigma, delta = 30, 3, 4, 1.5, 1e-4
        table = envelope(teachers, sigma, m, classes)
        cap = distance_cap(teachers, m)
        for budget in (0.5, 2.0, 6.0):
            for _ in range(150):
                counts = rng.multinomial(teachers, rng.dirichlet(np.full(classes, 0.3)), size=queries)
                other = counts.copy()
                for _changed in range(m):  # each changed teacher moves one vote on every query
                    for i in range(queries):
                        a = rng.choice(np.flatnonzero(other[i] > 0))
                        b = rng.choice([c for c in range(classes) if c != a])
                        other[i, a] -= 1
                        other[i, b] += 1
                h_x = instability_distance(table, top_two_gaps(counts), m, budget, delta, cap)
                h_y = instability_distance(table, top_two_gaps(other), m, budget, delta, cap)
                assert abs(h_x - h_y) <= 1
                bad = dependent_epsilon(table, top_two_gaps(counts), 2 * m, delta) > budget
                assert (h_x == 0) == bad


SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            {"name": "a", "type": "float", "min": -2, "max": 2},
            {"name": "b", "type": "float", "min": -2, "max": 2},
            {"name": "kind", "type": "categorical", "values": ["p", "q"]},
            {"name": "c", "type": "categorical", "values": ["r", "g", "b"]},
        ],
        "neighboring": "add_remove",
    }
)
CTX = PublicContext(SCHEMA, None, (2.0, 4.0, 8.0, 16.0))
CENTERS = np.asarray([[0.5, 0.0], [-0.5, 0.3], [0.0, -0.6]])


def synthetic(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = CENTERS[y] + 0.2 * rng.standard_normal((n, 2))
    return {"a": x[:, 0], "b": x[:, 1], "kind": rng.integers(0, 2, n), "c": y}


def params(**overrides: object) -> PateLabelsParams:
    base: dict[str, object] = {
        "features": {"features": ["a", "b", "kind"], "label": "c"},
        "labels": ["r", "g", "b"],
        "teachers": 100,
        "queries": [[0.5, 0.0, "p"], [-0.5, 0.3, "q"], [0.0, -0.6, "p"]],
        "sigma": 10.0,
        "epsilon": 2.0,
        "delta": 1e-5,
    }
    return PateLabelsParams.model_validate({**base, **overrides})


class TestPartition:
    def test_adding_a_row_changes_one_teacher(self) -> None:
        table = synthetic(500, 1)
        names = ["a", "b", "kind", "c"]
        before = teacher_of_rows([table[n] for n in names], 37)
        extra = synthetic(1, 2)
        at = 123
        grown = {n: np.insert(table[n], at, extra[n][0]) for n in names}
        after = teacher_of_rows([grown[n] for n in names], 37)
        assert np.array_equal(np.delete(after, at), before)  # every other row keeps its teacher

    def test_neighbours_histograms_differ_by_one_teacher(self) -> None:
        table = synthetic(2000, 3)
        p = params(teachers=50)
        full = votes(p, CTX, table)
        smaller = votes(p, CTX, {n: np.delete(c, 777) for n, c in table.items()})
        assert np.all(np.abs(full - smaller).sum(axis=1) <= 2)
        assert np.all(full.sum(axis=1) == 50)

    def test_removing_a_unit_changes_one_teacher(self) -> None:
        schema = DatasetSchema.model_validate(
            {
                **SCHEMA.model_dump(),
                "columns": [
                    *SCHEMA.model_dump()["columns"],
                    {"name": "user", "type": "int", "min": 0, "max": 999},
                ],
                "privacy_unit": {"column": "user", "max_rows": 3},
            }
        )
        ctx = PublicContext(schema, None, CTX.orders)
        table = synthetic(3000, 9)
        table["user"] = np.random.default_rng(10).integers(0, 300, 3000)  # ~10 rows per unit, up to ~25
        p = params(teachers=40)
        full = votes(p, ctx, table)
        for user in (0, 17, 299):
            keep = table["user"] != user
            without = votes(p, ctx, {n: c[keep] for n, c in table.items()})
            assert np.all(np.abs(full - without).sum(axis=1) <= 2)  # one teacher's vote moved at most
        assert len({int(h) for h in teacher_of_rows([table["user"][table["user"] == 17]], 40)}) == 1

    def test_the_partition_ignores_row_order(self) -> None:
        table = synthetic(3000, 4)
        order = np.random.default_rng(5).permutation(3000)
        for model in ("centroid", "ridge", "logistic"):
            p = params(teachers=8, teacher={"model": model, "lam": 0.5, "max_iterations": 10})
            shuffled = {n: c[order] for n, c in table.items()}
            assert np.array_equal(votes(p, CTX, table), votes(p, CTX, shuffled))


class TestValidation:
    @pytest.mark.parametrize(
        ("overrides", "field"),
        [
            ({"labels": ["r", "x"]}, "labels[1]"),
            ({"labels": ["r", "r"]}, "labels"),
            ({"queries": [[0.1, 0.2]]}, "queries[0]"),
            ({"queries": [[0.1, 0.2, "z"]]}, "queries[0][2]"),
            ({"queries": [["a", 0.2, "p"]]}, "queries[0][0]"),
            ({"features": {"features": ["a", "nope"], "label": "c"}}, "features.features[1]"),
            ({"features": {"features": ["a"], "label": "b"}}, "features.label"),
            ({"epsilon": 0.01}, "epsilon"),
        ],
    )
    def test_bad_input_names_the_field(self, overrides: dict[str, object], field: str) -> None:
        with pytest.raises(ParamsError) as caught:
            PATE_LABELS.check(params(**overrides), CTX)
        assert caught.value.field == field

    def test_the_model_rejects_out_of_range_values(self) -> None:
        cases: list[dict[str, object]] = [
            {"teachers": 1},
            {"sigma": 0.1},
            {"delta": 0.5},
            {"queries": []},
            {"teacher": {"model": "x"}},
        ]
        for bad in cases:
            with pytest.raises(ValidationError):
                params(**bad)

    def test_registered_with_unit_support(self) -> None:
        assert MECHANISMS["pate.labels"] is PATE_LABELS
        assert "pate.labels" in WITH_UNITS


class TestChargeAndRun:
    def test_the_charge_is_the_declared_pair_from_public_inputs(self) -> None:
        charge = PATE_LABELS.approximate_charge(params(), CTX)
        assert isinstance(charge, ApproximateCharge)
        assert 2.0 <= charge.curve.pure <= 2.0 * (1 + 1e-12)
        assert 1e-5 <= charge.delta <= 1e-5 * (1 + 1e-12)
        assert PATE_LABELS.worst_case(params(), CTX) == charge.curve

    def test_replace_one_doubles_the_sensitivity(self) -> None:
        assert pate_plan(params(), "add_remove").sensitivity == 1
        assert pate_plan(params(), "replace_one").sensitivity == 2

    def test_high_consensus_releases_the_teachers_labels(self) -> None:
        release = PATE_LABELS.run(params(), CTX, synthetic(4000, 6), Noise.seeded(11))
        assert release.output["released"] is True
        assert release.output["labels"] == ["r", "g", "b"]
        assert release.realized == PATE_LABELS.worst_case(params(), CTX)

    def test_no_consensus_gives_bottom(self) -> None:
        table = synthetic(4000, 7)
        table["c"] = np.random.default_rng(8).integers(0, 3, 4000)  # labels unrelated to the features
        release = PATE_LABELS.run(params(sigma=2.0), CTX, table, Noise.seeded(12))
        assert release.output == {"released": False, "labels": None, "teachers": 100, "queries": 3}

    def test_the_exact_tail_bound_used_for_q(self) -> None:
        """P[Z₁ − Z₂ ≥ t] ≤ exp(−t²/(4σ²)) for i.i.d. discrete Gaussians (the sub-Gaussian step)."""
        for sigma in (0.5, 1.0, 3.0):
            support, pmf = discrete_gaussian_pmf(sigma, int(40 * sigma) + 40)
            diff = np.convolve(pmf, pmf[::-1])
            values = np.arange(-2 * support[-1], 2 * support[-1] + 1)
            for t in range(1, int(8 * sigma) + 2):
                assert diff[values >= t].sum() <= math.exp(-(t**2) / (4 * sigma**2)) * (1 + 1e-9)
