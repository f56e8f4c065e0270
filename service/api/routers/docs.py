"""The API reference pages, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), with every asset served by the
app itself (the vendored files of service/api/static/vendor/), so both work without internet.

FastAPI's own pages load Swagger UI and ReDoc from a CDN; the app turns them off (``docs_url=None``,
``redoc_url=None``) and these routes build the same pages with FastAPI's ``get_swagger_ui_html`` and
``get_redoc_html`` pointed at ``/docs/static/…``. None of them is part of the OpenAPI document.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

VENDOR_DIR = Path(__file__).resolve().parent.parent / "static" / "vendor"
ASSETS = "/docs/static"
SWAGGER_JS = f"{ASSETS}/swagger-ui/swagger-ui-bundle.js"
SWAGGER_CSS = f"{ASSETS}/swagger-ui/swagger-ui.css"
REDOC_JS = f"{ASSETS}/redoc/redoc.standalone.js"
FAVICON = f"{ASSETS}/swagger-ui/favicon-32x32.png"

# The browser may fetch from this origin only. The pages are FastAPI's, with an inline script and inline
# styles; ReDoc starts a Web Worker from a blob: URL and would load its footer logo from the internet.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; "
        "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

router = APIRouter(include_in_schema=False)
_assets = StaticFiles(directory=VENDOR_DIR)


def _asset(request: Request, path: str) -> str:
    """``path`` below the prefix the app is mounted at (behind a proxy that sets ``root_path``)."""
    return f"{str(request.scope.get('root_path', '')).rstrip('/')}{path}"


def _openapi_url(request: Request) -> str:
    return _asset(request, str(request.app.openapi_url))


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    return _page(
        request,
        get_swagger_ui_html,
        "Swagger UI",
        swagger_js_url=_asset(request, SWAGGER_JS),
        swagger_css_url=_asset(request, SWAGGER_CSS),
        swagger_favicon_url=_asset(request, FAVICON),
        # no badge from the online validator (it would send the document to a third party)
        swagger_ui_parameters={"validatorUrl": None},
    )


@router.get("/redoc")
def redoc(request: Request) -> HTMLResponse:
    assets = {"redoc_js_url": _asset(request, REDOC_JS), "redoc_favicon_url": _asset(request, FAVICON)}
    return _page(request, get_redoc_html, "ReDoc", with_google_fonts=False, **assets)


def _page(request: Request, render: Callable[..., HTMLResponse], name: str, **assets: Any) -> HTMLResponse:
    """A docs page for this app's OpenAPI document that loads scripts, styles and images from this server
    only."""
    page = render(openapi_url=_openapi_url(request), title=f"{request.app.title} - {name}", **assets)
    page.headers.update(SECURITY_HEADERS)
    return page


@router.get(ASSETS + "/{path:path}")
async def assets(path: str, request: Request) -> Response:
    """The vendored files, by Starlette's StaticFiles (safe paths, ETag and 304)."""
    response = await _assets.get_response(path, request.scope)
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response
