"""Who holds a lease: a worker id names the host, the process and one claim."""

from __future__ import annotations

import os
import socket
import uuid

_PROCESS_ID = f"{socket.gethostname()[:30]}:{os.getpid()}"


def worker_id() -> str:
    """Names the claimant of a lease: host, process and a random part (unique per claim)."""
    return f"{_PROCESS_ID}:{uuid.uuid4().hex[:12]}"[:64]
