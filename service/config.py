"""Settings from the environment (prefix ``EXPOST_``), via pydantic-settings."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXPOST_", env_file=".env", extra="ignore")

    database_url: str = Field(
        "sqlite:///./var/expost.db", description="SQLAlchemy URL; postgresql+psycopg://… in production"
    )
    data_dir: Path = Field(Path("./var/data"), description="where uploaded datasets are stored")
    wait_seconds: float = Field(10.0, ge=0, description="how long a POST waits for its release before 202")
    max_upload_bytes: int = Field(
        8 * 1024**3, gt=0, description="largest CSV upload (streamed to disk and converted to Parquet)"
    )
    storage_url: str = Field(
        "",
        description="where dataset snapshots (Parquet) are stored: a folder, file:///path, or "
        "s3://bucket/prefix "
        "for an S3-compatible store shared by every host (empty: <data_dir>/snapshots)",
    )
    s3_endpoint_url: str | None = Field(
        None, description="an S3-compatible server (default: AWS_ENDPOINT_URL)"
    )
    s3_region: str | None = Field(None, description="default: AWS_REGION")
    s3_access_key: str | None = Field(None, description="default: AWS_ACCESS_KEY_ID")
    s3_secret_key: str | None = Field(None, description="default: AWS_SECRET_ACCESS_KEY")
    engine: Literal["duckdb", "spark"] = Field(
        "duckdb",
        description="the engine that scans tables above memory_max_rows: duckdb (embedded, out of core) or "
        "spark (a cluster at spark_master)",
    )
    spark_master: str = Field("local[2]", description="Spark master URL when engine=spark")
    engine_threads: int = Field(2, ge=1, description="DuckDB threads per process")
    engine_memory_limit: str = Field("1GB", description="DuckDB memory limit per process (spills beyond)")
    memory_max_rows: int = Field(
        1_000_000,
        ge=0,
        description="tables with at most this many rows are kept in memory (NumPy, the reference engine) and "
        "may run inline; larger ones are scanned by the engine on the executors, never on the writer",
    )
    learner_max_rows: int = Field(
        20_000_000, ge=1, description="learners that hold their columns in memory refuse larger tables"
    )
    max_body_bytes: int = Field(
        1024 * 1024, gt=0, description="largest non-upload (JSON) request body; larger ones get 413"
    )
    worker_threads: int = Field(4, ge=1, description="in-process executor pool size")
    lease_seconds: float = Field(
        300.0,
        gt=0,
        description="a claimed request whose worker sent no heartbeat for this long is reaped (worst case "
        "charged); the lease starts when a worker claims the request, never while it waits in the queue",
    )
    poll_seconds: float = Field(
        1.0,
        gt=0,
        description="an idle worker thread looks for queued requests in the database this often (wake-ups "
        "from the API make it react at once; the poll picks up work queued by other or restarted processes)",
    )
    max_queue_seconds: float = Field(
        3600.0,
        gt=0,
        description="a request no worker claimed within this time is aborted without charge (its data was "
        "never read)",
    )
    max_running_requests_per_analyst: int = Field(
        32,
        ge=1,
        description="default limit on an analyst's requests queued or running on workers at once (admins "
        "set per-analyst limits); over it a submission gets 429",
    )
    max_claimed_per_analyst: int = Field(
        3,
        ge=0,
        description="most requests of one analyst that workers run at once, across the deployment (the "
        "rest wait in the queue, so one analyst cannot hold every worker); 0: no limit",
    )
    max_open_sessions_per_analyst: int = Field(
        16,
        ge=1,
        description="default limit on an analyst's open interactive sessions (admins set per-analyst "
        "limits); over it an open gets 429",
    )
    shutdown_grace_seconds: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM, running requests may finish for this long; then they are stopped and "
        "charged their worst case (their data was read), and the process exits",
    )
    reaper_interval_seconds: float = Field(15.0, gt=0)
    inline_mechanisms: set[str] = Field(
        {"laplace", "gaussian"},
        description="run in the request thread once the reservation commits (no executor hop)",
    )
    session_ttl_seconds: float = Field(3600.0, gt=0, description="an open session closes itself after this")
    auth_cache_seconds: float = Field(5.0, ge=0, description="how long a verified API key is cached")
    pool_size: int = Field(10, ge=1)
    executor: Literal["inprocess", "queue"] = Field(
        "inprocess",
        description="inprocess: a thread pool in each API process; queue: a Dramatiq task queue served by "
        "`expost worker` processes (on any machine sharing the database and the broker)",
    )
    broker_url: str = Field("redis://127.0.0.1:6379/0", description="the task queue's Redis URL")
    queue_name: str = Field(
        "expost",
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="the deployment's queue: the Dramatiq queue name, and the requests in the database that "
        "its workers claim (requests admitted under another name are left to that deployment's workers)",
    )
    heartbeat_seconds: float = Field(
        1.0, ge=0, description="long-running runs renew their lease at most this often (via progress)"
    )
    rate_limit: str = Field(
        "6000/minute;300/second",
        description="per API key, per process (`limits` notation, ';'-separated); empty disables it",
    )
    rate_limit_reports: str = Field(
        "60/minute", description="stricter per-key limit for POST /v1/requests/{rid}/privacy-report"
    )
    rate_limit_failed_auth: str = Field(
        "30/minute",
        description="per client address: requests answered 401 (unknown, malformed or revoked keys); over it "
        "the address gets 429 except for keys this process accepted recently; empty disables it",
    )
    rate_limit_storage: str = Field(
        "memory://", description="`limits` storage URI: memory:// (per process) or redis://… (shared)"
    )
    header_timeout_seconds: float = Field(
        10.0,
        ge=0,
        description="a connection whose request head (request line and headers) is not complete this long "
        "after it opened, or after its previous response, is closed (slow or half-open clients); 0: never",
    )
    log_json: bool = False
    log_level: str = "INFO"
    direct_submit: bool = Field(
        True,
        description="answer `POST …/requests` through its direct route (service/api/direct.py) when the "
        "request needs none of the FastAPI route's error paths; false sends every submission through the "
        "FastAPI route (same responses, ≈ 0.8 ms more CPU each). Off whenever opentelemetry is on",
    )
    opentelemetry: bool = Field(
        False,
        description="FastAPI's OpenTelemetry spans and metrics (needs a configured OpenTelemetry provider); "
        "off by default: /metrics serves expost's Prometheus metrics, and the bridge checks the providers "
        "on every request",
    )


@lru_cache
def get_settings() -> Settings:
    return Settings()
