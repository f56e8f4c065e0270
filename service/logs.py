"""Logging: structlog on top of the standard library, one line per event on stdout.

``EXPOST_LOG_JSON=true`` renders every line as one JSON object (production); otherwise a console format
(development). structlog events and standard-library records (uvicorn, SQLAlchemy, Alembic) share the
same handler and renderer, and both carry the context bound with ``structlog.contextvars``: for each HTTP
request the middleware (service/api/middleware.py) binds ``http_request_id`` (the ``X-Request-ID``) and
``method``, and every line written while the request is handled gets its ``route`` template.
(``request_id`` is the id of an analysis request, ``rq_…``, where a line is about one.)

What a log line may carry: ids (request, session, dataset), analyst names, mechanism names, route
templates, HTTP statuses, durations, counts, exception tracebacks of the service's own code. What it
never carries: secret mechanism state, raw data, released values, API keys, Authorization headers,
request bodies. The code never passes those to a logger; :func:`redact` is a second line of defence that
blanks any event field whose *name* says it holds one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, MutableMapping
from contextvars import ContextVar
from typing import Any, TextIO

import orjson
import structlog

# Event fields that must never reach a log line, whatever a caller passes (matched case-insensitively).
REDACTED_FIELDS = frozenset(
    {
        "authorization",
        "api_key",
        "key",
        "token",
        "password",
        "secret",
        "secret_state",
        "state_blob",
        "noisy_threshold",
        "k",
        "release",
        "releases",
        "output",
        "value",
        "values",
        "noise",
        "answer",
        "gap",
        "body",
        "data",
        "table",
        "rows",
    }
)
REDACTED = "[redacted]"
_HANDLER_MARK = "_expost_handler"

# Set by the HTTP middleware for each request: the route template, once the router has chosen the route.
CURRENT_ROUTE: ContextVar[Callable[[], str] | None] = ContextVar("expost_current_route", default=None)


def add_pid(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The server process (``expost serve --workers N`` runs N of them)."""
    event_dict["pid"] = os.getpid()
    return event_dict


def add_route(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Add the HTTP route template to lines written while a request is handled."""
    route = CURRENT_ROUTE.get()
    if route is not None and "route" not in event_dict:
        event_dict["route"] = route()
    return event_dict


def redact(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Blank the value of any field named like a secret, a release or a request body."""
    for name in list(event_dict):
        if name.lower() in REDACTED_FIELDS:
            event_dict[name] = REDACTED
    return event_dict


class _Stdout:
    """Writes to whatever ``sys.stdout`` is at the time of each line (so captured output, too)."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


def _shared_processors() -> list[structlog.types.Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        add_route,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_pid,
        redact,
    ]


def _renderer(as_json: bool) -> list[structlog.types.Processor]:
    """The last processors of every line: JSON (the traceback as a string field) or the console format."""
    if as_json:
        json_renderer = structlog.processors.JSONRenderer(serializer=_json_line)
        return [structlog.processors.format_exc_info, json_renderer]
    # plain tracebacks: rich's (the default when rich is installed) prints every frame's local variables,
    # which in mechanism code are the data and the secret state
    return [structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)]


_ORJSON_LINE = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_SERIALIZE_NUMPY


def _json_line(event: Any, **kwargs: Any) -> str:
    """One log line's JSON: orjson (a few times faster than ``json.dumps`` on every request's two lines),
    with structlog's fallback (``repr``) for what neither knows; the standard library for what orjson
    does not take (integers beyond 64 bits). A dataclass is written as its ``repr``, as before, never
    field by field (a field hidden from ``repr`` stays hidden); NumPy scalars as numbers."""
    fallback = kwargs.get("default")
    try:
        return orjson.dumps(event, default=fallback, option=_ORJSON_LINE).decode()
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(event, **kwargs)


def formatter(as_json: bool) -> logging.Formatter:
    """The formatter of expost's handler for standard-library records (uvicorn, SQLAlchemy, Alembic)."""
    final: list[structlog.types.Processor] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_shared_processors(), processors=[*final, *_renderer(as_json)]
    )


class _Output:
    """What :func:`configure_logging` installed last: expost's handler and the renderer of structlog's own
    lines. Read at every line, so a logger cached before a reconfiguration follows it."""

    handler: logging.StreamHandler[Any] | None = None
    render: tuple[structlog.types.Processor, ...] = ()
    level: int = logging.INFO


def _at_level(_: Any, method: str, event_dict: Any) -> Any:
    """Drop a line below the level configured last (loggers are cached on first use: the level is
    applied here, at every line, so a reconfiguration reaches them)."""
    if _LEVELS.get(method, logging.INFO) < _OUTPUT.level:
        raise structlog.DropEvent
    return event_dict


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


_OUTPUT = _Output()


def _render(logger: Any, method: str, event_dict: Any) -> Any:
    for processor in _OUTPUT.render:
        event_dict = processor(logger, method, event_dict)
    return event_dict


class _HandlerWriter:
    """structlog's own events, rendered by the same processors, written straight to expost's handler's
    stream under the handler's lock (so lines never interleave with standard-library ones). This skips the
    standard library's record machinery, which cost about a tenth of a cheap request's CPU for its two
    lines (the access line and the admission line; benchmarks/service_load.py). So they reach expost's
    handler (stdout) only, never another handler added to the root logger: ship stdout's JSON lines."""

    def __init__(self, name: str = "") -> None:
        self.name = name

    def msg(self, message: str) -> None:
        handler = _OUTPUT.handler
        if handler is None:
            return
        with handler.lock or contextlib.nullcontext(), contextlib.suppress(OSError, ValueError):
            handler.stream.write(message + "\n")  # a closed or broken stream never fails the caller,
            handler.stream.flush()  # as with the standard library's handlers

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def failure_fields(exc: BaseException) -> dict[str, str]:
    """What may be logged about a failure that happened after reading data: its type and where.

    Never the message or local variables: a mechanism's exception text could carry a data value.
    """
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}" if frame else "unknown"
    return {"error_type": type(exc).__name__, "error_at": where}


def configure_logging(level: str = "INFO", as_json: bool = False, stream: TextIO | None = None) -> None:
    """Install expost's handler on the root logger (replacing a previous one of ours, and no other)."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    handler = logging.StreamHandler(stream if stream is not None else _Stdout())
    handler.setFormatter(formatter(as_json))
    setattr(handler, _HANDLER_MARK, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    # Alembic's INFO lines ("Context impl SQLiteImpl.", "Will assume transactional DDL.") at every start
    # say nothing to an operator: only its warnings, unless EXPOST_LOG_LEVEL=debug.
    logging.getLogger("alembic").setLevel(logging.DEBUG if numeric <= logging.DEBUG else logging.WARNING)
    if as_json:
        # uvicorn's own lines ("Exception in ASGI application", startup errors) in the same JSON stream;
        # its access log stays off (the middleware writes one access line per request).
        uvicorn = logging.getLogger("uvicorn")
        uvicorn.handlers, uvicorn.propagate = [], True
    _OUTPUT.handler, _OUTPUT.render, _OUTPUT.level = handler, tuple(_renderer(as_json)), numeric
    structlog.configure(
        processors=[_at_level, *_shared_processors(), _render],
        logger_factory=lambda *names: _HandlerWriter(str(names[0]) if names else ""),
        # every level reaches _at_level, which applies the current one: cached loggers follow a change
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        cache_logger_on_first_use=True,
    )
