"""Driving Debian's Chromium (``/usr/bin/chromium``) headless through Playwright for Python.

Playwright's own browser downloads are never used (``playwright install`` is never run): the browser is
the system's, installed by ``make browser``. Without it (or without Playwright) the e2e tests skip with
the reason, except under ``CI=true`` where they fail: the browser tests must run in CI.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(
            f"{reason} (CI=true: the browser tests must run; `make browser` installs Chromium)", pytrace=False
        )
    pytest.skip(f"{reason}; `make browser` installs it (as root: apt-get install chromium)")


def chromium_path() -> str:
    path = os.environ.get("EXPOST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        unavailable("Chromium is not installed (no `chromium` on PATH, EXPOST_CHROMIUM unset)")
        raise AssertionError("unreachable")
    return path


@dataclass
class PageLog:
    """What the page did: console errors, uncaught exceptions, and every URL it requested."""

    errors: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)


@contextmanager
def chromium_page(profile: Path) -> Iterator[tuple[Any, PageLog]]:
    """A page in a fresh headless Chromium profile; yields (page, log)."""
    executable = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover - a test dependency
        unavailable("Playwright for Python is not installed (pip install -e '.[test]')")
        raise
    log = PageLog()
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=executable,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
            device_scale_factor=1,
            locale="en-GB",
            timezone_id="UTC",
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.set_default_timeout(20_000)
            page.on("console", lambda m: m.type == "error" and log.errors.append(f"console: {m.text}"))
            page.on("pageerror", lambda exc: log.errors.append(f"page error: {exc}"))
            page.on("request", lambda r: log.urls.append(r.url))
            yield page, log
        finally:
            context.close()


def image_stats(png: bytes) -> tuple[tuple[int, int], int, float]:
    """(size, number of distinct colours, share of the most common colour) of a PNG."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        rgb = image.convert("RGB")
        size = rgb.size
        colors = rgb.getcolors(maxcolors=1 << 24) or []
    total = size[0] * size[1]
    top = max((count for count, _ in colors), default=0)
    return size, len(colors), top / total if total else 1.0
