"""The dashboard in a real headless Chromium against a live server (SQLite and PostgreSQL).

A person logs in with a viewer key, picks a dataset and sees its Rényi curve; an analyst's request
changes the page by itself (ETag polling); refusals and open sessions show up; a screenshot is taken and
checked to be a real picture. ``EXPOST_DASHBOARD_SCREENSHOT=path`` also writes it there (docs/dashboard.png).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LiveServer
from tests.e2e.browser import chromium_page, image_stats
from tests.integration.helpers import CSV, SCHEMA, World, add_dataset, get_budget, make_world

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RDP_BUDGET = {"epsilon": 1.0, "delta": 1e-6}
COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}


def key_of(client: Any) -> str:
    return str(client.headers["Authorization"]).removeprefix("Bearer ")


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def value_of(page: Any, element_id: str) -> float | None:
    raw = page.get_attribute(f"#{element_id}", "data-value")
    return None if raw in (None, "") else float(raw)


def canvas_pixels(page: Any, canvas_id: str) -> int:
    """How many pixels of a canvas are painted (not transparent)."""
    return int(
        page.evaluate(
            """(id) => {
                const canvas = document.getElementById(id);
                const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
                let painted = 0;
                for (let i = 3; i < data.length; i += 4) if (data[i] > 0) painted += 1;
                return painted;
            }""",
            canvas_id,
        )
    )


def log_in(page: Any, base_url: str, key: str, dataset_id: str) -> None:
    page.goto(f"{base_url}/dashboard")
    page.wait_for_selector("#login-form", state="visible")
    page.fill("#api-key", key)
    page.click("#login-button")
    page.wait_for_selector("#app", state="visible")
    page.select_option("#dataset-select", dataset_id)
    page.wait_for_function(
        "(id) => document.getElementById('dataset-select').value === id"
        " && document.getElementById('eps-remaining').dataset.value !== ''",
        arg=dataset_id,
    )


@pytest.fixture
def world(live_server: LiveServer) -> World:
    return make_world(live_server, budget=RDP_BUDGET)


def test_a_viewer_watches_the_budget_curve_change(world: World, tmp_path: Path) -> None:
    base = world.server.base_url
    ds = world.dataset_id
    before = get_budget(world.viewer, ds)
    with chromium_page(tmp_path / "profile") as (page, log):
        log_in(page, base, key_of(world.viewer), ds)

        # The whole curve and the ε numbers, as the API says.
        assert value_of(page, "eps-remaining") == pytest.approx(before["epsilon_remaining"])
        assert value_of(page, "pure-spent") == 0.0
        assert page.text_content("#binding-alpha") not in ("", "—")
        curve = page.evaluate(
            """() => Chart.getChart('curve-chart').data.datasets.map(
                   d => ({label: d.label, points: d.data.filter(p => p.y !== null).length}))"""
        )
        assert {c["label"] for c in curve} == {"capacity", "spent", "reserved", "remaining"}
        assert all(c["points"] > 0 for c in curve if c["label"] in ("capacity", "remaining")), curve
        assert canvas_pixels(page, "curve-chart") > 2_000
        assert page.locator("#orders-body tr").count() == len(before["orders"]) + 1

        # Polling with If-None-Match: while nothing changes, polls go on and nothing is re-rendered.
        renders = int(page.get_attribute("#curve-chart", "data-renders") or 0)
        polls = int(page.get_attribute("#status", "data-polls") or 0)
        page.wait_for_function(
            "(n) => Number(document.getElementById('status').dataset.polls) >= n", arg=polls + 2
        )
        assert int(page.get_attribute("#curve-chart", "data-renders") or 0) == renders
        assert "304" in (page.text_content("#status") or "")

        # An analyst's request: the page shows the new spend by itself.
        released = world.request(world.analyst, COUNT)
        assert released.status_code == 200, released.text
        after = get_budget(world.viewer, ds)
        assert after["pure"]["spent"] == pytest.approx(0.1)
        page.wait_for_function(
            "(v) => Number(document.getElementById('pure-spent').dataset.value) === v",
            arg=after["pure"]["spent"],
        )
        assert value_of(page, "eps-remaining") == pytest.approx(after["epsilon_remaining"])
        assert value_of(page, "eps-spent") == pytest.approx(after["epsilon_spent"])
        assert int(page.get_attribute("#curve-chart", "data-renders") or 0) > renders
        page.wait_for_function("() => document.querySelectorAll('#ledger-body .tag.commit').length === 1")
        spend = page.evaluate("() => Chart.getChart('spend-chart').data.datasets[0].data.map(p => p.y)")
        assert max(spend) == pytest.approx(0.1)

        # The ledger filters.
        page.select_option("#ledger-event", "commit")
        assert page.locator("#ledger-body tr").count() == 1
        page.select_option("#ledger-event", "")
        page.select_option("#ledger-actor", world.analyst_name)
        assert page.locator("#ledger-body tr").count() == 2  # its reserve and commit
        page.select_option("#ledger-actor", "")

        # A refusal and an open session appear too.
        refused = world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 0.95})
        assert refused.status_code == 409, refused.text
        page.wait_for_function("() => document.getElementById('refusals-count').textContent === '1'")
        assert world.analyst_name in (page.text_content("#refusals-body") or "")
        assert "budget-exhausted" in (page.text_content("#refusals-body") or "")
        opened = world.analyst.post(
            f"/v1/datasets/{ds}/sessions",
            json={
                "mechanism": "above_threshold",
                "params": {
                    "threshold": 300,
                    "epsilon_threshold": 0.02,
                    "max_query_epsilon": 0.02,
                    "max_queries": 5,
                },
            },
        )
        assert opened.status_code == 201, opened.text
        sid = opened.json()["id"]
        page.wait_for_function(
            "(sid) => document.getElementById('sessions-body').textContent.includes(sid)", arg=sid
        )
        page.wait_for_function("() => Number(document.getElementById('pure-reserved').dataset.value) > 0")

        # A Gaussian release has no pure bound: the pure slot becomes ∞ and an order α binds.
        noisy_count = {"query": {"kind": "count"}, "sigma": 10}
        gaussian = world.request(world.analyst, noisy_count, mechanism="gaussian")
        assert gaussian.status_code == 200, gaussian.text
        binding = get_budget(world.viewer, ds)["binding_alpha"]
        assert isinstance(binding, float), binding
        page.wait_for_function(
            "(a) => Number(document.getElementById('binding-alpha').dataset.value) === a", arg=binding
        )
        assert page.text_content("#pure-spent") == "∞"
        line = page.evaluate("() => Chart.getChart('curve-chart').options.plugins.bindingLine.alpha")
        assert line == binding
        page.wait_for_function("() => Chart.getChart('spend-chart').data.datasets.length === 2")

        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        closed = world.analyst.post(f"/v1/sessions/{sid}/close")
        assert closed.status_code == 200, closed.text

        assert log.errors == [], log.errors
        foreign = [u for u in log.urls if not u.startswith(base) and not u.startswith("data:")]
        assert foreign == [], f"the page must work offline; it fetched {foreign}"

    size, colors, top_share = image_stats(shot.read_bytes())
    assert size[0] >= 1000
    assert size[1] >= 800
    assert colors > 64, f"only {colors} distinct colours: a blank screenshot?"
    assert top_share < 0.9, f"one colour covers {top_share:.0%} of the screenshot"
    target = os.environ.get("EXPOST_DASHBOARD_SCREENSHOT")
    if target:
        shutil.copyfile(shot, target)


def test_a_wrong_key_is_refused_and_logout_forgets_the_key(live_server: LiveServer, tmp_path: Path) -> None:
    world = make_world(live_server, budget=RDP_BUDGET)
    with chromium_page(tmp_path / "profile") as (page, log):
        page.goto(f"{world.server.base_url}/dashboard")
        page.fill("#api-key", "xp_not_a_real_key")
        page.click("#login-button")
        page.wait_for_function("() => document.getElementById('login-error').textContent !== ''")
        assert "Unknown or revoked" in (page.text_content("#login-error") or "")
        assert page.is_hidden("#app")
        assert page.evaluate("() => sessionStorage.getItem('expost.apiKey')") is None

        log_in(page, world.server.base_url, key_of(world.viewer), world.dataset_id)
        assert page.evaluate("() => sessionStorage.getItem('expost.apiKey')") == key_of(world.viewer)
        page.reload()  # the key survives a reload of the tab
        page.wait_for_selector("#app", state="visible")
        page.click("#logout")
        page.wait_for_selector("#login-form", state="visible")
        assert page.evaluate("() => sessionStorage.getItem('expost.apiKey')") is None
        # The 401 of the wrong key is the only console error Chromium reports.
        assert all("401" in e for e in log.errors), log.errors


def test_the_delta_share_of_approximate_requests_is_shown(live_server: LiveServer, tmp_path: Path) -> None:
    """A budget with a δ share shows 'δ share used', and an approximate request moves it by itself."""
    world = make_world(live_server, budget={"epsilon": 10.0, "delta": 1e-5, "delta_share": 1e-6})
    plain = make_world(live_server, budget=RDP_BUDGET)
    ops = {"features": {"features": ["age"], "label": "income"}, "lam": 50.0, "epsilon": 1.0, "delta": 1e-7}
    with chromium_page(tmp_path / "profile") as (page, _log):
        log_in(page, world.server.base_url, key_of(world.admin), plain.dataset_id)
        assert page.is_hidden("#delta-ledger")  # no share: nothing about δ-ledgers
        page.select_option("#dataset-select", world.dataset_id)
        page.wait_for_selector("#delta-ledger", state="visible")
        assert value_of(page, "delta-used") == 0.0
        released = world.request(world.analyst, ops, "ptr.ops_linear")
        assert released.status_code == 200, released.text
        used = get_budget(world.viewer, world.dataset_id)["delta_spent"]
        assert used > 0
        page.wait_for_function(
            "(v) => Number(document.getElementById('delta-used').dataset.value) === v", arg=used
        )
        assert (page.text_content("#delta-used") or "").endswith(" of 1e-6")


def open_dashboard(page: Any, base_url: str, key: str) -> str:
    """Log in without picking a dataset; returns the dataset the dashboard opened by itself."""
    page.goto(f"{base_url}/dashboard")
    page.wait_for_selector("#login-form", state="visible")
    page.fill("#api-key", key)
    page.click("#login-button")
    page.wait_for_selector("#app", state="visible")
    page.wait_for_function("() => document.getElementById('eps-remaining').dataset.value !== ''")
    return str(page.eval_on_selector("#dataset-select", "(s) => s.value"))


def test_an_analyst_sees_the_binding_one_of_their_sub_budget_and_the_dataset(
    live_server: LiveServer, tmp_path: Path
) -> None:
    """An analyst whose own sub-budget is tighter than the dataset's sees it as ε remaining, labelled as
    theirs, with both numbers; when the dataset's binds again the page says so by itself. After login the
    dashboard opens the first dataset, then the one last used in this browser."""
    world = make_world(live_server, budget={"epsilon": 5.0, "delta": 0.0})
    first = world.dataset_id
    second = add_dataset(world, CSV, SCHEMA, {"epsilon": 3.0, "delta": 0.0})
    sub_budget = f"/v1/datasets/{first}/analysts/{world.analyst_name}/budget"
    put = world.admin.put(sub_budget, json={"epsilon": 2.0, "delta": 0.0})
    assert put.status_code == 200, put.text
    base = world.server.base_url
    analyst_key = key_of(world.analyst)

    with chromium_page(tmp_path / "profile") as (page, log):
        assert open_dashboard(page, base, analyst_key) == first  # the first dataset, not the last
        # GET /v1/me names the analyst at once: their sub-budget (2, unspent) binds before any request.
        page.wait_for_selector("#own-budget", state="visible")
        page.wait_for_function("() => document.getElementById('eps-remaining').dataset.filter === 'analyst'")
        assert value_of(page, "eps-remaining") == pytest.approx(2.0)

        released = world.request(world.analyst, {"query": {"kind": "count"}, "epsilon": 1.0})
        assert released.status_code == 200, released.text
        dataset_left = get_budget(world.viewer, first)["epsilon_remaining"]
        own_left = get_budget(world.analyst, first, world.analyst_name)["epsilon_remaining"]
        assert own_left < dataset_left  # 1 < 4: the sub-budget binds (the 39.2 against 49.2)
        page.wait_for_function(
            "(v) => Number(document.getElementById('eps-remaining').dataset.value) === v", arg=own_left
        )
        assert page.get_attribute("#eps-remaining", "data-filter") == "analyst"
        assert "your sub-budget" in (page.text_content("#remaining-source") or "")
        assert value_of(page, "own-remaining") == pytest.approx(own_left)
        assert value_of(page, "dataset-remaining") == pytest.approx(dataset_left)
        assert (page.text_content("#own-target") or "") == "ε = 2, δ = 0"
        assert page.get_attribute("#own-budget", "class") == "own-budget binding"

        # The admin raises the sub-budget above the dataset's: the dataset binds, and the page says so.
        put = world.admin.put(sub_budget, json={"epsilon": 10.0, "delta": 0.0})
        assert put.status_code == 200, put.text
        page.wait_for_function("() => document.getElementById('eps-remaining').dataset.filter === 'dataset'")
        assert value_of(page, "eps-remaining") == pytest.approx(dataset_left)
        assert "binding: dataset" in (page.text_content("#remaining-source") or "")
        assert value_of(page, "own-remaining") == pytest.approx(9.0)

        # The second dataset: no sub-budget there, so only the dataset's budget, and a note.
        page.select_option("#dataset-select", second)
        page.wait_for_function(
            "() => document.getElementById('own-note').textContent.includes('No sub-budget')"
        )
        assert page.is_hidden("#own-budget")
        assert page.get_attribute("#eps-remaining", "data-filter") == "dataset"

        # Log out and in again: the dataset last used opens, for this key and for another one.
        page.click("#logout")
        page.wait_for_selector("#login-form", state="visible")
        assert open_dashboard(page, base, analyst_key) == second
        page.click("#logout")
        page.wait_for_selector("#login-form", state="visible")
        assert open_dashboard(page, base, key_of(world.viewer)) == second
        page.select_option("#dataset-select", first)
        page.wait_for_function(
            "(v) => Number(document.getElementById('eps-remaining').dataset.value) === v", arg=dataset_left
        )
        assert page.is_hidden("#own-budget")  # a viewer has no sub-budget of their own
        assert (page.text_content("#own-note") or "") == ""
        assert log.errors == [], log.errors  # no probing request failed


def test_the_dashboard_says_whom_epsilon_protects(live_server: LiveServer, tmp_path: Path) -> None:
    """A row-level dataset: 'each row'; a dataset with a privacy unit: the unit and the bound in force."""
    from tests.integration.test_privacy_units_http import SCHEMA as UNIT_SCHEMA
    from tests.integration.test_privacy_units_http import events_csv

    world = make_world(live_server, budget=RDP_BUDGET)
    unit_dataset = add_dataset(world, events_csv(), UNIT_SCHEMA, RDP_BUDGET)
    with chromium_page(tmp_path / "profile") as (page, _log):
        log_in(page, world.server.base_url, key_of(world.admin), world.dataset_id)
        assert page.text_content("#privacy-unit") == "each row"
        page.select_option("#dataset-select", unit_dataset)
        page.wait_for_function(
            "() => document.getElementById('privacy-unit').textContent.startsWith('each user_id')"
        )
        shown = page.text_content("#privacy-unit") or ""
        assert shown == "each user_id with all its rows (at most 3 per release)"


def test_the_dashboard_marks_individual_accounting(live_server: LiveServer, tmp_path: Path) -> None:
    """A dataset with individual accounting shows the badge and says its totals are a public record, not a
    budget (even once they pass the capacity); an ordinary dataset shows neither."""
    from tests.integration.test_individual_display import COUNT as UNIT_COUNT
    from tests.integration.test_individual_display import thread_count
    from tests.integration.test_individual_http import SCHEMA as INDIVIDUAL_SCHEMA
    from tests.integration.test_individual_http import threads_csv

    world = make_world(live_server, budget=RDP_BUDGET)
    individual = add_dataset(world, threads_csv(), INDIVIDUAL_SCHEMA, {"epsilon": 1.0, "delta": 0.0})
    for thread in (1, 2):  # the totals pass the capacity: each thread's users are fresh
        params = {**UNIT_COUNT, "query": thread_count(thread)}
        body = {"mechanism": "laplace", "params": params}
        released = world.analyst.post(f"/v1/datasets/{individual}/requests", json=body)
        assert released.status_code == 200, released.text
    with chromium_page(tmp_path / "profile") as (page, log):
        log_in(page, world.server.base_url, key_of(world.admin), world.dataset_id)
        assert page.is_hidden("#accounting-badge")
        page.select_option("#dataset-select", individual)
        page.wait_for_function("() => !document.getElementById('accounting-badge').hidden")
        assert page.text_content("#accounting-badge") == "individual accounting"
        assert "each user_id has its own privacy budget" in (
            page.get_attribute("#accounting-badge", "title") or ""
        )
        page.wait_for_function(
            "() => document.getElementById('budget-note').textContent.startsWith('Individual accounting')"
        )
        note = page.text_content("#budget-note") or ""
        assert "each user_id has its own budget" in note
        assert "not a budget" in note
        assert "Exhausted" not in note
        assert "not a budget" in (page.text_content("#remaining-source") or "")
        page.select_option("#dataset-select", world.dataset_id)
        page.wait_for_function("() => document.getElementById('accounting-badge').hidden")
        assert "not a budget" not in (page.text_content("#remaining-source") or "")
        assert log.errors == [], log.errors


OVERFLOW = """() => {
    const header = document.querySelector('header.topbar');
    const outside = [...header.querySelectorAll('*')].filter((node) => {
        const box = node.getBoundingClientRect();
        return box.width > 0 && (box.right > window.innerWidth + 0.5 || box.left < -0.5);
    }).map((node) => node.id || node.tagName);
    return {
        scrollWidth: header.scrollWidth,
        clientWidth: header.clientWidth,
        pageWidth: document.documentElement.scrollWidth,
        outside,
    };
}"""


def test_the_header_fits_a_narrow_screen(live_server: LiveServer, tmp_path: Path) -> None:
    """At 360×740 (a small phone) the header wraps instead of overflowing: before login (the title) and
    after (the dataset selector, the key hint, the log-out button), with a long dataset name."""
    world = make_world(live_server, budget=RDP_BUDGET)
    long_name = add_dataset(world, CSV, SCHEMA, RDP_BUDGET)
    renamed = "quarterly incomes of every region, all years, synthetic"
    with chromium_page(tmp_path / "profile") as (page, log):
        page.set_viewport_size({"width": 360, "height": 740})
        page.goto(f"{world.server.base_url}/dashboard")
        page.wait_for_selector("#login-form", state="visible")
        before = page.evaluate(OVERFLOW)
        assert before["scrollWidth"] <= before["clientWidth"], before
        log_in(page, world.server.base_url, key_of(world.admin), long_name)
        page.evaluate(  # the longest label the selector may show
            "([id, name]) => { document.querySelector(`#dataset-select option[value='${id}']`).textContent ="
            " `${name} (${id}) · archived 2026-12-08`; }",
            [long_name, renamed],
        )
        assert page.is_visible("#logout")
        after = page.evaluate(OVERFLOW)
        assert after["clientWidth"] <= 360, after
        assert after["scrollWidth"] <= after["clientWidth"], after
        assert after["outside"] == [], after
        logout_box = page.locator("#logout").bounding_box()
        assert logout_box is not None
        assert logout_box["x"] + logout_box["width"] <= 360, logout_box
        assert log.errors == [], log.errors


def test_an_archived_dataset_is_marked(live_server: LiveServer, tmp_path: Path) -> None:
    """An archived dataset says so in the selector (with its day) and on its page (a banner and a badge);
    a dataset archived while the page is open is marked once the page re-reads the list."""
    world = make_world(live_server, budget=RDP_BUDGET)
    archived = add_dataset(world, CSV, SCHEMA, RDP_BUDGET)
    later = add_dataset(world, CSV, SCHEMA, RDP_BUDGET)
    done = world.admin.post(f"/v1/datasets/{archived}/archive")
    assert done.status_code == 200, done.text
    archived_at = done.json()["archived_at"]
    with chromium_page(tmp_path / "profile") as (page, log):
        log_in(page, world.server.base_url, key_of(world.viewer), world.dataset_id)
        assert page.is_hidden("#archived-banner")
        assert page.is_hidden("#archived-badge")
        label = page.text_content(f"#dataset-select option[value='{archived}']") or ""
        assert label.endswith(f"({archived}) · archived {archived_at[:10]}"), label
        plain = page.text_content(f"#dataset-select option[value='{world.dataset_id}']") or ""
        assert "archived" not in plain

        page.select_option("#dataset-select", archived)
        page.wait_for_selector("#archived-banner", state="visible")
        assert page.get_attribute("#archived-banner", "data-archived-at") == archived_at
        assert (page.text_content("#archived-banner") or "").startswith("Archived on ")
        assert "no new requests or sessions" in (page.text_content("#archived-banner") or "")
        assert page.is_visible("#archived-badge")
        page.wait_for_function("() => document.getElementById('eps-remaining').dataset.value !== ''")

        # Archived while the page is open: marked within a re-read of the list (every 15 polls, ~30 s).
        page.select_option("#dataset-select", later)
        page.wait_for_selector("#archived-banner", state="hidden")
        now = world.admin.post(f"/v1/datasets/{later}/archive")
        assert now.status_code == 200, now.text
        page.wait_for_selector("#archived-banner", state="visible", timeout=60_000)
        label = page.text_content(f"#dataset-select option[value='{later}']") or ""
        assert label.endswith(f"· archived {now.json()['archived_at'][:10]}"), label
        assert log.errors == [], log.errors
