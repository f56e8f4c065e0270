"""The container files (docs/operations.md, Containers): docker-compose.yml validates and has its pieces;
the Dockerfile is sound.

No Docker engine is needed: the compose file is validated by Debian's ``docker-compose config`` (the
compose file schema and references between services; ``make test`` installs it through ``make
compose-tools``), and both files are parsed here. The commands the image runs must be the ones the
documentation gives (README.md, docs/operations.md) and the ones the real CLI accepts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
OPERATIONS = ROOT / "docs" / "operations.md"
README = ROOT / "README.md"
EXPOST = str(Path(sys.executable).with_name("expost"))
IN_CI = os.environ.get("CI", "").lower() == "true"


# ----- docker-compose.yml ---------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # YAML merge keys (<<) resolved
    return loaded


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def named_volumes(service: dict[str, Any]) -> dict[str, str]:
    """{volume name: mount target} of the service's named-volume mounts (short or long syntax)."""
    mounts: dict[str, str] = {}
    for item in service.get("volumes", []):
        if isinstance(item, str):
            source, _, rest = item.partition(":")
            target = rest.split(":")[0]
        else:
            source, target = item.get("source", ""), item.get("target", "")
        if source and not source.startswith((".", "/", "~")):
            mounts[source] = target
    return mounts


def compose_tool() -> str:
    """The docker-compose binary; a failure under CI=true, a skip with the reason elsewhere."""
    tool = shutil.which("docker-compose")
    if tool is None:
        message = (
            "docker-compose is not installed, so docker-compose.yml cannot be validated: run "
            "`make compose-tools` as root (apt-get install docker-compose)"
        )
        if IN_CI:
            pytest.fail(message + " (CI=true: this check must run)", pytrace=False)
        pytest.skip(message)
    return tool


def test_the_compose_file_validates() -> None:
    tool = compose_tool()
    done = subprocess.run(
        [tool, "-f", str(COMPOSE), "config", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "POSTGRES_PASSWORD": "x"},
    )
    assert done.returncode == 0, done.stderr + done.stdout


def test_the_validator_rejects_a_broken_compose_file(tmp_path: Path) -> None:
    """`docker-compose config` really checks (an unknown key, a dependency on a missing service)."""
    tool = compose_tool()
    missing_dependency = {"depends_on": {"db": {"condition": "service_healthy"}}}
    for broken in (
        {"services": {"api": {"image": "x", "bogus": 1}}},
        {"services": {"api": {"image": "x", **missing_dependency}}},
    ):
        path = tmp_path / "docker-compose.yml"
        path.write_text(yaml.safe_dump(broken))
        done = subprocess.run(
            [tool, "-f", str(path), "config", "--quiet"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode != 0, broken


def test_the_compose_file_has_postgres_api_worker_and_a_data_volume() -> None:
    config = compose()
    services = config["services"]
    assert {"postgres", "api", "worker"} <= set(services)

    postgres = services["postgres"]
    assert str(postgres["image"]).startswith("postgres:")
    assert "pg_isready" in " ".join(map(str, postgres["healthcheck"]["test"]))

    api, worker = services["api"], services["worker"]
    assert api["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert api["image"] == worker["image"], "api and worker run the same image"
    assert api.get("build") == worker.get("build")
    api_env, worker_env = environment(api), environment(worker)
    url = api_env["EXPOST_DATABASE_URL"]
    assert url.startswith("postgresql+psycopg://"), url
    assert "@postgres:5432/" in url, "the API reaches the postgres service"
    assert worker_env["EXPOST_DATABASE_URL"] == url, "api and worker use the same database"
    assert worker["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert worker["command"] in (["expost", "worker", "--queue"], "expost worker --queue")
    assert worker_env["EXPOST_EXECUTOR"] == "queue", "mechanisms run on the queue workers"
    assert worker_env["EXPOST_BROKER_URL"].startswith("redis://redis:"), "the workers reach the redis service"
    assert "redis" in services
    assert api["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert worker.get("healthcheck", {}).get("disable") is True, "the worker serves no /readyz"

    declared = set(config.get("volumes") or {})
    data_dir = api_env["EXPOST_DATA_DIR"]
    mounted = named_volumes(api)
    data_volumes = [
        name
        for name, target in mounted.items()
        if data_dir == target or data_dir.startswith(target.rstrip("/") + "/")
    ]
    assert data_volumes, f"no named volume holds the data directory {data_dir}: {mounted}"
    assert set(data_volumes) <= declared
    assert worker_env["EXPOST_DATA_DIR"] == data_dir
    assert any(target == "/var/lib/postgresql/data" for target in named_volumes(postgres).values())
    assert api["ports"], "the API is published"


def test_compose_migrates_once_in_a_one_shot_job_and_the_api_only_serves() -> None:
    """The schema is upgraded by one `migrate` job before any API replica or worker starts; the API runs the
    image's CMD without `expost migrate` (scaled replicas never race two migrations)."""
    services = compose()["services"]
    migrate, api = services["migrate"], services["api"]
    assert migrate["command"] in (["expost", "migrate"], "expost migrate")
    assert migrate["restart"] == "no", "a one-shot job: it runs once and is not restarted"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert migrate["image"] == api["image"]
    assert environment(migrate)["EXPOST_DATABASE_URL"] == environment(api)["EXPOST_DATABASE_URL"]
    argv = api["command"]
    assert argv[:2] == ["sh", "-c"], argv
    steps = [shlex.split(part.replace("$$", "$")) for part in argv[2].split("&&")]
    assert not any("migrate" in words for words in steps), steps
    assert steps[-1][:2] == ["exec", "expost"], "the server replaces the shell (it gets the signals)"
    serve = [w for w in steps[-1] if w != "exec"]
    image_serve = [words for words in expost_commands() if words[1] == "serve"]
    assert serve == image_serve[0], "the API serves exactly as the image's CMD does"
    text = COMPOSE.read_text()
    assert "expost keys create --role admin" in text, "the compose file shows how to make the first admin key"


# ----- Dockerfile -----------------------------------------------------------------------------------------


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, with line continuations joined and comments dropped."""
    result: list[tuple[str, str]] = []
    current = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, args = current.partition(" ")
        result.append((keyword.upper(), args.strip()))
        current = ""
    assert current == "", "a dangling line continuation"
    return result


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for keyword, args in instructions():
        if keyword == "FROM":
            found.append([])
        assert found, "the Dockerfile starts with FROM"
        found[-1].append((keyword, args))
    return found


def cmd_commands() -> list[list[str]]:
    """The commands of the final stage's CMD (a JSON ``sh -c`` string split at ``&&``), as argv lists."""
    final = stages()[-1]
    cmds = [args for keyword, args in final if keyword == "CMD"]
    assert len(cmds) == 1
    argv = json.loads(cmds[0])  # exec form
    assert argv[:2] == ["sh", "-c"], argv
    return [shlex.split(part) for part in argv[2].split("&&")]


def expost_commands() -> list[list[str]]:
    return [[w for w in words if w != "exec"] for words in cmd_commands() if "expost" in words[:2]]


def test_the_dockerfile_is_multi_stage_and_runs_unprivileged() -> None:
    built = stages()
    assert len(built) >= 2, "a builder stage and a runtime stage"
    assert re.fullmatch(r"\S+ AS builder", built[0][0][1], flags=re.IGNORECASE), built[0][0]
    final = built[-1]
    assert final[0][1].split()[0] == "python:3.11-slim", final[0]
    assert any(k == "COPY" and args.startswith("--from=builder") for k, args in final)
    assert not any(k == "RUN" and "pip install" in args for k, args in final), "nothing is built at runtime"
    users = [args for keyword, args in final if keyword == "USER"]
    assert users, "the final stage sets a USER"
    assert users[-1].split(":")[0] not in ("root", "0"), users
    healthchecks = [args for keyword, args in final if keyword == "HEALTHCHECK"]
    assert len(healthchecks) == 1
    assert "/readyz" in healthchecks[0]
    assert "127.0.0.1:8000" in healthchecks[0]
    assert any(k == "EXPOSE" and args.split()[0] == "8000" for k, args in final)


def test_the_image_migrates_then_serves() -> None:
    commands = expost_commands()
    names = [words[1] for words in commands]
    assert names == ["migrate", "serve"], commands
    serve = commands[1]
    options = dict(zip(serve[2::2], serve[3::2], strict=True))
    assert options["--host"] == "0.0.0.0"
    assert options["--port"] == "8000"
    assert "--workers" in options
    # the last command replaces the shell, so the server receives the container's signals
    last = cmd_commands()[-1]
    assert last[:2] == ["exec", "expost"], last


def normalized(text: str) -> str:
    return " ".join(text.replace('"', "").split())


def test_the_image_commands_are_the_documented_ones() -> None:
    operations, readme = OPERATIONS.read_text(), README.read_text()
    for words in expost_commands():
        command = " ".join(words)
        assert normalized(command) in normalized(operations), f"docs/operations.md does not show `{command}`"
        usage = [line for line in readme.splitlines() if line.startswith(f"expost {words[1]}")]
        assert usage, f"README.md's command list lacks `expost {words[1]}`"
        for option in words[2::2]:
            assert option in usage[0], f"README.md does not document {option} of `expost {words[1]}`"
    worker = compose()["services"]["worker"]["command"]
    worker_command = worker if isinstance(worker, str) else " ".join(worker)
    assert f"`{worker_command}`" in operations, "docs/operations.md documents the worker's command"


def test_the_image_commands_exist_in_the_cli() -> None:
    for words in expost_commands():
        done = subprocess.run(
            [EXPOST, words[1], "--help"], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
        for option in words[2::2]:
            assert option in done.stdout, f"`expost {words[1]}` has no {option} option"
    worker = compose()["services"]["worker"]["command"]
    worker_words = worker if isinstance(worker, list) else shlex.split(worker)
    done = subprocess.run(
        [EXPOST, *worker_words[1:], "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


def test_every_setting_is_documented_with_its_default() -> None:
    from service.config import Settings

    rows = {
        line.split("|")[1].strip().strip("`"): line
        for line in OPERATIONS.read_text().splitlines()
        if line.startswith("| `EXPOST_")
    }
    for name, info in Settings.model_fields.items():
        variable = f"EXPOST_{name.upper()}"
        assert variable in rows, f"docs/operations.md does not document {variable}"
        default = info.default
        if isinstance(default, bool):
            shown = [str(default).lower()]
        elif isinstance(default, set | frozenset | list | tuple):
            shown = [f'"{item}"' for item in sorted(default)]
        else:
            shown = [str(default)]
        for text in shown:
            assert text in rows[variable], f"{variable}: default {text} not in {rows[variable]!r}"
