from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Query, Request, Response, UploadFile

from service import datasets
from service.api.deps import Admin, AnyRole, RuntimeDep, SessionDep
from service.api.problems import json_failure
from service.api.schemas import (
    BudgetIn,
    BudgetOut,
    DatasetArchivedOut,
    DatasetOut,
    GrantIn,
    GrantOut,
    GrantRevokedOut,
    LedgerPage,
    ParquetSourceIn,
    RegisterIn,
)
from service.auth import Principal, Role, validate_name
from service.data.ingest import csv_to_parquet, parquet_to_snapshot, postgres_to_snapshot
from service.data.storage import s3_filesystem
from service.errors import Forbidden, InvalidInput, NotFound, PayloadTooLarge
from service.filter.budget import budget_view
from service.filter.ledger import canonical_json
from service.runs import admin as actions
from service.runs import views
from service.runs.admission import accounting_description
from service.runs.views import DATASET_SCOPE, Dataset, LedgerEntry

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])


def _out(dataset: Dataset, principal: Principal) -> DatasetOut:
    return DatasetOut(
        id=dataset.id,
        name=dataset.name,
        schema_=dataset.schema_json,
        n_rows=dataset.n_rows
        if datasets.public_context(dataset).n_rows is not None or principal.is_admin
        else None,
        content_sha256=dataset.content_sha256 if principal.is_admin else None,
        orders=dataset.orders,
        clipped=dataset.clipped if principal.is_admin else None,
        created_at=dataset.created_at,
        archived_at=dataset.archived_at,
        **accounting_description(datasets.public_context(dataset).schema),
    )


def _accounting(dataset: Dataset, scope: str) -> dict[str, Any]:
    """A budget view's accounting members: under individual accounting the dataset's filter is not
    ``binding`` (each unit's own budget decides; its totals are a public record), an analyst's still is."""
    described = accounting_description(datasets.public_context(dataset).schema)
    individual = described["accounting"] == "individual"
    return described | {"binding": not (individual and scope == DATASET_SCOPE)}


def _schema_text(schema: str | UploadFile, limit: int) -> str:
    """The schema part as text: a form field (``curl -F 'schema=<schema.json'``) or an uploaded file
    (``curl -F schema=@schema.json``), UTF-8 either way."""
    if isinstance(schema, str):
        return schema
    raw = schema.file.read(limit + 1)
    if len(raw) > limit:
        raise PayloadTooLarge("schema", f"larger than the limit of {limit} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput("schema", json_failure(exc) or "not valid UTF-8") from None


@router.post(
    "",
    status_code=201,
    operation_id="createDataset",
    summary="Upload a CSV dataset with its public schema (admins see how many values each column clipped)",
)
def create_dataset(
    runtime: RuntimeDep,
    admin: Admin,
    file: Annotated[UploadFile, File(description="the CSV, with a header row")],
    schema_part: Annotated[
        str | UploadFile,
        Form(
            alias="schema",
            description="JSON: columns with public bounds, and the neighbour relation; a text field or an "
            "uploaded file (`-F schema=@schema.json`)",
        ),
    ],
    name: Annotated[str | None, Form()] = None,
) -> DatasetOut:
    limit = runtime.settings.max_upload_bytes
    schema = datasets.parse_schema(_schema_json(schema_part))
    name = name or file.filename or "dataset"
    datasets.check_name(name)
    work = runtime.settings.data_dir / "work"
    source = datasets.upload_csv(file.file, limit, work)  # this route runs in a worker thread, not the loop
    try:
        progress = datasets.IngestProgress(name)
        ingested = datasets.ingest(
            lambda: csv_to_parquet(source, schema, work, progress), runtime.tables.store
        )
    finally:
        source.unlink(missing_ok=True)
    dataset = actions.record_dataset(runtime.sessions, name, schema, ingested, admin.name)
    return _out(dataset, admin)


def _schema_json(schema_part: str | UploadFile) -> Any:
    try:
        return json.loads(_schema_text(schema_part, SCHEMA_LIMIT))
    except (ValueError, RecursionError) as exc:  # syntax, nesting depth, an integer of 4300+ digits
        raise InvalidInput("schema", json_failure(exc) or "not valid JSON") from None


SCHEMA_LIMIT = 16 * 1024 * 1024
"""Largest schema part of an upload."""


@router.post(
    "/register",
    status_code=201,
    operation_id="registerDataset",
    summary="Register a dataset by reference (a Parquet file or folder, a PostgreSQL table or query): its "
    "rows are validated, clipped and copied once into an immutable snapshot",
)
def register_dataset(body: RegisterIn, runtime: RuntimeDep, admin: Admin) -> DatasetOut:
    schema = datasets.parse_schema(body.schema_)
    datasets.check_name(body.name)
    work = runtime.settings.data_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    source = body.source
    if isinstance(source, ParquetSourceIn):
        settings = runtime.settings
        filesystem = (
            s3_filesystem(settings.s3_endpoint_url, settings.s3_region, settings.s3_access_key,
                          settings.s3_secret_key)
            if source.path.startswith("s3://")
            else None
        )  # fmt: skip
        ingested = datasets.ingest(
            lambda: parquet_to_snapshot(
                source.path, schema, work, filesystem, datasets.IngestProgress(body.name)
            ),
            runtime.tables.store,
        )
    else:
        dsn = source.dsn.get_secret_value()  # used for this copy only: never stored, logged or echoed
        ingested = datasets.ingest(
            lambda: postgres_to_snapshot(
                dsn,
                schema,
                work,
                table=source.table,
                query=source.query,
                progress=datasets.IngestProgress(body.name),
            ),
            runtime.tables.store,
        )
    dataset = actions.record_dataset(runtime.sessions, body.name, schema, ingested, admin.name)
    return _out(dataset, admin)


@router.get(
    "", operation_id="listDatasets", summary="Datasets visible to the caller (analysts: only granted ones)"
)
def list_datasets(session: SessionDep, who: AnyRole) -> list[DatasetOut]:
    return [_out(d, who) for d in views.visible_datasets(session, who)]


@router.get("/{dataset_id}", operation_id="getDataset", summary="One dataset's public metadata")
def get_dataset(dataset_id: str, session: SessionDep, who: AnyRole) -> DatasetOut:
    return _out(datasets.visible_dataset(session, who, dataset_id), who)


@router.post(
    "/{dataset_id}/grants",
    status_code=201,
    operation_id="grantAnalyst",
    summary="Grant an analyst key access",
)
def grant(dataset_id: str, body: GrantIn, runtime: RuntimeDep, admin: Admin) -> GrantOut:
    created = actions.grant(runtime.sessions, admin, dataset_id, body.analyst)
    return GrantOut(dataset_id=dataset_id, analyst=body.analyst, created=created)


@router.get("/{dataset_id}/grants", operation_id="listGrants", summary="Analysts granted on this dataset")
def list_grants(dataset_id: str, session: SessionDep, admin: Admin) -> list[str]:
    return views.grants(session, admin, dataset_id)


@router.delete(
    "/{dataset_id}/grants/{analyst}",
    operation_id="revokeGrant",
    summary="Revoke an analyst's grant (their sub-filter, history and the ledger stay)",
)
def revoke_grant(dataset_id: str, analyst: str, runtime: RuntimeDep, admin: Admin) -> GrantRevokedOut:
    revoked = actions.revoke_grant(runtime.sessions, admin, dataset_id, analyst)
    return GrantRevokedOut(dataset_id=dataset_id, analyst=analyst, revoked=revoked)


@router.post(
    "/{dataset_id}/archive",
    operation_id="archiveDataset",
    summary="Archive a dataset: no new requests or sessions (running ones finish; nothing is deleted)",
)
def archive_dataset(dataset_id: str, runtime: RuntimeDep, admin: Admin) -> DatasetArchivedOut:
    row = actions.archive(runtime.sessions, admin, dataset_id)
    assert row.archived_at is not None
    return DatasetArchivedOut(
        dataset_id=row.id, archived_at=row.archived_at, archived_by=row.archived_by or admin.name
    )


def _set_budget(
    runtime: RuntimeDep, admin: Principal, dataset_id: str, scope: str, body: BudgetIn
) -> dict[str, Any]:
    target = actions.BudgetTarget(body.epsilon, body.delta, body.delta_share, body.confirm_below_spent)
    view = actions.set_budget(runtime.sessions, admin, dataset_id, scope, target)
    with runtime.sessions() as session:
        return view | _accounting(datasets.visible_dataset(session, admin, dataset_id), scope)


@router.put(
    "/{dataset_id}/budget",
    operation_id="setBudget",
    response_model=BudgetOut,
    summary="Set the dataset's (ε, δ) budget (δ = 0: pure filter)",
)
def put_budget(dataset_id: str, body: BudgetIn, runtime: RuntimeDep, admin: Admin) -> dict[str, Any]:
    return _set_budget(runtime, admin, dataset_id, DATASET_SCOPE, body)


@router.put(
    "/{dataset_id}/analysts/{analyst}/budget",
    operation_id="setAnalystBudget",
    response_model=BudgetOut,
    summary="Set an analyst's sub-budget",
)
def put_analyst_budget(
    dataset_id: str, analyst: str, body: BudgetIn, runtime: RuntimeDep, admin: Admin
) -> dict[str, Any]:
    return _set_budget(runtime, admin, dataset_id, validate_name(analyst, "analyst"), body)


def _budget_response(
    session: SessionDep, who: Principal, dataset_id: str, scope: str, request: Request, response: Response
) -> Any:
    dataset = datasets.visible_dataset(session, who, dataset_id)
    flt = views.filter_of(session, dataset_id, scope)
    if flt is None:
        raise NotFound(f"analyst {scope!r} has no grant on dataset {dataset_id}")
    body = budget_view(flt, dataset.orders) | _accounting(dataset, scope)
    etag = '"' + hashlib.sha256(canonical_json(body).encode()).hexdigest()[:32] + '"'
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    response.headers["ETag"] = etag
    return body


@router.get(
    "/{dataset_id}/budget",
    operation_id="getBudget",
    response_model=BudgetOut,
    responses={304: {"description": "unchanged since the ETag sent in If-None-Match"}},
    summary="Spent, reserved and remaining budget per order (ETag)",
)
def get_budget(
    dataset_id: str, request: Request, response: Response, session: SessionDep, who: AnyRole
) -> Any:
    return _budget_response(session, who, dataset_id, DATASET_SCOPE, request, response)


@router.get(
    "/{dataset_id}/analysts/{analyst}/budget",
    operation_id="getAnalystBudget",
    response_model=BudgetOut,
    responses={304: {"description": "unchanged since the ETag sent in If-None-Match"}},
    summary="An analyst's sub-filter (ETag)",
)
def get_analyst_budget(
    dataset_id: str, analyst: str, request: Request, response: Response, session: SessionDep, who: AnyRole
) -> Any:
    if who.role is Role.analyst and who.name != analyst:
        raise Forbidden("analysts can read only their own sub-budget")
    return _budget_response(session, who, dataset_id, validate_name(analyst, "analyst"), request, response)


def _ledger_item(entry: LedgerEntry, who: Principal) -> dict[str, Any]:
    """One entry as stored, with its hashes. Viewers do not see request parameters (the ``params`` of
    reserve entries); the hash still covers the whole stored body."""
    body = json.loads(entry.body)
    if who.role is Role.viewer:
        body.pop("params", None)
    return {**body, "hash": entry.hash, "prev_hash": entry.prev_hash}


@router.get(
    "/{dataset_id}/ledger",
    operation_id="getLedger",
    response_model=LedgerPage,
    summary="Ledger entries in order (analysts: their own requests; viewers: without parameters)",
)
def get_ledger(
    dataset_id: str,
    session: SessionDep,
    who: AnyRole,
    after: Annotated[int, Query(ge=0, le=2**62, description="return entries with seq > after")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    entries = views.ledger_page(session, who, dataset_id, after, limit)
    items = [_ledger_item(e, who) for e in entries]
    next_after = entries[-1].seq if len(entries) == limit else None
    return {"items": items, "next_after": next_after}
