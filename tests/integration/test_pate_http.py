"""``pate.labels`` over real HTTP on SQLite and PostgreSQL: the catalog, a release through the δ-ledger,
⊥ charged the same, bad input as 422 naming the field, unit datasets (docs/mechanisms/pate.md)."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np

from mechanisms.accounting.approximate import DELTA_UNITS, delta_units_up
from tests.conftest import LiveServer
from tests.integration.helpers import assert_problem, get_budget, ledger_items, make_world

SCHEMA: dict[str, Any] = {
    "columns": [
        {"name": "a", "type": "float", "min": -2, "max": 2},
        {"name": "b", "type": "float", "min": -2, "max": 2},
        {"name": "c", "type": "categorical", "values": ["r", "g", "b"]},
    ],
    "neighboring": "add_remove",
}
CENTERS = [(0.5, 0.0), (-0.5, 0.3), (0.0, -0.6)]
BUDGET = {"epsilon": 100.0, "delta": 1e-5, "delta_share": 5e-6}


def clusters_csv(n: int = 3000, shuffled_labels: bool = False) -> bytes:
    rng = np.random.default_rng(5)
    y = rng.integers(0, 3, n)
    x = np.asarray(CENTERS)[y] + 0.2 * rng.standard_normal((n, 2))
    shown = rng.integers(0, 3, n) if shuffled_labels else y
    rows = [f"{a:.6f},{b:.6f},{'rgb'[c]}" for (a, b), c in zip(x, shown, strict=True)]
    return ("a,b,c\n" + "\n".join(rows) + "\n").encode()


def pate(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "features": {"features": ["a", "b"], "label": "c"},
        "labels": ["r", "g", "b"],
        "teachers": 100,
        "queries": [list(c) for c in CENTERS],
        "sigma": 4.0,
        "epsilon": 3.0,
        "delta": 1e-6,
    }
    return {**base, **overrides}


def test_the_catalog_lists_it(live_server: LiveServer) -> None:
    world = make_world(live_server, BUDGET, SCHEMA, clusters_csv())
    listed = world.analyst.get("/v1/mechanisms")
    assert listed.status_code == 200, listed.text
    body = listed.json()
    entries = body if isinstance(body, list) else body.get("mechanisms", body.get("items", []))
    names = {e["name"] for e in entries}
    assert "pate.labels" in names


def test_a_release_is_charged_on_the_delta_ledger(live_server: LiveServer) -> None:
    world = make_world(live_server, BUDGET, SCHEMA, clusters_csv())
    response = world.request(world.analyst, pate(), "pate.labels")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["release"]["released"] is True
    assert body["release"]["labels"] == ["r", "g", "b"]
    assert 3.0 <= body["realized"]["pure"] <= 3.0 * (1 + 1e-12)
    budget = get_budget(world.admin, world.dataset_id)
    assert budget["delta_spent"] == float(Fraction(delta_units_up(1e-6), DELTA_UNITS))
    commits = [e for e in ledger_items(world.admin, world.dataset_id) if e["event"] == "commit"]
    assert [e.get("delta") for e in commits] == [delta_units_up(1e-6)]


def test_bottom_costs_the_same(live_server: LiveServer) -> None:
    world = make_world(live_server, BUDGET, SCHEMA, clusters_csv(shuffled_labels=True))
    response = world.request(world.analyst, pate(sigma=1.0), "pate.labels")
    assert response.status_code == 200, response.text
    assert response.json()["release"] == {"released": False, "labels": None, "teachers": 100, "queries": 3}
    assert get_budget(world.admin, world.dataset_id)["delta_spent"] == float(
        Fraction(delta_units_up(1e-6), DELTA_UNITS)
    )


def test_bad_input_names_the_field(live_server: LiveServer) -> None:
    world = make_world(live_server, BUDGET, SCHEMA, clusters_csv(300))
    cases = [
        (pate(labels=["r", "purple"]), "params.labels[1]"),
        (pate(queries=[[0.1]]), "params.queries[0]"),
        (pate(queries=[[0.1, "x"]]), "params.queries[0][1]"),
        (pate(teachers=1), "params.teachers"),
        (pate(sigma=-1.0), "params.sigma"),
        (pate(epsilon=0.01), "params.epsilon"),
        (pate(features={"features": ["a", "nope"], "label": "c"}), "params.features.features[1]"),
        (pate(teacher={"model": "forest"}), "params.teacher.model"),
    ]
    for params, field in cases:
        body = assert_problem(world.request(world.analyst, params, "pate.labels"), 422)
        assert any(e["field"].startswith(field) for e in body["errors"]), (field, body)
    assert get_budget(world.admin, world.dataset_id)["delta_spent"] == 0.0


def test_a_unit_dataset_deals_whole_units(live_server: LiveServer) -> None:
    schema = {
        **SCHEMA,
        "columns": [*SCHEMA["columns"], {"name": "user", "type": "int", "min": 0, "max": 10**6}],
        "privacy_unit": {"column": "user", "max_rows": 2},
    }
    lines = clusters_csv().decode().splitlines()
    csv = ("a,b,c,user\n" + "\n".join(f"{row},{i // 5}" for i, row in enumerate(lines[1:])) + "\n").encode()
    world = make_world(live_server, BUDGET, schema, csv)
    catalog = world.analyst.get("/v1/mechanisms").json()
    entries = catalog if isinstance(catalog, list) else catalog.get("mechanisms", catalog.get("items", []))
    assert next(e for e in entries if e["name"] == "pate.labels")["privacy_units"] is True
    response = world.request(world.analyst, pate(), "pate.labels")
    assert response.status_code == 200, response.text
    assert response.json()["release"]["labels"] == ["r", "g", "b"]
    assert get_budget(world.admin, world.dataset_id)["delta_spent"] == float(
        Fraction(delta_units_up(1e-6), DELTA_UNITS)
    )
