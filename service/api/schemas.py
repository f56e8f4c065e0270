"""HTTP request and response bodies (pydantic v2)."""

from __future__ import annotations

import math
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    model_validator,
)

from service.auth import Role
from service.errors import PROBLEM_JSON


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ViewModel(BaseModel):
    """A response built from a service view (a dict): the documented members are typed; members a view may
    gain later are passed through (``additionalProperties``) rather than dropped."""

    model_config = ConfigDict(extra="allow")


def clean_amount(value: float) -> float:
    """A budget amount (capacity, spent, reserved, remaining, shortfall) for JSON. The ledger counts in
    fixed-point units of 1e-12 ε (docs/privacy/ledger.md#ledger-arithmetic), so every amount is a whole number
    of units and rounding to 12 decimals recovers it exactly: ``0.1`` rather than the float difference
    ``0.09999999999999998``."""
    return round(value, 12)


Amount = Annotated[
    float,
    PlainSerializer(clean_amount, return_type=float, when_used="json"),
    Field(description="ε, a whole number of the ledger's fixed-point units (1e-12 ε)"),
]


class Infinity(StrEnum):
    """+∞, written as the string "inf" (JSON has no infinity). A normal value, not an error: the loss has no
    proven bound there (e.g. a Gaussian's pure-DP ε, or an order beyond a mechanism's ceiling)."""

    inf = "inf"


class PureSlot(StrEnum):
    """The pure-DP slot of a filter (a constant curve bounds every order), next to the Rényi orders."""

    pure = "pure"


def _infinity(value: Any) -> Any:
    """A float +∞ from a service view becomes ``"inf"`` (pydantic would write it as null)."""
    return Infinity.inf if isinstance(value, float) and value == math.inf else value


Loss = Annotated[Infinity | float, BeforeValidator(_infinity), Field(description='ε ≥ 0, or "inf" for +∞')]
"""A privacy loss in a curve: a number ≥ 0, or ``"inf"`` for +∞."""
AmountLoss = Annotated[
    Infinity | Amount,
    BeforeValidator(_infinity),
    Field(description='ε ≥ 0 (in units of 1e-12 ε), or "inf" for +∞'),
]
"""A spent or reserved total: as ``Loss``, rounded to the ledger's units."""
Slot = Annotated[PureSlot | float, Field(description='a Rényi order α, or "pure" for the pure-DP slot')]


class CurveOut(ViewModel):
    """A Rényi-DP curve: ε(α) at each order of the dataset's grid, and the pure-DP value (a constant curve
    bounds every order). +∞ (the string "inf") where no bound is proven."""

    orders: list[float] = Field(description="the Rényi orders α")
    values: list[Loss] = Field(description="ε(α) at each order, in the same order")
    pure: Loss = Field(description='the pure-DP ε, or "inf" when the mechanism has no pure bound')

    @classmethod
    def stored(cls, curve: dict[str, Any]) -> CurveOut:
        """A curve as the service stores it (``RdpCurve.as_dict``), taken as valid: built without
        validation, which would cost a Python call per value (the ``Loss`` validator)."""
        return cls.model_construct(
            orders=[float(order) for order in curve["orders"]],
            values=[_stored_loss(v) for v in curve["values"]],
            pure=_stored_loss(curve["pure"]),
        )


def _stored_loss(value: Any) -> Any:
    return Infinity.inf if value == "inf" or value == math.inf else float(value)


class InputError(BaseModel):
    field: str = Field(description="the offending field, dotted (e.g. params.epsilon)")
    reason: str


class Problem(BaseModel):
    """Every error: an RFC 9457 problem (``application/problem+json``), with extension members."""

    type: str = Field(examples=["/problems/invalid-input"])
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[InputError] | None = Field(None, description="input errors: each field and its reason")
    model_config = ConfigDict(extra="allow")


def problem_doc(description: str) -> dict[str, Any]:
    """An OpenAPI response whose body is a Problem (the schema is registered by service.app)."""
    return {
        "description": description,
        "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }


# Every error is a problem+json (service.app's handlers), documented as such on every operation in place of
# FastAPI's default 422 HTTPValidationError, which this service never sends.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": problem_doc("Client error: bad input, no or wrong key, not found, conflict or refusal"),
    "5XX": problem_doc("Server error"),
}


class BudgetIn(StrictModel):
    # strict: JSON numbers only (an integer is a number), never a string or a boolean, as in mechanism params
    epsilon: float = Field(strict=True, ge=0, le=1e6, description="target ε of the filter")
    delta: float = Field(strict=True, ge=0, lt=1, description="target δ; 0 makes a pure filter")
    delta_share: float | None = Field(
        default=None,
        strict=True,
        gt=0,
        lt=1,
        description="part of δ set aside for approximate-DP mechanisms (propose-test-release), < delta; "
        "the RDP slots then use delta − delta_share. Once set it may only grow, and delta − delta_share "
        "may never shrink (docs/privacy/approximate.md#approximate-dp)",
    )
    confirm_below_spent: bool = Field(
        default=False,
        strict=True,
        description="required (true) to set a capacity below what is already spent and reserved in every "
        "slot, which leaves the filter unable to admit anything; otherwise such a budget is refused (409)",
    )


class GrantIn(StrictModel):
    analyst: str = Field(min_length=1, max_length=100, description="name of an analyst key")


class KeyIn(StrictModel):
    name: str = Field(min_length=1, max_length=100)
    role: Role


class KeyOut(BaseModel):
    name: str
    role: Role
    prefix: str
    key: str | None = Field(None, description="shown once, at creation")
    revoked_at: datetime | None = Field(None, description="when the key was revoked; null while it works")


class RequestIn(StrictModel):
    mechanism: str = Field(min_length=1, max_length=50, examples=["laplace"])
    params: dict[str, Any] = Field(examples=[{"query": {"kind": "count"}, "epsilon": 0.1}])


class ParquetSourceIn(StrictModel):
    kind: Literal["parquet"]
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="a Parquet file or folder: a path on the server host, or s3://bucket/key (read with the "
        "server's S3 settings)",
    )


class PostgresSourceIn(StrictModel):
    kind: Literal["postgres"]
    dsn: SecretStr = Field(
        description="libpq connection string, used once for the copy: never stored, logged or echoed"
    )
    table: str | None = Field(None, max_length=400, description="`name` or `schema.name`")
    query: str | None = Field(None, max_length=100_000, description="a SELECT (instead of table)")

    @model_validator(mode="after")
    def _one_of(self) -> Self:
        if (self.table is None) == (self.query is None):
            raise ValueError("give exactly one of table and query")
        return self


class RegisterIn(StrictModel):
    name: str = Field(min_length=1, max_length=200)
    schema_: dict[str, Any] = Field(
        alias="schema", description="columns with public bounds, neighbour relation"
    )
    source: Annotated[ParquetSourceIn | PostgresSourceIn, Field(discriminator="kind")]
    model_config = ConfigDict(populate_by_name=True, extra="forbid")


Accounting = Annotated[
    Literal["dataset", "individual"],
    Field(
        description='"dataset": one privacy filter for the whole dataset; "individual": each privacy unit '
        "has its own budget (the dataset's), a release leaves out the units that cannot afford it, and the "
        "dataset's totals are a public record of worst cases, not a budget"
    ),
]
AccountingMeaning = Annotated[
    str | None,
    Field(description="on an individual-accounting dataset, what that means in words; null otherwise"),
]


class DatasetOut(BaseModel):
    id: str
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    n_rows: int | None = Field(description="public only under replace_one neighbouring")
    content_sha256: str | None = Field(
        None, description="hash of the uploaded file (admins only: it is a function of the data)"
    )
    orders: list[float]
    clipped: dict[str, int] | None = Field(
        None,
        description="per column, how many values lay outside the declared bounds and were clipped to them "
        "on load (admins only: it is a function of the data)",
    )
    created_at: datetime
    archived_at: datetime | None = Field(
        None, description="when it was archived (no new requests or sessions since); null while active"
    )
    accounting: Accounting = "dataset"
    accounting_meaning: AccountingMeaning = None
    model_config = ConfigDict(populate_by_name=True)


class SessionIn(StrictModel):
    mechanism: str = Field(min_length=1, max_length=50, examples=["above_threshold"])
    params: dict[str, Any] = Field(
        examples=[{"threshold": 100, "epsilon_threshold": 0.1, "max_query_epsilon": 0.1, "max_queries": 20}]
    )


class SessionOut(BaseModel):
    id: str
    request_id: str = Field(
        description="the id of the session's reservation: its ledger entries carry this request_id"
    )
    dataset_id: str
    analyst: str
    mechanism: str
    params: dict[str, Any]
    state: str = Field(description="open or closed")
    close_reason: str | None = Field(
        description="halted, max_queries, closed (by its analyst), closed_by_admin, key_revoked (its key was "
        "revoked), expired or failed"
    )
    asked: int
    steps: list[dict[str, Any]] = Field(description="the public transcript: each query and its answer")
    worst_case: CurveOut = Field(description="reserved while open")
    realized: CurveOut | None = Field(description="the charge of the actual outcome, once closed")
    created_at: datetime
    expires_at: datetime


class AnswerOut(BaseModel):
    answer: dict[str, Any]
    session: SessionOut


class RequestOut(BaseModel):
    id: str
    dataset_id: str
    analyst: str
    mechanism: str
    params: dict[str, Any]
    state: str
    worst_case: CurveOut = Field(description="reserved at admission (charged in full if the run fails)")
    realized: CurveOut | None = Field(description="the charge of the actual output, once committed")
    release: dict[str, Any] | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = Field(None, description="when a worker started running it")
    elapsed_seconds: float = Field(
        description="seconds since submission, until now while running, else until it was settled"
    )
    progress: float | None = Field(
        None,
        description="fraction done of a long-running mechanism, only when its progress is public "
        "(otherwise only the state and the elapsed time are shown)",
    )
    phase: str | None = Field(
        None,
        description="while state is running: 'queued' (reserved, waiting for a worker; cancelling costs "
        "nothing) or 'running' (a worker started it); null once settled",
    )
    eta_seconds: float | None = Field(
        None,
        description="estimated seconds left, from public quantities only (time since the worker started "
        "it and the public fraction done); null when the progress is not public",
    )
    queue_position: int | None = Field(
        None, description="while queued: how many of your own queued requests are ahead of it"
    )
    cancelled_by: str | None = Field(None, description="who cancelled it (the owner or an admin)")


class LimitsIn(StrictModel):
    max_running_requests: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="requests queued or running on workers at once (null: the service default)",
    )
    max_open_sessions: int | None = Field(
        None, ge=1, le=100_000, description="open interactive sessions at once (null: the service default)"
    )


class LimitsOut(BaseModel):
    analyst: str
    max_running_requests: int = Field(description="the effective limit")
    max_open_sessions: int = Field(description="the effective limit")
    running_requests: int = Field(description="requests queued or running on workers now")
    open_sessions: int
    custom: bool = Field(description="whether an admin set limits for this analyst (else the defaults)")


class RequestPage(BaseModel):
    """One page of ``GET /v1/requests``, newest first."""

    items: list[RequestOut] = Field(description="each as GET /v1/requests/{id} shows it")
    next_after: str | None = Field(
        description="the id to pass as `after` for the next page; null on the last page"
    )


class SessionPage(BaseModel):
    """One page of ``GET /v1/sessions``, newest first."""

    items: list[SessionOut] = Field(description="each as GET /v1/sessions/{id} shows it")
    next_after: str | None = Field(
        description="the id to pass as `after` for the next page; null on the last page"
    )


class KeyRevokedOut(BaseModel):
    """``DELETE /v1/keys/{name}``: every process refuses the key's new requests and sessions from now on (its
    other calls: within the key cache), and its open sessions were closed at the charge of their outcome."""

    name: str
    role: str
    revoked_at: datetime = Field(description="when it was first revoked (revoking again changes nothing)")


class GrantRevokedOut(BaseModel):
    """``DELETE /v1/datasets/{id}/grants/{analyst}``."""

    dataset_id: str
    analyst: str
    revoked: bool = Field(description="false when the analyst had no grant (nothing changed)")


class DatasetArchivedOut(BaseModel):
    """``POST /v1/datasets/{id}/archive``: no new requests or sessions; history and ledger stay."""

    dataset_id: str
    archived_at: datetime = Field(description="when it was first archived (archiving again changes nothing)")
    archived_by: str


class MeOut(BaseModel):
    """The caller: the name and role of the API key that authenticated the request."""

    name: str
    role: Role


class StatusOut(BaseModel):
    status: str = Field(examples=["ok"])


class GrantOut(BaseModel):
    """``POST /v1/datasets/{id}/grants``."""

    dataset_id: str
    analyst: str
    created: bool = Field(description="false when the analyst was already granted (nothing changed)")


# ----- budget, ledger, activity, refusals, estimate, privacy report ---------------------------------------


class BudgetSlotOut(ViewModel):
    """One slot of a filter: a Rényi order (or the pure slot) with its capacity and totals."""

    alpha: Slot
    capacity: Amount | None = Field(
        description="B(α) = ε − log(|A|/δ)/(α−1); null when the order is unusable (B(α) ≤ 0) or no budget "
        "is set"
    )
    spent: AmountLoss = Field(description="the sum of committed charges")
    reserved: AmountLoss = Field(description="worst cases held by running requests and open sessions")
    remaining: Amount | None = Field(description="capacity − spent − reserved (≥ 0); null when unusable")


class BudgetOut(ViewModel):
    """A filter (the dataset's, or an analyst's sub-filter): the target and every slot's totals. A request is
    admitted iff some slot keeps spent + reserved + its worst case within the capacity."""

    dataset_id: str
    scope: Literal["dataset", "analyst"]
    analyst: str | None = Field(description="the analyst of a sub-filter; null for the dataset's")
    epsilon: float | None = Field(description="the target ε; null before a budget is set")
    delta: float | None = Field(description="the target δ; null before a budget is set")
    orders: list[BudgetSlotOut] = Field(description="one row per Rényi order of the dataset")
    pure: BudgetSlotOut = Field(description='the pure-DP slot (alpha = "pure")')
    epsilon_spent: Loss = Field(
        description="the (ε, δ) guarantee of what is spent and reserved so far, as ε at the target δ"
    )
    epsilon_remaining: Amount | None = Field(description="the largest remaining over usable slots")
    binding_alpha: Slot | None = Field(description="the slot with the most remaining; null if none usable")
    budget_set: bool
    delta_share: float | None = Field(
        None, description="δ set aside for approximate-DP mechanisms; null when none is"
    )
    delta_spent: float | None = None
    delta_reserved: float | None = None
    delta_remaining: float | None = None
    accounting: Accounting = "dataset"
    binding: bool = Field(
        True,
        description="whether this filter's spent, reserved and remaining amounts limit what is admitted: "
        "false for the dataset's filter under individual accounting, where each unit's own budget decides "
        "who takes part in a release and these totals (which may exceed the capacity) are a public record "
        "of worst cases; a request is still refused there if its worst case exceeds the capacity itself",
    )
    accounting_meaning: AccountingMeaning = None


class LedgerEntryOut(ViewModel):
    """One ledger entry as stored (its JSON body) with its hashes: ``hash`` = SHA-256(``prev_hash`` + the
    stored body in canonical JSON). The members after the common ones depend on ``event``: ``dataset``
    (name, orders, schema), ``grant``/``revoke`` (analyst), ``budget`` (scope, epsilon, delta, capacity in
    units of 1e-12 ε), ``reserve`` (mechanism, params, scopes, worst_case), ``commit``/``abort`` (realized,
    outcome). Charges are fixed-point: ``{"finite": [units…], "infinite": [0|1…]}`` per slot. Viewers see
    no ``params``."""

    dataset_id: str
    seq: int = Field(description="1, 2, 3… per dataset")
    event: str = Field(
        examples=["reserve"], description="dataset, grant, revoke, budget, reserve, commit or abort"
    )
    actor: str
    request_id: str | None
    at: str = Field(description="when, ISO 8601 (as stored: the hash covers this text)")
    hash: str
    prev_hash: str


class LedgerPage(BaseModel):
    items: list[LedgerEntryOut]
    next_after: int | None = Field(description="the `after` of the next page; null on the last page")


class ActivityRequestOut(ViewModel):
    id: str
    analyst: str
    mechanism: str
    worst_case_pure: Loss = Field(description="its reserved worst case in the pure slot")
    worst_case_binding: Loss | None = Field(description="its reserved worst case at the binding slot")
    since: datetime
    lease_expires_at: datetime | None = Field(
        description="the run's heartbeat deadline; only for mechanisms whose progress is public"
    )


class ActivitySessionOut(ViewModel):
    id: str
    analyst: str
    mechanism: str
    asked: int
    max_queries: int | None
    worst_case_pure: Loss
    worst_case_binding: Loss | None
    since: datetime
    expires_at: datetime


class ActivityOut(ViewModel):
    """What is in flight on a dataset: never a release, an answer, parameters or secret state."""

    dataset_id: str
    binding_alpha: Slot | None
    requests: list[ActivityRequestOut]
    sessions: list[ActivitySessionOut]


class RefusalOut(ViewModel):
    """A refused request or session: what was asked and why it was refused (public information only)."""

    id: int
    dataset_id: str
    analyst: str
    kind: str = Field(description="request or session")
    mechanism: str
    params: dict[str, Any] | None = Field(
        description="the refused request's parameters; null for viewers (they never see parameters)"
    )
    problem_type: str = Field(examples=["/problems/budget-exhausted"])
    filter: str | None = Field(description='"dataset" or "analyst:<name>": the filter that refused')
    binding_alpha: Slot | Literal["delta"] | None = Field(
        description='the closest order, "pure", or "delta" when an approximate-DP request\'s δ share refused'
    )
    requested_pure: Loss | None
    shortfall: Amount | None = Field(description="how much ε was missing at the closest slot")
    detail: str
    created_at: datetime


class RefusalPage(BaseModel):
    items: list[RefusalOut]
    next_after: int | None = Field(description="the `after` of the next page; null on the last page")


class EstimateOut(ViewModel):
    """``:estimate``: would the request be admitted now, and what would it reserve (nothing is charged)."""

    admitted: bool
    worst_case: CurveOut = Field(description="what admission would reserve")
    reason: str | None = Field(None, description="why no filter can answer (e.g. no budget is set)")
    refusal: dict[str, Any] | None = Field(
        None, description="when not admitted: the problem submit would answer (a Problem with per-slot rows)"
    )
    privacy_unit: dict[str, Any] | None = Field(
        None,
        description="on a dataset with a privacy unit: who ε protects (the unit column, each unit with all "
        "its rows) and the bound in force (at most max_rows rows of a unit per release)",
    )
    accounting: Accounting = "dataset"
    accounting_meaning: AccountingMeaning = None


class PrivacyReportOut(ViewModel):
    """``POST /v1/requests/{id}/privacy-report``: a release's per-instance report on the caller's record
    (docs/privacy/objective_perturbation.md#objective-perturbation); charged 0."""

    request_id: str
    mechanism: str
    report_kind: str = Field(description="the report the release was made with")
    charged: float = Field(description="always 0: evaluating a published reporting function is free")
    ex_post_epsilon_upper: float | None = Field(None, description="an upper bound on this record's ex-post ε")
    confidence: float | None = None
    terms: dict[str, float] | None = Field(None, description="the bound's terms")
    personalized_rdp: CurveOut | None = Field(None, description="this record's per-instance Rényi curve")


class MechanismOut(BaseModel):
    """One entry of ``GET /v1/mechanisms``."""

    name: str
    kind: Literal["request", "session"]
    summary: str
    cost_parameter: str | None = Field(None, description="requests: the parameter that sets the cost")
    approximate: bool = Field(
        False, description="an (ε, δ) mechanism, admitted through the δ share (sessions: always false)"
    )
    params_schema: dict[str, Any] = Field(description="the JSON schema of `params`")
    query_schema: dict[str, Any] | None = Field(None, description="sessions: the JSON schema of one query")
    privacy_units: bool = Field(
        False,
        description="runs on a dataset that declares a privacy unit (ε then protects each unit with all its "
        "rows, each release bounded to the unit's max_rows rows); else refused there with a 422",
    )
    individual_accounting: bool = Field(
        False,
        description='runs on a dataset with "accounting": "individual" (each unit charged its own loss, the '
        "units that cannot afford it left out of the release); else refused there with a 422",
    )
