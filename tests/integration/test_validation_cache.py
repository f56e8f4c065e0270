"""The cheap path remembers validated parameters (``service.runs.requests._cached_validation``): a repeated
request is validated once, and parameters that differ only in ways a careless key would merge (1 vs 1.0;
NaN, ∞ and null, which orjson would all write as null) are still validated, and refused, on their own."""

from __future__ import annotations

import json
import math
from typing import Any

from service.runs import requests
from tests.conftest import LiveServer
from tests.integration.helpers import make_world


def test_a_repeated_request_is_validated_once_and_variants_are_validated_alone(
    live_server: LiveServer,
) -> None:
    world = make_world(live_server, budget={"epsilon": 10.0, "delta": 0.0})  # four releases of ε = 1
    url = f"/v1/datasets/{world.dataset_id}/requests"

    def post(params: Any) -> Any:
        return world.analyst.post(
            url,
            content=json.dumps({"mechanism": "laplace", "params": params}),
            headers={"content-type": "application/json"},
        )

    params = {"query": {"kind": "count"}, "epsilon": 1.0}
    answers = [post(params), post(params), post({"epsilon": 1.0, "query": {"kind": "count"}})]
    assert [a.status_code for a in answers] == [200, 200, 200], answers[-1].text
    key = (world.dataset_id, "laplace", json.dumps(params, sort_keys=True))
    remembered = requests._VALIDATED[key]
    assert post(params).status_code == 200
    assert requests._VALIDATED[key] is remembered  # a hit, in either key order
    assert {a.json()["worst_case"]["pure"] for a in answers} == {1.0}

    for epsilon in (math.nan, math.inf, "1.0", None):  # a finite float: each one a 422, never a hit
        refused = post({"query": {"kind": "count"}, "epsilon": epsilon})
        assert refused.status_code == 422, (epsilon, refused.text)
        assert "params.epsilon" in refused.text, refused.text
    as_integer = {"query": {"kind": "count"}, "epsilon": 1}  # accepted as 1.0, validated under its own key
    assert post(as_integer).status_code == 200
    assert requests._VALIDATED[(world.dataset_id, "laplace", json.dumps(as_integer, sort_keys=True))] is not (
        remembered
    )
