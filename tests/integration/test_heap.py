"""A served process moves its start-up heap out of the cycle collector's reach, once
(``service.app.freeze_startup_heap``; docs/operations.md, Throughput)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

from service.app import YOUNG_COLLECTION_THRESHOLD, freeze_startup_heap
from tests.conftest import LiveServer


def test_a_served_process_freezes_its_start_up_heap_once(live_server: LiveServer) -> None:
    assert live_server.client().get("/healthz").status_code == 200
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the imported modules and the runtime, at least
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_THRESHOLD
    freeze_startup_heap()  # another app starting in this process (tests) freezes nothing more
    assert gc.get_freeze_count() == frozen


STOPPED_APPS_SCRIPT = """
import gc, sys, tempfile, weakref
from pathlib import Path
import httpx
import service.app as composition
from service.embedded import serve_in_thread
from service.store.migrate import upgrade
from tests.conftest import server_settings

work = Path(tempfile.mkdtemp())
url = f"sqlite:///{work}/heap.db"
upgrade(url)
runtimes = []
build = composition.build_runtime
def tracked(settings):
    runtime = build(settings)
    runtimes.append(weakref.ref(runtime))
    return runtime
composition.build_runtime = tracked
for i in range(3):
    with serve_in_thread(server_settings(url, work / f"data{i}")) as base_url:
        assert httpx.get(base_url + "/healthz").status_code == 200
    # none of the runtime's threads outlives the app: one that dropped the last reference to the runtime
    # while the interpreter finalised would destroy DuckDB's connection then, which aborts the process
    import threading
    assert not [t.name for t in threading.enumerate() if t.name.startswith("expost-")], threading.enumerate()
gc.collect()
print(gc.get_freeze_count() > 0, [ref() is None for ref in runtimes])
"""


def test_the_runtimes_of_stopped_apps_are_freed_in_a_frozen_process() -> None:
    """Several apps started and stopped in one fresh process (as in tests): the first one froze the heap,
    and still none of their runtimes (engines, caches, threads) outlives its app."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", STOPPED_APPS_SCRIPT],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "True [True, True, True]", done.stdout[-500:]
