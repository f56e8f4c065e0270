"""Prometheus metrics of domain events (never data values or noisy outputs)."""

from __future__ import annotations

from prometheus_client import Counter

REQUESTS = Counter("expost_requests_total", "Analysis requests by outcome", ["mechanism", "outcome"])
