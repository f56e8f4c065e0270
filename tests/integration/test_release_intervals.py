"""Confidence intervals next to every query release over HTTP: published, free, from public parameters."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from mechanisms.queries.intervals import discrete_gaussian_quantile, discrete_laplace_quantile
from tests.conftest import LiveServer
from tests.integration.helpers import assert_problem, get_budget, make_world

RDP_BUDGET = {"epsilon": 50.0, "delta": 1e-5}


def _check(release: dict[str, Any], level: float) -> None:
    interval = release["interval"]
    assert set(interval) == {"level", "half_width", "lower", "upper"}
    assert interval["level"] == level
    h = interval["half_width"]
    if "values" in release:
        assert list(interval["lower"]) == list(release["values"]) == list(interval["upper"])
        for label, value in release["values"].items():
            assert (interval["lower"][label], interval["upper"][label]) == (value - h, value + h)
    else:
        assert (interval["lower"], interval["upper"]) == (release["value"] - h, release["value"] + h)


class TestReleaseIntervals:
    @pytest.mark.parametrize("confidence", [None, 0.99])
    def test_laplace_count_carries_the_exact_quantile(
        self, live_server: LiveServer, confidence: float | None
    ) -> None:
        world = make_world(live_server, RDP_BUDGET)
        params: dict[str, Any] = {"query": {"kind": "count"}, "epsilon": 0.5}
        if confidence is not None:
            params["confidence"] = confidence
        response = world.request(world.analyst, params)
        assert response.status_code == 200, response.text
        body = response.json()
        level = 0.95 if confidence is None else confidence
        _check(body["release"], level)
        # count on γ = 1, Δ = 1: t = 2 grid units; the half-width is the exact quantile, in answer units
        expected = discrete_laplace_quantile(Fraction(2), level).units
        assert body["release"]["interval"]["half_width"] == expected
        assert body["realized"]["pure"] == 0.5  # the interval costs nothing
        stored = world.analyst.get(f"/v1/requests/{body['id']}").json()
        assert stored["release"]["interval"] == body["release"]["interval"]

    def test_the_level_does_not_change_the_charge(self, live_server: LiveServer) -> None:
        world = make_world(live_server, RDP_BUDGET)
        spent = []
        for level in (0.5, 0.999):
            params = {"query": {"kind": "count"}, "epsilon": 0.25, "confidence": level}
            response = world.request(world.analyst, params)
            assert response.status_code == 200, response.text
            spent.append(response.json()["realized"])
        assert spent[0] == spent[1]
        assert get_budget(world.viewer, world.dataset_id)["pure"]["spent"] == pytest.approx(0.5)

    def test_gaussian_histogram_and_mean(self, live_server: LiveServer) -> None:
        world = make_world(live_server, RDP_BUDGET)
        hist = world.request(
            world.analyst,
            {"query": {"kind": "histogram", "column": "region"}, "sigma": 3.0, "confidence": 0.9},
            mechanism="gaussian",
        )
        assert hist.status_code == 200, hist.text
        release = hist.json()["release"]
        _check(release, 0.9)
        assert set(release["interval"]["lower"]) == {"north", "south", "east", "west"}
        assert release["interval"]["half_width"] == discrete_gaussian_quantile(Fraction(9), 0.9).units
        mean = world.request(
            world.analyst, {"query": {"kind": "mean", "column": "age"}, "sigma": 0.5}, mechanism="gaussian"
        )
        assert mean.status_code == 200, mean.text
        release = mean.json()["release"]
        _check(release, 0.95)
        gamma = release["noise"]["granularity"]
        steps = discrete_gaussian_quantile(Fraction(release["noise"]["variance_units"]), 0.95).units + 1
        assert release["interval"]["half_width"] == steps * gamma  # a real answer: one grid step for rounding

    @pytest.mark.parametrize("confidence", [0, 1, 1.5, -0.1, "0.9", None])
    def test_bad_levels_are_refused_before_anything_is_charged(
        self, live_server: LiveServer, confidence: object
    ) -> None:
        world = make_world(live_server, RDP_BUDGET)
        response = world.request(
            world.analyst, {"query": {"kind": "count"}, "epsilon": 0.5, "confidence": confidence}
        )
        assert_problem(response, 422)
        assert get_budget(world.viewer, world.dataset_id)["pure"]["spent"] == 0.0
