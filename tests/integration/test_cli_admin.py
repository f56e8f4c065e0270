"""The ``expost`` admin commands of issue 35 item 10, on SQLite and PostgreSQL: ``grants list|revoke|add``
(remote, like ``grant``), ``keys list`` and ``keys revoke NAME_OR_PREFIX`` and ``datasets archive`` (on the
database, like ``keys create``), and the local commands run from a folder without a database: one line
naming where they looked, exit 2, nothing created.

Exit codes as tests/integration/test_cli.py: 0 ok, 2 for a 4xx or unusable input, 1 otherwise.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from expost_client import ExpostClient
from service.auth import Role, create_key
from service.store.models import ApiKey
from tests.conftest import POSTGRES_URL, LiveServer
from tests.integration.helpers import db_session, fresh_database
from tests.integration.test_cli import COUNT, EXPOST, Cli, make_cli, output, parsed


@pytest.fixture
def cli(live_server: LiveServer) -> Cli:
    return make_cli(live_server)


def local(
    database_url: str | None, cwd: Path, *args: str, data_dir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The installed ``expost`` in ``cwd`` with no EXPOST_ setting but the database (and data folder)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")}
    env.update(NO_COLOR="1", COLUMNS="200")  # rich tables one row a line
    if database_url is not None:
        env["EXPOST_DATABASE_URL"] = database_url
    if data_dir is not None:
        env["EXPOST_DATA_DIR"] = str(data_dir)
    return subprocess.run(
        [str(EXPOST), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


# ----- grants (over HTTP) ----------------------------------------------------------------------------------


class TestGrants:
    def test_list_revoke_and_add_again(self, cli: Cli) -> None:
        listed = parsed(cli.invoke("grants", "list", cli.dataset_id, "--json", key=cli.admin_key))
        assert listed == [cli.analyst_name]
        human = cli.invoke("grants", "list", cli.dataset_id, key=cli.admin_key)
        assert human.exit_code == 0, human.stderr
        assert output(human).splitlines() == [cli.analyst_name]
        assert f"1 analyst granted on {cli.dataset_id}" in human.stderr

        revoked = cli.invoke("grants", "revoke", cli.dataset_id, cli.analyst_name, key=cli.admin_key)
        assert revoked.exit_code == 0, revoked.stderr
        assert output(revoked).strip() == f"revoked: {cli.analyst_name} on {cli.dataset_id}"
        again = parsed(
            cli.invoke("grants", "revoke", cli.dataset_id, cli.analyst_name, "--json", key=cli.admin_key)
        )
        assert again == {"dataset_id": cli.dataset_id, "analyst": cli.analyst_name, "revoked": False}
        assert parsed(cli.invoke("grants", "list", cli.dataset_id, "--json", key=cli.admin_key)) == []

        refused = cli.invoke("request", "submit", cli.dataset_id, "--params", COUNT)  # as the analyst
        assert refused.exit_code == 2, (output(refused), refused.stderr)
        assert "(404)" in refused.stderr

        added = cli.invoke("grants", "add", cli.dataset_id, cli.analyst_name, key=cli.admin_key)
        assert added.exit_code == 0, added.stderr
        assert output(added).startswith("granted:")
        assert parsed(cli.invoke("grants", "list", cli.dataset_id, "--json", key=cli.admin_key)) == [
            cli.analyst_name
        ]
        submitted = parsed(cli.invoke("request", "submit", cli.dataset_id, "--params", COUNT, "--json"))
        assert submitted["state"] == "committed"

    def test_errors_are_one_line_with_exit_2(self, cli: Cli) -> None:
        forbidden = cli.invoke("grants", "list", cli.dataset_id)  # the analyst's key
        assert forbidden.exit_code == 2
        assert "(403)" in one_line(forbidden.stderr)
        missing = cli.invoke("grants", "revoke", "ds_nosuchdataset", cli.analyst_name, key=cli.admin_key)
        assert missing.exit_code == 2
        assert one_line(missing.stderr).startswith("error: Not found (404): ")
        assert output(missing) == ""
        bad_name = cli.invoke("grants", "revoke", cli.dataset_id, "bad name!", key=cli.admin_key)
        assert bad_name.exit_code == 2
        assert "(422)" in bad_name.stderr

    def test_the_installed_script(self, cli: Cli) -> None:
        listed = parsed(cli.run("grants", "list", cli.dataset_id, "--json", key=cli.admin_key))
        assert listed == [cli.analyst_name]
        revoked = cli.run("grants", "revoke", cli.dataset_id, cli.analyst_name, key=cli.admin_key)
        assert revoked.returncode == 0, revoked.stderr
        assert output(revoked).startswith("revoked: ")


# ----- keys and archive (on the database) ------------------------------------------------------------------


def keys_by_name(result: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in parsed(result)}


def test_keys_list_shows_revoked_keys_and_revoke_takes_a_prefix(cli: Cli, tmp_path: Path) -> None:
    url = cli.server.settings.database_url
    before = keys_by_name(local(url, tmp_path, "keys", "list", "--json"))
    analyst = before[cli.analyst_name]
    assert analyst["role"] == "analyst"
    assert analyst["revoked_at"] is None
    assert analyst["prefix"] == cli.analyst_key[:10]
    assert all("key" not in row and "key_hash" not in row for row in before.values())
    human = local(url, tmp_path, "keys", "list")
    assert human.returncode == 0, human.stderr
    row = next(line for line in human.stdout.splitlines() if cli.analyst_name in line)
    assert "analyst" in row
    assert row.rstrip(" │").endswith("–")  # not revoked

    revoked = local(url, tmp_path, "keys", "revoke", analyst["prefix"])
    assert revoked.returncode == 0, revoked.stderr
    assert f"revoked: {cli.analyst_name}" in revoked.stdout
    after = keys_by_name(local(url, tmp_path, "keys", "list", "--json"))
    assert after[cli.analyst_name]["revoked_at"] is not None
    assert all(after[name]["revoked_at"] is None for name in before if name != cli.analyst_name)
    human = local(url, tmp_path, "keys", "list")
    row = next(line for line in human.stdout.splitlines() if cli.analyst_name in line)
    assert after[cli.analyst_name]["revoked_at"][:10] in row.split("│")[-2]  # the revoked column
    with ExpostClient(cli.server.base_url, cli.admin_key) as admin:  # GET /v1/keys, typed
        listed = {key.name: key for key in admin.list_keys()}
    assert listed[cli.analyst_name].revoked_at is not None
    assert listed[cli.analyst_name].key is None


def test_keys_revoke_refuses_a_shared_prefix(cli: Cli, tmp_path: Path) -> None:
    url = cli.server.settings.database_url
    twins = [f"cli-twin-{secrets.token_hex(4)}" for _ in range(2)]
    shared = f"xp_{secrets.token_hex(3)}z"
    with db_session(url) as session, session.begin():
        for name in twins:
            create_key(session, name, Role.viewer)
        session.execute(update(ApiKey).where(ApiKey.name.in_(twins)).values(prefix=shared))
    refused = local(url, tmp_path, "keys", "revoke", shared)
    assert refused.returncode == 2
    assert "several keys have the prefix" in one_line(refused.stderr)
    with db_session(url) as session:
        states = session.scalars(select(ApiKey.revoked_at).where(ApiKey.name.in_(twins))).all()
    assert states == [None, None]
    by_name = local(url, tmp_path, "keys", "revoke", twins[0])
    assert by_name.returncode == 0, by_name.stderr
    unknown = local(url, tmp_path, "keys", "revoke", "xp_nobody00")
    assert unknown.returncode == 1
    assert "no API key named 'xp_nobody00'" in one_line(unknown.stderr)


def test_datasets_archive(cli: Cli, tmp_path: Path) -> None:
    url = cli.server.settings.database_url
    archived = local(url, tmp_path, "datasets", "archive", cli.dataset_id, "--actor", "ops")
    assert archived.returncode == 0, archived.stderr
    assert archived.stdout.startswith(f"archived: {cli.dataset_id} (at ")
    assert archived.stdout.rstrip().endswith("by ops)")
    refused = cli.invoke("request", "submit", cli.dataset_id, "--params", COUNT)
    assert refused.exit_code == 2, (output(refused), refused.stderr)
    assert "archived" in refused.stderr
    with ExpostClient(cli.server.base_url, cli.admin_key) as admin:
        shown = {d.id: d for d in admin.list_datasets()}
    assert shown[cli.dataset_id].archived_at is not None

    again = local(url, tmp_path, "datasets", "archive", cli.dataset_id)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"already archived: {cli.dataset_id}")
    assert again.stdout.rstrip().endswith("by ops)")  # the first archive is kept
    missing = local(url, tmp_path, "datasets", "archive", "ds_nosuchdataset")
    assert missing.returncode == 1
    assert one_line(missing.stderr) == "error: no dataset 'ds_nosuchdataset'"


# ----- the database: never created by these commands ------------------------------------------------------

LOCAL_COMMANDS = [
    ("ledger", "verify"),
    ("keys", "list"),
    ("keys", "revoke", "someone"),
    ("datasets", "archive", "ds_x"),
]


@pytest.mark.parametrize("command", LOCAL_COMMANDS, ids=" ".join)
def test_from_another_folder_nothing_is_created(tmp_path: Path, command: tuple[str, ...]) -> None:
    """The default database, sqlite:///./var/expost.db, is relative to the current folder: run elsewhere,
    the command names the file it looked for, exits 2 and leaves the folder empty."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = local(None, elsewhere, *command)
    assert result.returncode == 2, (result.stdout, result.stderr)
    expected = (
        f"error: no expost database at {elsewhere.resolve() / 'var' / 'expost.db'}; "
        "set EXPOST_DATABASE_URL or run from the service's folder"
    )
    assert one_line(result.stderr) == expected
    assert result.stdout == ""
    assert list(elsewhere.iterdir()) == []


def test_an_empty_sqlite_file_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    """What the old `ledger verify` left behind: an empty file. It is refused, and not turned into a WAL
    database (no -wal or -shm file, still 0 bytes)."""
    (tmp_path / "var").mkdir()
    empty = tmp_path / "var" / "expost.db"
    empty.touch()
    result = local(None, tmp_path, "ledger", "verify")
    assert result.returncode == 2
    assert "no expost schema in it" in one_line(result.stderr)
    assert [p.name for p in (tmp_path / "var").iterdir()] == ["expost.db"]
    assert empty.stat().st_size == 0


def test_an_unmigrated_or_missing_database_on_either_backend(database_url: str, tmp_path: Path) -> None:
    with fresh_database(database_url, tmp_path, migrated=False) as bare:
        if bare.startswith("sqlite"):
            absent = local(bare, tmp_path, "ledger", "verify")
            assert absent.returncode == 2
            assert "no expost database at" in one_line(absent.stderr)
            assert not Path(bare.removeprefix("sqlite:///")).exists()
            with db_session(bare) as session:  # now an empty SQLite database
                session.execute(select(1))
        result = local(bare, tmp_path, "ledger", "verify", data_dir=tmp_path / "data")
        assert result.returncode == 2, (result.stdout, result.stderr)
        assert "(no expost schema in it)" in one_line(result.stderr)
        assert "EXPOST_DATABASE_URL" in result.stderr
        assert not (tmp_path / "data").exists()  # refused before the data folder is opened


@pytest.mark.postgres
def test_a_database_server_that_cannot_be_opened(tmp_path: Path) -> None:
    """PostgreSQL only (a server that refuses the connection: a missing database on it)."""
    from sqlalchemy.engine import make_url

    missing = make_url(POSTGRES_URL).set(database=f"expost_missing_{secrets.token_hex(4)}")
    result = local(missing.render_as_string(hide_password=False), tmp_path, "keys", "list")
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert line.startswith("error: cannot open the expost database at postgresql")
    assert "does not exist" in line
