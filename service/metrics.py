"""Prometheus metrics of domain events (never data values or noisy outputs)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter("expost_requests_total", "Analysis requests by outcome", ["mechanism", "outcome"])
WRITER_BATCH = Histogram(
    "expost_writer_batch_size",
    "Jobs (admissions and settlements) committed together by the group-commit writer",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
