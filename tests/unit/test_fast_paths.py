"""The throughput shortcuts pinned against what they replaced: ``json_text`` (orjson) parses back like
``json.dumps``; structlog lines written straight to expost's handler are still one redacted JSON object
each, honour the configured level and never interleave with standard-library lines; ``_out``
(``model_construct``, no validation) serializes byte for byte like the validated ``RequestOut``."""

from __future__ import annotations

import io
import json
import logging
import math
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest
import structlog

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve
from service import logs
from service.api.routers.requests import _out
from service.api.schemas import RequestOut
from service.runs import requests as lifecycle
from service.store.engine import json_text
from service.store.models import AnalysisRequest, RequestState

# ----- (a) json_text -------------------------------------------------------------------------------------


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """Nested dicts and lists of floats, 64-bit ints, strings (non-ASCII too), booleans and None."""
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-12, 12)
    if kind == 1:
        return rng.randint(-(2**63), 2**63 - 1)
    if kind == 2:
        return "".join(rng.choice('aé€"\\\n\t/ 0😀') for _ in range(rng.randrange(6)))
    if kind == 3:
        return rng.choice([True, False, None, 0.0, -0.0, 1e-7, 5e-324, 1.7976931348623157e308])
    if kind == 4:
        return rng.random()
    if kind in (5, 6):
        return {f"k{i}é": random_value(rng, depth + 1) for i in range(rng.randrange(5))}
    return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]


class TestJsonText:
    def test_nested_values_parse_back_to_the_same_value_as_json_dumps(self) -> None:
        rng = random.Random(20261126)
        for _ in range(500):
            value = {"root": random_value(rng)}
            text = json_text(value)
            assert json.loads(text) == json.loads(json.dumps(value)) == value

    def test_a_stored_curve_and_release_parse_back(self) -> None:
        curve = RdpCurve(DEFAULT_ORDERS, tuple(0.1 * a for a in DEFAULT_ORDERS), math.inf).as_dict()
        value = {"curve": curve, "release": {"value": 123.456789, "rows": [1, 2.5, "x"]}}
        assert json.loads(json_text(value)) == value
        assert json.loads(json_text(value))["curve"]["pure"] == "inf"

    @pytest.mark.parametrize(
        "value",
        [
            {"big": 2**64},
            {"negative": -(2**63) - 1},
            {"nested": [1, {"x": 10**30}]},
            {1: "int key"},
            {"outer": {2.5: "float key", None: "none key"}},
        ],
    )
    def test_what_orjson_refuses_falls_back_to_json_dumps(self, value: Any) -> None:
        assert json_text(value) == json.dumps(value)
        assert json.loads(json_text(value)) == json.loads(json.dumps(value))

    def test_the_largest_64_bit_integers_stay_exact(self) -> None:
        for number in (2**63 - 1, -(2**63), 2**64 - 1):
            assert json.loads(json_text({"n": number})) == {"n": number}

    @pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
    def test_nan_and_infinities_are_written_as_null(self, special: float) -> None:
        text = json_text({"x": special, "list": [1.0, special]})
        assert json.loads(text) == {"x": None, "list": [1.0, None]}
        assert "NaN" not in text
        assert "Infinity" not in text


# ----- (b) logging ----------------------------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Whatever logging setup the test process had, back after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    config = structlog.get_config()
    output = (logs._OUTPUT.handler, logs._OUTPUT.render, logs._OUTPUT.level)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)
    logs._OUTPUT.handler, logs._OUTPUT.render, logs._OUTPUT.level = output


def json_lines(buf: io.StringIO) -> list[dict[str, Any]]:
    text = buf.getvalue()
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.usefixtures("restore_logging")
class TestLogs:
    def test_a_structlog_line_is_one_redacted_json_object(self) -> None:
        buf = io.StringIO()
        logs.configure_logging("INFO", True, stream=buf)
        structlog.get_logger("expost.test").info(
            "released", value=3, Release={"value": 1.5}, api_key="sk-secret", request_id="rq_1", count=7
        )
        (line,) = json_lines(buf)
        assert line["event"] == "released"
        assert line["value"] == logs.REDACTED
        assert line["Release"] == logs.REDACTED  # matched case-insensitively
        assert line["api_key"] == logs.REDACTED
        assert (line["request_id"], line["count"]) == ("rq_1", 7)
        assert line["level"] == "info"
        assert line["logger"] == "expost.test"
        assert "sk-secret" not in buf.getvalue()
        assert "1.5" not in buf.getvalue()

    def test_a_dataclass_is_logged_as_its_repr_and_numpy_scalars_as_numbers(self) -> None:
        """A field hidden from ``repr`` stays out of the line (orjson would write every field)."""

        @dataclass
        class Handle:
            name: str
            secret_part: str = field(repr=False)

        buf = io.StringIO()
        logs.configure_logging("INFO", True, stream=buf)
        structlog.get_logger("expost.test").info("handle", handle=Handle("h1", "s3cr3t"), n=np.float64(1.5))
        (line,) = json_lines(buf)
        assert "s3cr3t" not in buf.getvalue()
        assert "h1" in line["handle"]
        assert line["n"] == 1.5

    def test_a_stdlib_line_goes_to_the_same_stream_as_json(self) -> None:
        buf = io.StringIO()
        logs.configure_logging("INFO", True, stream=buf)
        stdlib = logging.getLogger("expost.test.stdlib")  # not uvicorn's: servers started by other tests
        stdlib.setLevel(logging.NOTSET)  # of this worker set uvicorn's levels
        stdlib.info("stdlib line")
        (line,) = json_lines(buf)
        assert line["event"] == "stdlib line"
        assert line["level"] == "info"

    def test_a_logger_obtained_before_a_reconfiguration_follows_the_new_level(self) -> None:
        first = io.StringIO()
        logs.configure_logging("INFO", True, stream=first)
        log = structlog.get_logger("expost.cached")
        log.info("before")  # first use: the bound logger is cached at INFO
        assert [line["event"] for line in json_lines(first)] == ["before"]
        second = io.StringIO()
        logs.configure_logging("WARNING", True, stream=second)
        log.info("dropped")
        log.debug("dropped too")
        log.warning("kept")
        assert [line["event"] for line in json_lines(second)] == ["kept"]
        assert [line["event"] for line in json_lines(first)] == ["before"]  # the old stream is left alone

    def test_a_logger_cached_at_warning_writes_info_again_after_lowering_the_level(self) -> None:
        first = io.StringIO()
        logs.configure_logging("WARNING", True, stream=first)
        log = structlog.get_logger("expost.cached.warning")
        log.warning("cached")
        second = io.StringIO()
        logs.configure_logging("INFO", True, stream=second)
        log.info("after lowering")
        assert [line["event"] for line in json_lines(second)] == ["after lowering"]

    def test_threads_interleaved_with_stdlib_lines_write_only_complete_lines(self) -> None:
        buf = io.StringIO()
        logs.configure_logging("INFO", True, stream=buf)
        threads, per_thread, stdlib_every = 8, 500, 5
        barrier = threading.Barrier(threads)

        def write(t: int) -> None:
            log = structlog.get_logger("expost.threads")
            stdlib = logging.getLogger("expost.stdlib")
            barrier.wait()
            for i in range(per_thread):
                log.info("structlog line", thread=t, i=i, padding="x" * (i % 97))
                if i % stdlib_every == 0:
                    stdlib.info("stdlib line %d %d", t, i)

        workers = [threading.Thread(target=write, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        lines = json_lines(buf)  # every line parses: none was cut or interleaved
        ours = [line for line in lines if line["event"] == "structlog line"]
        stdlib = [line for line in lines if line["event"].startswith("stdlib line")]
        stdlib_count = threads * len(range(0, per_thread, stdlib_every))
        assert len(lines) == threads * per_thread + stdlib_count
        assert len(stdlib) == stdlib_count
        assert sorted((line["thread"], line["i"]) for line in ours) == [
            (t, i) for t in range(threads) for i in range(per_thread)
        ]
        assert {line["event"] for line in stdlib} == {
            f"stdlib line {t} {i}" for t in range(threads) for i in range(0, per_thread, stdlib_every)
        }


# ----- (c) _out (model_construct) against the validated RequestOut ------------------------------------------

CREATED = datetime(2026, 11, 26, 5, 0, 0, 123456, tzinfo=UTC)
WORST: dict[str, Any] = {"curve": RdpCurve(DEFAULT_ORDERS, tuple(0.1 for _ in DEFAULT_ORDERS), 0.1).as_dict()}
GAUSSIAN: dict[str, Any] = {
    "curve": RdpCurve(DEFAULT_ORDERS, tuple(0.02 * a for a in DEFAULT_ORDERS), math.inf).as_dict()
}
# As an older row or another writer could hold it: integer values and orders, float and string infinities.
MIXED: dict[str, Any] = {"curve": {"orders": [2, 4, 8.0], "values": [1, "inf", math.inf], "pure": 0}}
INTEGERS: dict[str, Any] = {"curve": {"orders": [2, 3], "values": [0, 5], "pure": math.inf}}


def row(**overrides: Any) -> AnalysisRequest:
    values: dict[str, Any] = {
        "id": "rq_test",
        "kind": "request",
        "dataset_id": "ds_test",
        "analyst": "alice",
        "mechanism": "laplace",
        "params": {"query": {"kind": "count"}, "epsilon": 0.1},
        "fingerprint": "f" * 64,
        "idempotency_key": None,
        "state": RequestState.COMMITTED.value,
        "scopes": ["__dataset__", "alice"],
        "worst_case": WORST,
        "realized": WORST,
        "release": {"value": 101.37491727, "rows": 200},
        "error": None,
        "created_at": CREATED,
        "updated_at": CREATED + timedelta(milliseconds=2),
        "lease_expires_at": None,
        "lease_owner": None,
        "started_at": CREATED,
        "progress": None,
        "cancelled_by": None,
        "queue": None,
    }
    values.update(overrides)
    return AnalysisRequest(**values)


def validated(request: AnalysisRequest, out: RequestOut, queue_position: int | None) -> RequestOut:
    """The pre-b5a6dc9 construction: every field validated; the clock-dependent fields taken from ``out``."""
    return RequestOut(
        id=request.id,
        dataset_id=request.dataset_id,
        analyst=request.analyst,
        mechanism=request.mechanism,
        params=request.params,
        state=request.state,
        worst_case=request.worst_case["curve"],
        realized=request.realized["curve"] if request.realized else None,
        release=request.release,
        error=request.error,
        created_at=request.created_at,
        updated_at=request.updated_at,
        started_at=request.started_at,
        elapsed_seconds=out.elapsed_seconds,
        progress=lifecycle.public_progress(request),
        phase=lifecycle.phase(request),
        eta_seconds=out.eta_seconds,
        queue_position=queue_position,
        cancelled_by=request.cancelled_by,
    )


CASES: dict[str, dict[str, Any]] = {
    "committed laplace": {},
    "committed gaussian (pure inf)": {"mechanism": "gaussian", "worst_case": GAUSSIAN, "realized": GAUSSIAN},
    "committed, mixed curve": {"worst_case": MIXED, "realized": MIXED},
    "committed, integer curve": {"worst_case": INTEGERS, "realized": INTEGERS, "release": {"value": 3}},
    "queued": {"state": RequestState.RUNNING.value, "realized": None, "release": None, "started_at": None},
    "running dp_gd with progress": {
        "mechanism": "dp_gd",
        "state": RequestState.RUNNING.value,
        "realized": None,
        "release": None,
        "lease_owner": "worker-1",
        "progress": 0.25,
        "started_at": datetime.now(UTC) - timedelta(seconds=3),
    },
    "running, state as enum": {"state": RequestState.RUNNING, "realized": None, "release": None},
    "failed": {
        "state": RequestState.FAILED_CHARGED.value,
        "realized": MIXED,
        "release": None,
        "error": "the mechanism failed; its worst case was charged",
    },
    "aborted by its owner": {
        "state": RequestState.ABORTED.value,
        "realized": None,
        "release": None,
        "error": "cancelled before a worker started it; nothing was charged",
        "cancelled_by": "alice",
    },
}


class TestOut:
    @pytest.mark.parametrize("case", list(CASES))
    @pytest.mark.parametrize("queue_position", [None, 3])
    def test_constructed_and_validated_serialize_byte_for_byte_alike(
        self, case: str, queue_position: int | None
    ) -> None:
        request = row(**CASES[case])
        out = _out(request, queue_position)
        full = validated(request, out, queue_position)
        assert out.model_dump_json() == full.model_dump_json()
        assert out.model_dump(mode="json") == full.model_dump(mode="json")
        dumped = out.model_dump(mode="json")
        again = RequestOut.model_validate(dumped)  # the JSON is itself a valid RequestOut
        assert again.model_dump_json() == out.model_dump_json()

    def test_infinities_are_the_string_inf_and_integers_floats(self) -> None:
        body = json.loads(_out(row(worst_case=MIXED, realized=INTEGERS)).model_dump_json())
        assert body["worst_case"] == {"orders": [2.0, 4.0, 8.0], "values": [1.0, "inf", "inf"], "pure": 0.0}
        assert body["realized"]["pure"] == "inf"
        text = _out(row(worst_case=MIXED, realized=INTEGERS)).model_dump_json()
        assert '"values":[1.0,"inf","inf"]' in text
        assert '"orders":[2.0,3.0]' in text

    def test_the_running_views_come_from_the_row(self) -> None:
        started = datetime.now(UTC) - timedelta(seconds=3)
        request = row(**{**CASES["running dp_gd with progress"], "started_at": started})
        out = _out(request, 2)
        assert (out.state, out.phase, out.progress, out.queue_position) == ("running", "running", 0.25, 2)
        assert out.eta_seconds is not None
        assert 8.0 <= out.eta_seconds <= 10.0  # elapsed 3 s at a quarter done: about 9 s left
        assert out.elapsed_seconds >= 0
