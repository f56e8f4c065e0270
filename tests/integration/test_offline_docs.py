"""The server works without internet and without friction: `/docs` and `/redoc` load every asset from the
app itself, `GET /` leads to the dashboard, `expost serve` refuses a busy port at once with a clear message
(and starts on a free one), and `make run PORT=…` passes the port on.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.embedded import free_port
from service.store.migrate import upgrade
from tests.conftest import LiveServer

ROOT = Path(__file__).resolve().parents[2]
EXPOST = Path(sys.executable).with_name("expost")
CONTENT_TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png", ".json": "application/json"}


def referenced_urls(html: str) -> list[str]:
    """Every URL a page makes the browser load: src/href attributes, ReDoc's spec-url, Swagger UI's url."""
    urls = re.findall(r"""(?:src|href|spec-url)\s*=\s*["']([^"']+)["']""", html)
    urls += re.findall(r"""\burl\s*:\s*["']([^"']+)["']""", html)
    return urls


@pytest.mark.parametrize(
    ("page", "title", "expected"),
    [
        (
            "/docs",
            "expost - Swagger UI",
            {"/docs/static/swagger-ui/swagger-ui-bundle.js", "/docs/static/swagger-ui/swagger-ui.css"},
        ),
        ("/redoc", "expost - ReDoc", {"/docs/static/redoc/redoc.standalone.js"}),
    ],
)
def test_the_reference_pages_load_only_what_the_app_serves(
    live_server: LiveServer, page: str, title: str, expected: set[str]
) -> None:
    with live_server.client() as client:
        response = client.get(page)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        html = response.text
        assert f"<title>{title}</title>" in html
        # no address outside this server anywhere in the page (no CDN, no Google Fonts, no favicon host)
        assert not re.search(r"(?i)https?://|//cdn|fonts\.googleapis", html), html
        urls = referenced_urls(html)
        assert expected <= set(urls), urls
        assert "/openapi.json" in urls
        csp = response.headers["content-security-policy"]
        for directive in ("default-src 'self'", "connect-src 'self'", "img-src 'self' data:"):
            assert directive in csp, csp
        for url in urls:
            assert url.startswith("/"), url
            assert not url.startswith("//"), url
            asset = client.get(url)
            assert asset.status_code == 200, url
            kind = CONTENT_TYPES[Path(url).suffix]
            assert kind in asset.headers["content-type"], (url, asset.headers["content-type"])
            assert len(asset.content) > 500, url
            if Path(url).suffix in {".js", ".css"}:
                assert asset.headers["x-content-type-options"] == "nosniff"


def test_the_assets_are_the_libraries_and_nothing_else_is_served(live_server: LiveServer) -> None:
    with live_server.client() as client:
        bundle = client.get("/docs/static/swagger-ui/swagger-ui-bundle.js")
        assert "SwaggerUIBundle" in bundle.text[:2000]
        assert "Redoc" in client.get("/docs/static/redoc/redoc.standalone.js").text[:2000]
        again = client.get(
            "/docs/static/swagger-ui/swagger-ui-bundle.js", headers={"If-None-Match": bundle.headers["etag"]}
        )
        assert again.status_code == 304
        for path in (
            "/docs/static/missing.js",
            "/docs/static/%2e%2e/index.html",
            "/docs/static/%2e%2e/%2e%2e/routers/docs.py",
        ):
            assert client.get(path).status_code == 404, path
        # the pages are not part of the API's description
        document = client.get("/openapi.json").json()
        assert not {"/", "/docs", "/redoc"} & set(document["paths"])
        assert not any(path.startswith("/docs/") for path in document["paths"])


def test_the_root_leads_to_the_dashboard(live_server: LiveServer) -> None:
    with live_server.client() as client:
        response = client.get("/", follow_redirects=False)
        assert response.status_code == 307
        assert response.headers["location"] == "/dashboard"
        landed = client.get("/", follow_redirects=True)
        assert landed.status_code == 200
        assert str(landed.url).endswith("/dashboard")
        assert landed.headers["content-type"].startswith("text/html")


def serve_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")}
    url = f"sqlite:///{tmp_path / 'expost.db'}"
    upgrade(url)
    return {**env, "EXPOST_DATABASE_URL": url, "EXPOST_DATA_DIR": str(tmp_path / "data")}


def test_serve_on_a_busy_port_exits_at_once_naming_the_port(tmp_path: Path) -> None:
    env = serve_env(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run(
            [str(EXPOST), "serve", "--port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        took = time.monotonic() - started
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr
    assert "--port" in done.stderr  # says what to do
    assert "started" not in done.stdout + done.stderr
    assert "Errno" not in done.stdout + done.stderr
    assert took < 30  # the time to import the CLI, never a server start-up and shutdown


def test_serve_on_a_free_port_starts_and_shows_the_docs_without_alembic_noise(tmp_path: Path) -> None:
    env = serve_env(tmp_path)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [str(EXPOST), "serve", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, server.communicate()[0]
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "expost serve did not answer within 60 s"
            time.sleep(0.2)
        assert httpx.get(f"{base}/docs", timeout=10).status_code == 200
        assert httpx.get(f"{base}/docs/static/redoc/redoc.standalone.js", timeout=10).status_code == 200
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=60)
    assert "expost started" in out
    assert "Context impl" not in out, out  # alembic's INFO lines are off
    assert "alembic" not in out, out


@pytest.mark.parametrize(("args", "port"), [(["PORT=8123"], "8123"), ([], "8000")])
def test_make_run_passes_the_port_to_serve(args: list[str], port: str) -> None:
    make = shutil.which("make")
    assert make is not None, "make is needed to run the project (`make run`, `make test`)"
    env = {k: v for k, v in os.environ.items() if k not in {"PORT", "MAKEFLAGS", "MAKELEVEL"}}
    done = subprocess.run(
        [make, "-n", "run", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    serve = [line for line in done.stdout.splitlines() if "expost serve" in line]
    assert serve, done.stdout
    assert serve[-1].rstrip().endswith(f"--port {port}"), done.stdout
