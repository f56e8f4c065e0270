"""A served process moves its start-up heap out of the cycle collector's reach, once
(``service.app.freeze_startup_heap``; docs/operations.md, Throughput)."""

from __future__ import annotations

import gc

from service.app import YOUNG_COLLECTION_THRESHOLD, freeze_startup_heap
from tests.conftest import LiveServer


def test_a_served_process_freezes_its_start_up_heap_once(live_server: LiveServer) -> None:
    assert live_server.client().get("/healthz").status_code == 200
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the imported modules and the runtime, at least
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_THRESHOLD
    freeze_startup_heap()  # another app starting in this process (tests) freezes nothing more
    assert gc.get_freeze_count() == frozen
