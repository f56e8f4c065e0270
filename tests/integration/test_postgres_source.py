"""Snapshots of PostgreSQL tables and queries (ADBC, one READ ONLY REPEATABLE READ transaction) on the real
server: the same snapshot, byte for byte, as the equivalent CSV upload; identifiers validated and quoted; the
DSN (and its password) in no error message.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest
from sqlalchemy.engine import make_url

from mechanisms.data.schema import DatasetSchema
from service.data import ingest
from service.data.errors import SourceError
from service.data.ingest import Ingested, csv_to_parquet, postgres_to_snapshot
from tests.conftest import fresh_postgres_database

pytestmark = pytest.mark.postgres

PASSWORD = "pw-Secret-98765"


def make_schema(*columns: dict[str, Any]) -> DatasetSchema:
    return DatasetSchema.model_validate({"columns": list(columns), "neighboring": "add_remove"})


SCHEMA = make_schema(
    {"name": "age", "type": "float", "min": 0, "max": 100},
    {"name": "n", "type": "int", "min": -5, "max": 10},
    {"name": "group", "type": "categorical", "values": ["a", "b", "c d"]},  # a reserved word in SQL
)
AGES = [20.5, 150.0, -3.0, 0.1, 1e-300, 99.99999999999999, 0.30000000000000004]
NS = [1, 12, -7, 3, 0, 10, 4]
GROUPS = ["a", "c d", "b", "a", "b", "a", "c d"]


@pytest.fixture(scope="module")
def dsn() -> Iterator[str]:
    """A fresh database with the test tables; its libpq URI (a skip without PostgreSQL, a failure in CI)."""
    fresh = fresh_postgres_database()
    uri = make_url(fresh.url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(uri, autocommit=True) as connection:
        connection.execute('CREATE TABLE people (id serial, age float8, n int4, "group" text)')
        with connection.cursor() as cursor:
            cursor.executemany(
                'INSERT INTO people (age, n, "group") VALUES (%s, %s, %s)',
                list(zip(AGES, NS, GROUPS, strict=True)),
            )
        connection.execute(
            "CREATE TABLE big AS SELECT i AS id, (i % 997) / 7.0::float8 AS age, (i % 23 - 8)::int8 AS n, "
            "(ARRAY['a', 'b', 'c d'])[i % 3 + 1] AS \"group\" FROM generate_series(1, 250000) AS i"
        )
        connection.execute('CREATE SCHEMA "Lake"')
        connection.execute(
            'CREATE TABLE "Lake"."Amounts" (amount numeric(12, 2), whole numeric, "group" varchar(5))'
        )
        connection.execute(
            """INSERT INTO "Lake"."Amounts" VALUES ('0.10', '3', 'a'), ('12345.67', '4.00', 'b'), """
            """('-1', '-0', 'a')"""
        )
        connection.execute('CREATE TABLE holes (age float8, n int4, "group" text)')
        connection.execute("INSERT INTO holes VALUES (1, 1, 'a'), (NULL, 2, 'b')")
    yield uri
    fresh.drop()


def snapshot_of_csv(text: str, schema: DatasetSchema, work: Path) -> Ingested:
    source = work / "equivalent.csv"
    source.write_text(text)
    return csv_to_parquet(source, schema, work)


def people_csv() -> str:
    return "age,n,group\n" + "".join(f"{a!r},{n},{g}\n" for a, n, g in zip(AGES, NS, GROUPS, strict=True))


def test_table_and_query_give_the_csv_snapshot(dsn: str, tmp_path: Path) -> None:
    expected = snapshot_of_csv(people_csv(), SCHEMA, tmp_path)
    table = postgres_to_snapshot(dsn, SCHEMA, tmp_path, table="people")
    query = postgres_to_snapshot(dsn, SCHEMA, tmp_path, query="SELECT * FROM people ORDER BY id -- why\n ;; ")
    qualified = postgres_to_snapshot(dsn, SCHEMA, tmp_path, table="public.people")
    assert table.sha256 == query.sha256 == qualified.sha256 == expected.sha256
    assert table.clipped == expected.clipped == {"age": 2, "n": 2, "group": 0}
    assert table.n_rows == len(AGES)


def test_a_large_table_streams_in_batches(dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "POSTGRES_BATCH_BYTES", 1 << 20)
    seen: list[int] = []
    result = postgres_to_snapshot(dsn, SCHEMA, tmp_path, table="big", progress=seen.append)
    assert result.n_rows == 250_000
    assert seen[-1] == 250_000
    assert len(seen) > 1
    with psycopg.connect(dsn) as connection, connection.cursor() as cursor:
        buffer = bytearray()
        with cursor.copy(
            'COPY (SELECT age, n, "group" FROM big) TO STDOUT WITH (FORMAT csv, HEADER)'
        ) as copy:
            for chunk in copy:
                buffer += chunk
    expected = snapshot_of_csv(buffer.decode(), SCHEMA, tmp_path)
    assert result.sha256 == expected.sha256
    assert pq.read_metadata(result.path).num_rows == 250_000


def test_numeric_columns_round_like_the_csv(dsn: str, tmp_path: Path) -> None:
    schema = make_schema(
        {"name": "amount", "type": "float", "min": 0, "max": 10000},
        {"name": "whole", "type": "int", "min": -10, "max": 10},
        {"name": "group", "type": "categorical", "values": ["a", "b"]},
    )
    result = postgres_to_snapshot(dsn, schema, tmp_path, table="Lake.Amounts")
    expected = snapshot_of_csv("amount,whole,group\n0.10,3,a\n12345.67,4.00,b\n-1,-0,a\n", schema, tmp_path)
    assert result.sha256 == expected.sha256
    assert result.clipped == {"amount": 2, "whole": 0, "group": 0}
    with pytest.raises(SourceError, match=r"column 'whole', row 1: 2.5 is not an integer"):
        postgres_to_snapshot(
            dsn, schema, tmp_path, query="SELECT 1.0 AS amount, 2.5::numeric AS whole, 'a' AS \"group\""
        )
    with pytest.raises(SourceError, match=r"column 'amount', row 1: nan is not a finite number"):
        postgres_to_snapshot(
            dsn, schema, tmp_path, query="SELECT 'NaN'::numeric AS amount, 1 AS whole, 'a' AS \"group\""
        )


def test_one_transaction_read_only_repeatable_read(dsn: str, tmp_path: Path) -> None:
    schema = make_schema(
        {"name": "iso", "type": "categorical", "values": ["repeatable read"]},
        {"name": "ro", "type": "categorical", "values": ["on"]},
    )
    iso, read_only = "current_setting('transaction_isolation')", "current_setting('transaction_read_only')"
    query = f"SELECT {iso} AS iso, {read_only} AS ro"
    assert postgres_to_snapshot(dsn, schema, tmp_path, query=query).n_rows == 1
    with pytest.raises(SourceError, match="read-only transaction"):
        postgres_to_snapshot(
            dsn,
            SCHEMA,
            tmp_path,
            query="SELECT nextval('people_id_seq')::float8 AS age, 1 AS n, 'a' AS \"group\"",
        )
    with pytest.raises(SourceError):
        postgres_to_snapshot(dsn, SCHEMA, tmp_path, query='DELETE FROM people RETURNING age, n, "group"')
    with psycopg.connect(dsn) as connection:
        assert connection.execute("SELECT count(*) FROM people").fetchone() == (len(AGES),)


@pytest.mark.parametrize(
    "table",
    [
        "people; DROP TABLE people",
        "a.b.c",
        '"people"',
        "",
        "1people",
        "people--",
        "people x",
        "public.",
        "pe\x00ople",
    ],
)
def test_bad_identifiers_are_refused(dsn: str, tmp_path: Path, table: str) -> None:
    with pytest.raises(SourceError) as caught:
        postgres_to_snapshot(dsn, SCHEMA, tmp_path, table=table)
    assert caught.value.field == "source"
    assert "`schema.name`" in caught.value.reason
    with psycopg.connect(dsn) as connection:
        assert connection.execute("SELECT count(*) FROM people").fetchone() == (len(AGES),)


def test_table_or_query_exactly_one(dsn: str, tmp_path: Path) -> None:
    for options in ({}, {"table": "people", "query": "SELECT 1"}):
        with pytest.raises(SourceError, match="exactly one"):
            postgres_to_snapshot(dsn, SCHEMA, tmp_path, **options)
    with pytest.raises(SourceError) as caught:
        postgres_to_snapshot(dsn, SCHEMA, tmp_path, query=" ; ")
    assert caught.value.field == "source"
    assert "empty" in caught.value.reason


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"table": "nothing_here"}, 'relation "nothing_here" does not exist'),
        ({"table": "People"}, 'relation "People" does not exist'),  # quoted: the case is kept
        ({"query": "SELECT age, n FROM people"}, 'column "group" does not exist'),
        ({"query": "SELEKT 1"}, "syntax error"),
        ({"table": "holes"}, "column 'age', row 2: null value"),
        ({"query": 'SELECT age, n::text AS n, "group" FROM people'}, "column 'n' has type string"),
        ({"query": 'SELECT age, n, 7 AS "group" FROM people'}, "column 'group' has type int32"),
        (
            {"query": "SELECT age, n, 'zz' AS \"group\" FROM people"},
            "column 'group', row 1: 'zz' is not a declared value",
        ),
    ],
)
def test_bad_sources(dsn: str, tmp_path: Path, options: dict[str, str], reason: str) -> None:
    with pytest.raises(SourceError) as caught:
        postgres_to_snapshot(dsn, SCHEMA, tmp_path, **options)
    assert caught.value.field == "source"
    assert reason in caught.value.reason
    assert not list(tmp_path.glob("snapshot-*")), "the partial snapshot is removed"


def bad_dsns(dsn: str) -> list[str]:
    url = make_url(dsn)
    host, port, user, database = url.host, url.port or 5432, url.username, url.database
    return [
        f"postgresql://{user}:{PASSWORD}@{host}:1/{database}",
        f"postgresql://{user}:{PASSWORD}@nohost.invalid:{port}/{database}",
        f"postgresql://{user}:{PASSWORD}@{host}:{port}/no_such_database_x",
        f"postgresql://no_such_role_x:{PASSWORD}@{host}:{port}/{database}",
        f"postgresql://{user}@{host}:1/{database}?password={PASSWORD}",
        f"host={host} port=notaport user={user} password={PASSWORD}",
        f"host={host} port=1 user={user} password='{PASSWORD} with spaces'",
        f"{PASSWORD}",  # not a DSN at all: libpq quotes it back
        f"postgresql://{user}:{PASSWORD}@{host}:{port}/{database}?sslmode=bogus",
    ]


def test_the_dsn_never_appears_in_errors(dsn: str, tmp_path: Path) -> None:
    for bad in bad_dsns(dsn):
        with pytest.raises(SourceError) as caught:
            postgres_to_snapshot(bad, SCHEMA, tmp_path, table="people")
        error = caught.value
        shown = "".join(traceback.format_exception(error))
        assert bad not in shown, shown
        assert PASSWORD not in shown, shown
        assert error.__context__ is None
        assert error.__cause__ is None
        assert error.reason.startswith("cannot connect to PostgreSQL: "), error.reason
    # trust authentication ignores the password: the connection works, the query fails
    with_password = make_url(dsn).set(password=PASSWORD).render_as_string(hide_password=False)
    with pytest.raises(SourceError) as caught:
        postgres_to_snapshot(with_password, SCHEMA, tmp_path, query="SELECT 1 AS x")
    assert PASSWORD in with_password
    assert with_password not in str(caught.value)
    assert "the PostgreSQL source cannot be read" in caught.value.reason
