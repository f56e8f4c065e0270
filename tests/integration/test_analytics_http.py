"""Quantiles, grouped measures and the SQL front over HTTP, on SQLite and PostgreSQL.

* ``quantile`` and ``measures.laplace`` / ``measures.gaussian`` through ``POST …/requests``: 200 with the
  release, the realized charge equals the worst case and is what the budget shows as spent; every declared
  cell of a group-by is released (public domain), none from the data.
* ``POST …/sql``: the statement is translated onto the same mechanisms and goes through the same filter
  (the charge appears in the budget); clauses that cannot be bounded are 422 problems naming the clause.
* Refusals: a request beyond the budget is a 409 naming the largest affordable value of the cost parameter,
  and that value is then admitted.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from expost_client import ExpostClient
from expost_client.errors import InvalidInputError
from service.auth import Role
from service.cli import app
from tests.conftest import LiveServer
from tests.integration.helpers import BIG, assert_problem, get_budget, make_world
from tests.integration.test_cli import output

QUANTILE = {"column": "age", "quantiles": [0.5], "epsilon": 0.5, "candidates": 256}
GROUPED = {
    "measures": [{"kind": "count"}, {"kind": "mean", "column": "income"}, {"kind": "std", "column": "age"}],
    "group_by": ["region"],
    "epsilon": 1.0,
}


def _spent_pure(world: Any) -> float:
    return float(get_budget(world.admin, world.dataset_id)["pure"]["spent"])


class TestMechanisms:
    def test_median_release_and_charge(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget=BIG)
        response = world.request(world.analyst, QUANTILE, mechanism="quantile")
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["state"] == "committed"
        median = body["release"]["values"]["0.5"]
        assert 18.0 <= median <= 90.0
        assert body["realized"] == body["worst_case"]
        assert body["realized"]["pure"] == 0.5
        assert _spent_pure(world) == pytest.approx(0.5, abs=1e-9)

    def test_grouped_measures_cover_the_declared_domain(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget=BIG)
        response = world.request(world.analyst, GROUPED, mechanism="measures.laplace")
        assert response.status_code == 200, response.text
        groups = response.json()["release"]["groups"]
        assert [g["key"]["region"] for g in groups] == ["north", "south", "east", "west"]
        for group in groups:
            assert set(group) == {"key", "count", "mean(income)", "std(age)", "interval"}
            assert 0.0 <= group["mean(income)"] <= 100000.0
        assert response.json()["realized"]["pure"] == 1.0

    def test_gaussian_measures(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget={"epsilon": 10.0, "delta": 1e-5})
        params = {
            "measures": [{"kind": "mean", "column": "age"}, {"kind": "variance", "column": "age"}],
            "noise_multiplier": 4.0,
        }
        response = world.request(world.analyst, params, mechanism="measures.gaussian")
        assert response.status_code == 200, response.text
        body = response.json()
        assert set(body["release"]["values"]) == {"mean(age)", "variance(age)"}
        orders = body["worst_case"]["orders"]
        values = body["worst_case"]["values"]
        for alpha, value in zip(orders, values, strict=True):  # two blocks, α/(2z²) each
            assert value == pytest.approx(2 * alpha / (2 * 16.0), rel=1e-9)

    def test_unknown_group_column_is_422(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget=BIG)
        params = {**GROUPED, "group_by": ["age"]}
        problem = assert_problem(world.request(world.analyst, params, mechanism="measures.laplace"), 422)
        assert "group_by" in problem["errors"][0]["field"]


class TestRefusal:
    @pytest.mark.parametrize(("mechanism", "params"), [("quantile", QUANTILE), ("measures.laplace", GROUPED)])
    def test_refusal_names_an_affordable_epsilon(
        self, live_server: LiveServer, mechanism: str, params: dict[str, Any]
    ) -> None:
        world = make_world(live_server, budget={"epsilon": 0.3, "delta": 0.0})
        refused = world.request(world.analyst, {**params, "epsilon": 0.5}, mechanism=mechanism)
        problem = assert_problem(refused, 409)
        affordable = problem["affordable"]
        assert affordable["parameter"] == "epsilon"
        assert 0.29 < affordable["value"] <= 0.3
        admitted = world.request(
            world.analyst, {**params, "epsilon": affordable["value"]}, mechanism=mechanism
        )
        assert admitted.status_code == 200, admitted.text

    def test_gaussian_refusal_names_an_affordable_noise_multiplier(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget={"epsilon": 1.0, "delta": 1e-6})
        params = {"measures": [{"kind": "count"}], "group_by": ["region"], "noise_multiplier": 0.5}
        problem = assert_problem(world.request(world.analyst, params, mechanism="measures.gaussian"), 409)
        affordable = problem["affordable"]
        assert affordable["parameter"] == "noise_multiplier"
        assert affordable["value"] > 0.5
        admitted = world.request(
            world.analyst, {**params, "noise_multiplier": affordable["value"]}, mechanism="measures.gaussian"
        )
        assert admitted.status_code == 200, admitted.text


class TestSql:
    def sql(self, world: Any, statement: str, **extra: Any) -> Any:
        body = {"sql": statement, **extra}
        return world.analyst.post(f"/v1/datasets/{world.dataset_id}/sql", json=body)

    def test_grouped_statement_goes_through_the_filter(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget={"epsilon": 2.0, "delta": 0.0})
        statement = (
            f"SELECT region, COUNT(*), AVG(income) FROM {world.dataset_id} "
            "WHERE age BETWEEN 20 AND 60 AND region IN ('north', 'south') GROUP BY region"
        )
        response = self.sql(world, statement, epsilon=1.5)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["mechanism"] == "measures.laplace"
        assert body["params"]["where"][0] == {"column": "age", "op": "ge", "value": 20}
        assert len(body["release"]["groups"]) == 4
        assert _spent_pure(world) == pytest.approx(1.5, abs=1e-9)
        again = self.sql(world, statement, epsilon=1.0)  # 1.5 + 1.0 > 2: the same filter refuses it
        assert_problem(again, 409)

    def test_having_order_by_and_limit_post_process_the_release(self, live_server: LiveServer) -> None:
        """Issue 35 item 9: free post-processing of the released cells; the stored release keeps them all."""
        world = make_world(live_server, budget=BIG)
        statement = (
            "SELECT region, COUNT(*) AS n, AVG(income) FROM dataset GROUP BY region "
            "HAVING n > -1000000 AND AVG(income) >= 0 ORDER BY n DESC, region LIMIT 3 OFFSET 1"
        )
        response = self.sql(world, statement, epsilon=5.0)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["columns"] == ["region", "n", "AVG(income)"]
        cells = {g["key"]["region"]: g for g in body["release"]["groups"]}
        assert len(cells) == 4  # the stored release keeps every cell
        ranked = sorted(cells.values(), key=lambda g: (-g["count"], g["key"]["region"]))
        expected = [
            {"region": g["key"]["region"], "n": g["count"], "AVG(income)": g["mean(income)"]} for g in ranked
        ][1:4]
        assert body["rows"] == expected
        stored = world.analyst.get(f"/v1/requests/{body['id']}").json()
        assert len(stored["release"]["groups"]) == 4
        few = self.sql(
            world, "SELECT region, COUNT(*) FROM dataset GROUP BY region HAVING COUNT(*) > 1e9", epsilon=1.0
        )
        assert few.status_code == 200, few.text
        assert few.json()["rows"] == []

    def test_median_statement(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget=BIG)
        response = self.sql(
            world,
            "SELECT MEDIAN(age), PERCENTILE_CONT(0.9) WITHIN GROUP (ORDER BY age) FROM dataset",
            epsilon=1.0,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["mechanism"] == "quantile"
        assert set(body["release"]["values"]) == {"0.5", "0.9"}

    @pytest.mark.parametrize(
        ("statement", "field"),
        [
            ("SELECT COUNT(*) FROM dataset WHERE age > 30 OR age < 20", "sql.where"),
            # HAVING / ORDER BY / LIMIT post-process the release, but only over what the statement selects
            ("SELECT COUNT(*) FROM dataset GROUP BY region HAVING SUM(age) > 3", "sql.having"),
            (
                "SELECT COUNT(*) FROM dataset GROUP BY region HAVING COUNT(*) > 3 OR COUNT(*) < 1",
                "sql.having",
            ),
            ("SELECT region, COUNT(*) FROM dataset GROUP BY region HAVING region > 3", "sql.having"),
            ("SELECT COUNT(*) FROM dataset ORDER BY age", "sql.order_by"),
            ("SELECT COUNT(*) FROM dataset ORDER BY 2", "sql.order_by"),
            ("SELECT COUNT(*) FROM dataset LIMIT -1", "sql.limit"),
            ("SELECT MEDIAN(age) FROM dataset LIMIT 1", "sql.select"),
            ("SELECT COUNT(*) FROM dataset JOIN other ON a = b", "sql.join"),
            ("SELECT MAX(age) FROM dataset", "sql.select"),
            ("SELECT SUM(age * 2) FROM dataset", "sql.select"),
            ("SELECT age FROM dataset", "sql.select"),
            ("SELECT COUNT(*) FROM elsewhere", "sql.from"),
            ("SELECT COUNT(*) FROM dataset WHERE age > (SELECT 1)", "sql.where"),
            ("SELECT MEDIAN(age) FROM dataset GROUP BY region", "sql.group_by"),
            ("DELETE FROM dataset", "sql.select"),
            ("SELECT COUNT(* FROM", "sql.syntax"),
            ("SELECT COUNT(*) FROM dataset; DROP TABLE x", "sql.syntax"),
            ("SELECT COUNT(*) FROM dataset WHERE NOT age > 30", "sql.where"),
            ("WITH t AS (SELECT 1) SELECT COUNT(*) FROM t", "sql.with"),
            ("SELECT COUNT(age) FROM dataset", "sql.select"),
            # parsed by sqlglot but never silently dropped (the statement would mean something else)
            ("SELECT COUNT(*) FROM dataset GROUP BY region WITH ROLLUP", "sql.group_by"),
            ("SELECT COUNT(*) FROM dataset GROUP BY ALL", "sql.group_by"),
            ("SELECT COUNT(*) FROM dataset TABLESAMPLE (10 PERCENT)", "sql.from"),
            ("SELECT COUNT(*) INTO t2 FROM dataset", "sql.into"),
            ("SELECT SUM(age) FROM dataset WHERE age BETWEEN SYMMETRIC 50 AND 20", "sql.where"),
            ("SELECT QUANTILE(age, 'half') FROM dataset", "sql.select"),
        ],
    )
    def test_unboundable_clause_is_422_naming_it(
        self, live_server: LiveServer, statement: str, field: str
    ) -> None:
        world = make_world(live_server, budget=BIG)
        problem = assert_problem(self.sql(world, statement, epsilon=1.0), 422)
        assert problem["errors"][0]["field"] == field, problem
        assert _spent_pure(world) == 0.0  # nothing is charged for a refused statement
        assert self.sql(world, "SELECT COUNT(*) FROM dataset", epsilon=1.0).status_code == 200

    def test_unknown_column_names_the_params_field(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget=BIG)
        problem = assert_problem(self.sql(world, "SELECT AVG(height) FROM dataset", epsilon=1.0), 422)
        assert "height" in problem["detail"]

    def test_translate_charges_nothing(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget=BIG)
        response = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sql:translate",
            json={"sql": "SELECT STDDEV(age) FROM dataset", "noise": "gaussian", "noise_multiplier": 3.0},
        )
        assert response.status_code == 200, response.text
        assert response.json()["mechanism"] == "measures.gaussian"
        listed = world.analyst.get("/v1/requests", params={"dataset_id": world.dataset_id})
        assert listed.json()["items"] == []


class TestClientAndCli:
    def test_client_sql_and_cli_sql(self, live_server: LiveServer) -> None:
        world = make_world(live_server, budget=BIG)
        name, key = live_server.create_key(Role.analyst)
        granted = world.admin.post(f"/v1/datasets/{world.dataset_id}/grants", json={"analyst": name})
        assert granted.status_code == 201, granted.text
        with ExpostClient(live_server.base_url, key) as client:
            request = client.sql(
                world.dataset_id,
                "SELECT region, COUNT(*), AVG(age) FROM dataset GROUP BY region",
                epsilon=0.5,
            )
            assert request.mechanism == "measures.laplace"
            assert request.release is not None
            assert len(request.release["groups"]) == 4
            with pytest.raises(InvalidInputError) as refused:
                client.sql(world.dataset_id, "SELECT COUNT(*) FROM dataset LIMIT -1", epsilon=0.5)
            assert "sql.limit" in str(refused.value)
        env = {"EXPOST_URL": live_server.base_url, "EXPOST_KEY": key}
        result = CliRunner().invoke(
            app,
            ["sql", world.dataset_id, "SELECT MEDIAN(age) FROM dataset", "--epsilon", "0.5", "--json"],
            env=env,
        )
        assert result.exit_code == 0, result.output
        body = json.loads(output(result))  # without the in-process server's log lines
        assert body["mechanism"] == "quantile"
        assert set(body["release"]["values"]) == {"0.5"}
        table = CliRunner().invoke(
            app, ["sql", world.dataset_id, "SELECT COUNT(*) FROM dataset", "--epsilon", "0.1"], env=env
        )
        assert table.exit_code == 0, table.output
        assert "measures.laplace" in table.stdout
