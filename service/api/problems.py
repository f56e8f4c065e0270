"""HTTP errors as RFC 9457 problem+json, and the OpenAPI document that describes them."""

from __future__ import annotations

import json
import sys
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as SqlAlchemyTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from mechanisms.catalog import INTERACTIVE, MECHANISMS
from service.api.openapi import add_mechanism_unions, json_safe_schema
from service.api.schemas import Problem
from service.errors import PROBLEM_JSON, ServiceError, ServiceUnavailable
from service.logs import failure_fields

log = structlog.get_logger("expost")


def problem_response(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:] if parts[0] == "body" else parts
    return ".".join(parts) or "body"


def invalid_input(status: int, field: str, reason: str, instance: str) -> JSONResponse:
    """The ``/problems/invalid-input`` problem naming one field."""
    return problem_response(
        status,
        {
            "type": "/problems/invalid-input",
            "title": "Invalid input",
            "status": status,
            "detail": f"{field}: {reason}",
            "instance": instance,
            "errors": [{"field": field, "reason": reason}],
        },
    )


def json_failure(exc: BaseException | None) -> str | None:
    """Why a JSON text could not be decoded, from the exception ``json.loads`` raised; None when the
    exception is not a decoding failure. Never echoes the input."""
    if isinstance(exc, UnicodeDecodeError):
        return f"not valid UTF-8 (byte {exc.start})"
    if isinstance(exc, RecursionError):
        return "JSON nested too deeply"
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON ({exc.msg})"
    if isinstance(exc, ValueError) and "integer string conversion" in str(exc):
        return f"a JSON integer has more than {sys.get_int_max_str_digits()} digits"
    if isinstance(exc, ValueError):
        return "not valid JSON"
    return None


def install_openapi(app: FastAPI) -> None:
    """The generated document, with the Problem schema that ERROR_RESPONSES refers to, the request and
    session bodies as discriminated unions over the mechanism catalog as it is when the document is first
    built (service.api.openapi), and no integer literal a JSON parser cannot hold."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = FastAPI.openapi(app)  # generates and caches app.openapi_schema
            problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(problem.pop("$defs", {}))
            schemas["Problem"] = problem
            add_mechanism_unions(document, MECHANISMS, INTERACTIVE)
            app.openapi_schema = json_safe_schema(document)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return problem_response(exc.status, exc.problem(request.url.path), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"field": "body" if e["type"] == "json_invalid" else _field(tuple(e["loc"])), "reason": e["msg"]}
            for e in exc.errors()
        ]
        first = errors[0] if errors else {"field": "body", "reason": "invalid"}
        return problem_response(
            422,
            {
                "type": "/problems/invalid-input",
                "title": "Invalid input",
                "status": 422,
                "detail": f"{first['field']}: {first['reason']}",
                "instance": request.url.path,
                "errors": errors,
            },
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI answers a bare 400 for every JSON body it cannot decode but a syntax error (too deep,
        # an over-long integer, invalid UTF-8): the same problem as malformed JSON, naming the reason.
        reason = json_failure(exc.__cause__) if exc.status_code == 400 else None
        if reason is not None:
            return invalid_input(422, "body", reason, request.url.path)
        if exc.status_code == 413:  # a chunked body over the limit: the same problem as a declared one
            return problem_response(
                413,
                {
                    "type": "/problems/payload-too-large",
                    "title": "Payload too large",
                    "status": 413,
                    "detail": str(exc.detail),
                    "instance": request.url.path,
                    "errors": [{"field": "body", "reason": str(exc.detail)}],
                },
            )
        return problem_response(
            exc.status_code,
            {
                "type": "about:blank",
                "title": str(exc.detail),
                "status": exc.status_code,
                "detail": str(exc.detail),
                "instance": request.url.path,
            },
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(OperationalError)
    @app.exception_handler(SqlAlchemyTimeout)
    async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
        # The database is unreachable, restarting or overloaded: a transient 503 the client may retry
        # (POSTs with the same Idempotency-Key); every transaction is atomic, so nothing was half-written.
        log.warning("database unavailable", path=request.url.path, **failure_fields(exc))
        detail = "the database is unavailable; retry later (with the same Idempotency-Key)"
        unavailable = ServiceUnavailable(detail)
        return problem_response(503, unavailable.problem(request.url.path), headers={"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", path=request.url.path, **failure_fields(exc))
        return problem_response(
            500,
            {
                "type": "/problems/internal-error",
                "title": "Internal error",
                "status": 500,
                "detail": "an unexpected error occurred; it was logged",
                "instance": request.url.path,
            },
        )
