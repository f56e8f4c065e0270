"""structlog configuration: console in development, JSON in production. Never log data or releases."""

from __future__ import annotations

import logging

import structlog


def configure_logging(level: str = "INFO", as_json: bool = False) -> None:
    logging.basicConfig(level=level.upper(), format="%(message)s")
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        cache_logger_on_first_use=True,
    )
