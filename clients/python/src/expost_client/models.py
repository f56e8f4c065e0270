"""Response models: lenient (unknown fields are kept) copies of the server's response bodies.

The server's own schemas pull in its database layer, so the client keeps these copies; every model has
``raw``, the JSON object exactly as received.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from expost_client.errors import BudgetExhaustedError, error_from_problem

__all__ = [
    "AnalysisRequest",
    "Answer",
    "ApiKey",
    "ApiModel",
    "Budget",
    "BudgetSlot",
    "Curve",
    "Dataset",
    "Estimate",
    "ExpostTimeoutError",
    "Grant",
    "LedgerPage",
    "Limits",
    "Loss",
    "Me",
    "MechanismInfo",
    "PrivacyReport",
    "RecordBound",
    "RequestPage",
    "Session",
    "SessionPage",
    "Slot",
]

Loss = float | str  # a loss in ε units: a number, or "inf"
Slot = float | str  # an order α, or "pure"


class ApiModel(BaseModel):
    """A response body; unknown fields are kept, and ``raw`` is the JSON exactly as received."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @classmethod
    def from_json(cls: type[M], data: Any) -> M:
        model = cls.model_validate(data)
        model._raw = data if isinstance(data, dict) else {}
        return model

    @property
    def raw(self) -> dict[str, Any]:
        return self._raw


M = TypeVar("M", bound=ApiModel)


class ApiKey(ApiModel):
    name: str
    role: str
    prefix: str
    key: str | None = None
    revoked_at: datetime | None = None  # set once revoked (GET /v1/keys lists revoked keys too)


class Me(ApiModel):
    """The caller (``GET /v1/me``)."""

    name: str
    role: str


class Dataset(ApiModel):
    id: str
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    n_rows: int | None = None
    content_sha256: str | None = None  # admins only
    orders: list[float]
    clipped: dict[str, int] | None = None  # admins only: values clipped to the bounds, per column
    created_at: datetime
    archived_at: datetime | None = None  # set once archived (no new requests or sessions)
    # Newer servers: "individual" when each privacy unit has its own budget (then said in words).
    accounting: str = "dataset"
    accounting_meaning: str | None = None


class Grant(ApiModel):
    dataset_id: str
    analyst: str
    created: bool


class Curve(ApiModel):
    """A Rényi curve in ε units: ``values[i]`` at ``orders[i]``, and the pure (α = ∞) bound."""

    orders: list[float]
    values: list[Loss]
    pure: Loss


class BudgetSlot(ApiModel):
    alpha: Slot
    capacity: float | None
    spent: Loss
    reserved: Loss
    remaining: float | None


class Budget(ApiModel):
    dataset_id: str
    scope: str
    analyst: str | None = None
    epsilon: float | None = None
    delta: float | None = None
    orders: list[BudgetSlot]
    pure: BudgetSlot
    epsilon_spent: Loss
    epsilon_remaining: float | None = None
    binding_alpha: Slot | None = None
    budget_set: bool
    delta_share: float | None = Field(default=None, description="δ set aside for approximate-DP mechanisms")
    delta_spent: float = 0.0
    delta_reserved: float = 0.0
    delta_remaining: float | None = None
    # Newer servers: under individual accounting the dataset's totals are a public record, not a budget
    # (binding False): each unit's own budget decides who takes part in a release.
    accounting: str = "dataset"
    binding: bool = True
    accounting_meaning: str | None = None
    etag: str | None = Field(default=None, exclude=True, description="the response's ETag")


class AnalysisRequest(ApiModel):
    id: str
    dataset_id: str
    analyst: str
    mechanism: str
    params: dict[str, Any]
    state: str
    worst_case: Curve
    realized: Curve | None = None
    release: dict[str, Any] | None = None
    error: str | None = None
    created_at: datetime
    updated_at: datetime
    # Newer servers: the fraction done (only when the mechanism's progress is public) and the timing.
    progress: float | None = None
    elapsed_seconds: float | None = None  # since submission: until now while running, else until settled
    started_at: datetime | None = None
    # Newer servers: queued (waiting for a worker, cancellable for free) or running; ETA from public data.
    phase: str | None = None
    eta_seconds: float | None = None
    queue_position: int | None = None
    cancelled_by: str | None = None


class Limits(ApiModel):
    analyst: str
    max_running_requests: int
    max_open_sessions: int
    running_requests: int
    open_sessions: int
    custom: bool


class Estimate(ApiModel):
    admitted: bool
    worst_case: Curve
    refusal: dict[str, Any] | None = None
    reason: str | None = None
    privacy_unit: dict[str, Any] | None = None
    accounting: str = "dataset"
    accounting_meaning: str | None = None

    @property
    def refusal_error(self) -> BudgetExhaustedError | None:
        """The refusal the request would get now, as the exception ``submit`` would raise."""
        if self.refusal is None:
            return None
        error = error_from_problem(int(self.refusal.get("status", 409)), self.refusal)
        return error if isinstance(error, BudgetExhaustedError) else None


class Session(ApiModel):
    id: str
    request_id: str | None = None  # newer servers: its reservation's id, which its ledger entries carry
    dataset_id: str
    analyst: str
    mechanism: str
    params: dict[str, Any]
    state: str
    close_reason: str | None = None
    asked: int
    steps: list[dict[str, Any]]
    worst_case: Curve
    realized: Curve | None = None
    created_at: datetime
    expires_at: datetime


class Answer(ApiModel):
    answer: dict[str, Any]
    session: Session

    @property
    def above(self) -> bool:
        return bool(self.answer.get("above"))


class MechanismInfo(ApiModel):
    name: str
    kind: str
    summary: str
    cost_parameter: str | None = None
    approximate: bool = False
    params_schema: dict[str, Any]
    query_schema: dict[str, Any] | None = None
    privacy_units: bool = False
    individual_accounting: bool = False  # runs on a dataset with individual accounting


class RecordBound(ApiModel):
    """``adaops.ridge``: the bounds for the record as a member of the training data or as an outsider."""

    ex_post: Loss
    pdp_epsilon: Loss
    mu_upper: Loss | None = None
    residual_upper: Loss | None = None


class PrivacyReport(ApiModel):
    """A release's per-instance privacy report evaluated on the caller's own record (charged nothing),
    holding with probability ≥ ``confidence``. Its shape depends on the mechanism: ``objpert.logistic``
    gives ``ex_post_epsilon_upper``, ``terms`` and the record's Rényi curve ``personalized_rdp``;
    ``adaops.ridge`` gives ``member`` and ``outsider`` bounds, ``pdp_delta`` and ``lambda_release_loss``.
    The fields another mechanism does not send are None (``raw`` has the body as received)."""

    request_id: str
    mechanism: str
    report_kind: str
    charged: float
    confidence: float | None = None
    # objpert.logistic
    ex_post_epsilon_upper: Loss | None = None
    terms: dict[str, Loss] | None = None
    personalized_rdp: Curve | None = None
    # adaops.ridge
    member: RecordBound | None = None
    outsider: RecordBound | None = None
    pdp_delta: float | None = None
    lambda_release_loss: Loss | None = None

    @property
    def epsilon_upper(self) -> Loss | None:
        """The report's headline bound on this record's ex-post ε, whichever the mechanism: objective
        perturbation's ``ex_post_epsilon_upper``, or AdaOPS's larger of the member and outsider bounds."""
        if self.ex_post_epsilon_upper is not None:
            return self.ex_post_epsilon_upper
        sides = [side.ex_post for side in (self.member, self.outsider) if side is not None]
        if not sides:
            return None
        return "inf" if "inf" in sides else max(float(v) for v in sides)


class LedgerPage(ApiModel):
    items: list[dict[str, Any]]
    next_after: int | None = None


class RequestPage(ApiModel):
    """One page of ``GET /v1/requests``, newest first; ``next_after`` is the ``after`` of the next page."""

    items: list[AnalysisRequest]
    next_after: str | None = None


class SessionPage(ApiModel):
    """One page of ``GET /v1/sessions``, newest first; ``next_after`` is the ``after`` of the next page."""

    items: list[Session]
    next_after: str | None = None


class ExpostTimeoutError(TimeoutError):
    """A 202-accepted request was still running when the client stopped waiting (it keeps running)."""

    def __init__(self, request: AnalysisRequest, waited: float) -> None:
        super().__init__(f"request {request.id} still {request.state} after {waited:.1f}s")
        self.request = request
        self.request_id = request.id
