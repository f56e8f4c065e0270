"""Per-instance privacy reports of committed releases
(docs/privacy/objective_perturbation.md#objective-perturbation): evaluate a release's
reporting function.

``privacy_report`` takes a record supplied by the caller, encodes it with the request's public parameters
and the dataset's public schema (the same per-row clipping as training), and evaluates the reporting
function published with the release (``mechanisms.per_instance.reports.evaluate_report``). It never reads the
dataset, never charges, and returns nothing computed from the data beyond the stored DP release: the
answer is a deterministic function of (release, request parameters, schema, record). True per-record
losses (``mechanisms.per_instance.reports.exact_ex_post_loss``) are not reachable from here: they depend
on the data (Redberg 2023, thesis ch. 2).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import ValidationError
from sqlalchemy.orm import Session

from mechanisms.base import ParamsError, PublicContext
from mechanisms.data.schema import CategoricalColumn, IntColumn
from mechanisms.learners.features import design_matrix
from mechanisms.learners.objective_perturbation import ObjPertLogisticParams
from mechanisms.per_instance import adaops
from mechanisms.per_instance.reports import evaluate_report
from service.auth import Principal
from service.datasets import dataset_by_id, public_context
from service.errors import Conflict, InvalidInput, NotFound
from service.runs.requests import get_visible
from service.store.models import RequestState

REPORTING_MECHANISMS = frozenset({"objpert.logistic", "adaops.ridge"})


def _encode(value: Any, column: Any, field: str) -> float | int:
    """One cell, validated and clipped to the declared bounds exactly as ``mechanisms.data.table`` does."""
    if isinstance(column, CategoricalColumn):
        if not isinstance(value, str) or value not in column.values:
            raise InvalidInput(field, f"must be one of the declared values {list(column.values)!r}")
        return column.values.index(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(field, "must be a finite number")
    try:
        number = float(value)
    except OverflowError:
        raise InvalidInput(field, "must be a finite number") from None
    if not math.isfinite(number):
        raise InvalidInput(field, "must be a finite number")
    if isinstance(column, IntColumn) and number != math.floor(number):
        raise InvalidInput(field, "must be an integer")
    return min(max(number, float(column.min)), float(column.max))


def privacy_report(
    session: Session, principal: Principal, request_id: str, record: dict[str, Any]
) -> dict[str, Any]:
    """Evaluate the reporting function of request ``request_id``'s release on ``record`` (charged 0)."""
    request = get_visible(session, principal, request_id)
    if request.mechanism not in REPORTING_MECHANISMS:
        raise Conflict(f"mechanism {request.mechanism!r} publishes no per-instance privacy report")
    if request.state != RequestState.COMMITTED or request.release is None:
        raise Conflict("the request has no committed release")
    dataset = dataset_by_id(session, request.dataset_id)
    if dataset is None:
        raise NotFound(f"no request {request_id!r}")
    ctx = public_context(dataset)
    if request.mechanism == "adaops.ridge":
        return _adaops_report(request.id, request.params, request.release, ctx, record)
    try:
        params = ObjPertLogisticParams.model_validate(request.params)
    except ValidationError:  # stored params were validated at submission; defensive
        raise Conflict("the stored request parameters are not readable") from None
    if params.report == "none":
        raise Conflict("this release was made with report = none: it has no reporting function")
    table = _record_table(ctx, [*params.features, params.label], record)
    x, y = design_matrix(params, ctx, table, "classification", row_norm=params.row_norm)
    result = evaluate_report(params, request.release, x, y, ctx.orders)[0]
    return {
        "request_id": request.id,
        "mechanism": request.mechanism,
        "report_kind": params.report,
        "charged": 0.0,
        **result,
    }


def _record_table(ctx: PublicContext, needed: list[str], record: dict[str, Any]) -> dict[str, np.ndarray]:
    """The caller's record as a one-row table, validated and clipped like the training data."""
    unknown = sorted(set(record) - set(needed))
    if unknown:
        raise InvalidInput(f"record.{unknown[0]}", "not a feature or the label of this request")
    table: dict[str, np.ndarray] = {}
    for name in needed:
        if name not in record:
            raise InvalidInput(f"record.{name}", "missing")
        column = ctx.schema.column(name)
        assert column is not None
        table[name] = np.asarray([_encode(record[name], column, f"record.{name}")])
    return table


def _adaops_report(
    request_id: str,
    stored: dict[str, Any],
    release: dict[str, Any],
    ctx: PublicContext,
    record: dict[str, Any],
) -> dict[str, Any]:
    """``adaops.ridge``: the reporting function of ``mechanisms.per_instance.adaops.evaluate_report`` (public
    or data-dependent family, as chosen at submission; both cost 0 here: the data-dependent statistics were
    charged with the release)."""
    try:
        params = adaops.AdaOpsRidgeParams.model_validate(stored)
        pl = adaops.ADAOPS_RIDGE.plan_for(params, ctx)
    except (ValidationError, ParamsError):  # validated at submission; defensive (an older contract)
        raise Conflict("the stored request parameters are not readable") from None
    if not release.get("released"):
        raise Conflict("the release is ⊥ (no model): there is nothing to report on")
    spec = params.features
    table = _record_table(ctx, [*spec.features, spec.label], record)
    x, y = design_matrix(spec, ctx, table, "regression", row_norm=1.0)
    result = adaops.evaluate_report(pl, release, x, y, params.report_rho)[0]
    return {
        "request_id": request_id,
        "mechanism": "adaops.ridge",
        "report_kind": params.report,
        "charged": 0.0,
        **result,
    }
