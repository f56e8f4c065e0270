"""docs/api.md's examples are run, in order, as one shell session against a live server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LiveServer

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_every_curl_example_in_the_api_docs_works(live_server: LiveServer) -> None:
    blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), flags=re.S)
    assert len(blocks) >= 6
    script = "set -euo pipefail\n" + "\n".join(blocks)
    env = {
        **os.environ,
        "BASE": live_server.base_url,
        "EXPOST_DATABASE_URL": live_server.settings.database_url,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout
    assert re.search(r"(?i)etag: \"[0-9a-f]+\"", out)
    assert "'value':" in out  # the Laplace release
    assert "committed" in out
    assert "False" in out  # the dry run over the analyst's sub-budget
    assert "cannot afford" in out  # the refusal
    assert "closed" in out  # the session
    assert "\nTrue\n" in out  # the accuracy-first count reached its target
    assert "\n0\n0.02\n0.02\n" in out  # noise reduction: level 0, then ε of level 1, charged that ε
    assert re.search(r"\n\[-?[0-9.e-]+, -[0-9.e-]+, -?[0-9.e-]+\]\n[0-9.e-]+\n", out)  # θ, report
    assert "/problems/" in out  # a recorded refusal
    assert re.search(r"(?im)^retry-after: [0-9]+", out)  # the 202 of a long request
    assert re.search(r"\n(queued|running)\n(aborted|failed_charged)\n", out)  # its phase, then the cancel
    assert '"max_running_requests":4' in out  # the analyst's limits
    assert '"status":"ok"' in out
    assert "\nsubmitRequest\n" in out  # the OpenAPI document's operationId
    assert "\n#/components/schemas/LaplaceRequestIn\n" in out  # the body's variant for laplace
    assert "{'age': 0, 'income': 0, 'region': 0}" in out  # clipped per column, schema sent as a file
    assert '"status":"ready"' in out


def test_the_readme_python_tour_runs(live_server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.integration.helpers import make_world

    readme = (DOCS.parents[1] / "README.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    world = make_world(live_server, {"epsilon": 1.0, "delta": 0.0})
    key = world.analyst.headers["Authorization"].split()[1]
    block = block.replace('"http://127.0.0.1:8000"', repr(live_server.base_url))
    exec(compile(block, "README.md", "exec"), {"KEY": key, "DS": world.dataset_id})
    out = capsys.readouterr().out
    assert "'value':" in out  # the release
    assert "'above':" in out  # the session's answer
    assert "epsilon" in out  # the refusal's summary names what is affordable or requested
