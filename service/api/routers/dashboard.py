"""The dashboard: one static page (HTML, JS, CSS and a vendored Chart.js under service/static).

The page itself needs no key: the person pastes an API key, which the page keeps in sessionStorage and
sends as ``Authorization: Bearer`` to the JSON API. Nothing is fetched from anywhere but this server.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from service.api.routers import activity

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

# Only this origin; no inline script, no framing. Chart.js sets element.style (CSSOM), which CSP allows.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(tags=["dashboard"])
router.include_router(activity.router)
_static = StaticFiles(directory=STATIC_DIR)


@router.get("/dashboard", include_in_schema=False)
def dashboard() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=SECURITY_HEADERS)


@router.get("/", include_in_schema=False)
def root() -> RedirectResponse:
    """A person who opens the server's address lands on the dashboard (temporary: 307)."""
    return RedirectResponse("/dashboard", status_code=307)


@router.get("/dashboard/", include_in_schema=False)
def dashboard_slash() -> RedirectResponse:
    return RedirectResponse("/dashboard", status_code=308)


@router.get("/dashboard/static/{path:path}", include_in_schema=False)
async def static(path: str, request: Request) -> Response:
    """The page's assets, served by Starlette's StaticFiles (safe paths, ETag and 304)."""
    response = await _static.get_response(path, request.scope)
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response
