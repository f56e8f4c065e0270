"""AboveThreshold sessions: the first query whose noisy value crosses a threshold, with ex-post charges.

Three interactive mechanisms (``InteractiveMechanism`` in ``mechanisms.base``) and their batch forms
(``Mechanism``). Documentation, theorems and the interleaving argument: docs/mechanisms/above_threshold.md.
Notation and conventions: Ghazi, Kamath, Knop, Kumar, Manurangsi, Zhang 2024, "Private hyperparameter tuning
with ex-post guarantee", §3 (geometric distributions), Algorithms 1–2, Theorems 8–10.

``above_threshold`` (Ghazi et al. Algorithm 1, geometric noise)
    Integer queries f_i with ℓ1 sensitivity ≤ 1 (a count, or a sum over an int column whose shift is ≤ 1).
    ``start`` draws the secret threshold noise k ~ Geom_{e^{−ε′}} on {0, 1, …}; step i draws
    y_i ~ Geom_{e^{−ε_i}} and halts with the gap f_i(D) − T + y_i − k ≥ 0 at the first crossing.
    Charge (pure, ex-post): 2ε_i + ε′ for a halt at i (Theorem 8), ε_i + ε′ when every query is monotone
    (Theorem 9, established here from the query kind and the neighbour relation), ε′ for no crossing (⊥).
``above_threshold.dropping`` (Ghazi et al. Algorithm 2, random dropping, known threshold)
    Candidate i is the Laplace release o_i = f_i(D) + Lap(Δ_i/ε_i) (pure ε_i-DP), run only if it is *kept*,
    which happens with probability e^{−ε_i·k} for the secret k ~ Geom_{e^{−ε′}} drawn at start. The session
    halts with o_i at the first kept candidate with o_i ≥ threshold. Charge: 2ε_i + ε′ at a halt
    (Theorem 10), ε′ for ⊥.
``above_threshold.laplace`` (classic AboveThreshold, Dwork & Roth 2014 Alg. 1 / Thm. 3.23; Lyu, Su & Li
2017 Alg. 1 with c = 1)
    Noisy threshold T + Lap(2Δ/ε) drawn at start, query noise Lap(4Δ/ε) per step, halt at the first
    f_i(D) + ν_i ≥ T + ρ (only the index is released). Charge: ε at a halt, ε/2 for ⊥.

Secret state (never released): the latent k (or the noisy threshold) and the step counter. Answers are
``{"above": False, "index": i}`` until the halt ``{"above": True, "index": i, ...}`` (``gap`` for the
geometric session, ``value`` for the dropping session, nothing more for the Laplace session); indices are
0-based. A session also halts, without an above answer, after ``max_queries`` queries.

Samplers (docs/privacy.md §10, finite precision): every draw is exact and comes from ``Noise`` (the OS
CSPRNG). Geom_{e^{−ε}} on {0, 1, …} is folded from one discrete Laplace draw Z of scale t = 1/ε rounded up
(``dyadic_scale_up``): Z if Z ≥ 0, else −Z − 1 (P ∝ e^{−z/t}(1 + e^{−1/t}), a geometric law). The drop step
is an exact Bernoulli(exp(−ε̂_i·k)) with ε̂_i the candidate's own rational pure level. Dropping candidates
are released on their public grid (as ``mechanisms.queries.laplace``); the classic Laplace session compares
integers on a grid (round(f/γ) + ν ≥ round(T/γ) + ρ with discrete Laplace ρ, ν). Rounding the scales up
makes each actual parameter ≤ the charged one, and every theorem's charge is increasing in its parameters,
so the charges below are unchanged (the derivation is in docs/mechanisms/above_threshold.md §8).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Annotated, Any, ClassVar, Generic, Self, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve, pad_up, sum_up
from mechanisms.base import ParamsChecked, ParamsError, PublicContext, Release, StepResult, Table
from mechanisms.data.schema import MAX_EXACT_INT, IntColumn
from mechanisms.noise import Grid, Noise, dyadic_scale_up, laplace_grid
from mechanisms.queries.language import (
    RANGE_BITS,
    AnyQuery,
    CountQuery,
    GridPlan,
    HistogramQuery,
    Query,
    SumQuery,
    charged_fraction,
    evaluate,
    evaluate_units,
    is_integer_valued,
    l1,
    laplace_plan,
    shifts,
    unit_shift,
)
from mechanisms.queries.language import check_query as check_query_on_schema

MAX_QUERIES = 10_000
MIN_EPSILON = 1e-9
"""Smallest ε accepted anywhere here: keeps ⌊E/ε⌋ finite and far from float overflow."""
MAX_EPSILON = 100.0

Epsilon = Annotated[float, Field(strict=True, ge=MIN_EPSILON, le=MAX_EPSILON, allow_inf_nan=False)]
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Steps = list[tuple[dict[str, Any], dict[str, Any]]]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ----- samplers (shared by the sessions and the statistical audit) ----------------------------------------
def geometric_scale(epsilon: float) -> Fraction:
    """t = 1/ε rounded up to a cheap dyadic rational: Geom_{e^{−1/t}} has parameter 1/t ≤ ε (the charged
    decimal of ε, ``charged_fraction``)."""
    return dyadic_scale_up(1 / charged_fraction(epsilon))


def geometric_array(noise: Noise, epsilon: float, size: int) -> np.ndarray:
    """``size`` exact draws of Geom_{e^{−1/t}} on {0, 1, …} (int64), t = ``geometric_scale(ε)``.

    Folding a discrete Laplace Z (P(z) ∝ e^{−|z|/t}): Y = Z for Z ≥ 0, −Z − 1 for Z < 0. Then
    P(Y = y) ∝ e^{−y/t} + e^{−(y+1)/t} = (1 + e^{−1/t})·e^{−y/t}, i.e. P(Y = y) = (1 − e^{−1/t})·e^{−y/t}.
    """
    z = np.asarray(noise.discrete_laplace(geometric_scale(epsilon), size)).astype(np.int64)
    result: np.ndarray = np.where(z >= 0, z, -z - 1)
    return result


def geometric(noise: Noise, epsilon: float) -> int:
    """One exact draw of Geom_{e^{−1/t}} on {0, 1, …}, t = ``geometric_scale(ε)`` (parameter ≤ ε)."""
    return int(geometric_array(noise, epsilon, 1)[0])


def kept_array(noise: Noise, level: Fraction, k: np.ndarray | Sequence[int]) -> np.ndarray:
    """The drop step per row: True with probability exactly exp(−level·k_j) (level ≥ 0 rational, k_j ≥ 0).

    exp(−level·k) = exp(−w)·exp(−r/q) with w + r/q = level·k and q the denominator of level: two exact
    Bernoulli(exp(−·)) draws per row (Canonne, Kamath, Steinke 2020, Algorithm 1), both always drawn.
    """
    rate = Fraction(level)
    if rate < 0 or rate.denominator > 1 << 52:
        raise ValueError("the drop rate must be ≥ 0 with a denominator ≤ 2^52")
    numerators = np.asarray(k, dtype=object) * rate.numerator
    whole = numerators // rate.denominator
    rest = numerators - whole * rate.denominator
    if whole.size and (int(whole.min()) < 0 or int(whole.max()) >= 1 << 62):
        raise OverflowError("the drop exponent is outside the exact sampler's range")
    size = whole.size
    draws = noise.bernoulli_exp_neg(
        np.concatenate([whole.astype(np.int64), rest.astype(np.int64)]),
        np.concatenate([np.ones(size, dtype=np.int64), np.full(size, rate.denominator, dtype=np.int64)]),
    )
    result: np.ndarray = draws[:size] & draws[size:]
    return result


def kept(noise: Noise, level: Fraction, k: int) -> bool:
    """One drop step: True with probability exactly exp(−level·k) (``kept_array`` of one row)."""
    return bool(kept_array(noise, level, [k])[0])


def candidate_level(plan: GridPlan, scale: Fraction) -> Fraction:
    """The exact pure level M/t of a grid Laplace candidate (M its ℓ1 sensitivity in grid units): ≤ ε_i."""
    return Fraction(plan.l1_units) / scale


# ----- exact AboveThreshold comparisons on a grid (classic and Ligett et al.'s interactive form) ------------
THRESHOLD_CLAMP = 1 << 62
"""round(T/γ) is clamped to ±2^62 (a public map): answers are ≤ 2^44 units and noise far below 2^62."""


@dataclass(frozen=True)
class ThresholdGrid:
    """The public grid of a Laplace AboveThreshold: γ (the largest 2^k ≤ 2^-10·Δ), M = the largest change
    of round(f/γ) for a query of sensitivity ≤ Δ (``unit_shift``), and the discrete Laplace scales
    t₁ ≥ 2M/ε (threshold) and t₂ ≥ 4M/ε (queries) in grid units."""

    grid: Grid
    max_units: int
    threshold_scale: Fraction
    query_scale: Fraction

    @classmethod
    def build(cls, max_sensitivity: float, epsilon: float) -> ThresholdGrid:
        grid = laplace_grid(max_sensitivity, 1, integer_valued=False)
        units = unit_shift(max_sensitivity, grid, exact=False)
        eps = charged_fraction(epsilon)
        return cls(grid, units, dyadic_scale_up(2 * units / eps), dyadic_scale_up(4 * units / eps))

    def threshold_units(self, threshold: float) -> int:
        """round(T/γ), exactly (rational arithmetic), clamped to ±2^62."""
        scaled = round(Fraction(threshold) / Fraction(self.grid.granularity))
        return min(max(scaled, -THRESHOLD_CLAMP), THRESHOLD_CLAMP)

    def value_units(self, value: float) -> int:
        """round(v/γ) of a computed real answer, clamped to ±2^44 units (as ``evaluate_units``)."""
        limit = Fraction(1 << RANGE_BITS)
        scaled = Fraction(value) / Fraction(self.grid.granularity)
        return round(min(max(scaled, -limit), limit))

    def scales(self) -> tuple[float, float]:
        """(threshold scale, query scale) in value units: t₁·γ ≥ 2Δ/ε and t₂·γ ≥ 4Δ/ε (exact floats)."""
        gamma = Fraction(self.grid.granularity)
        return float(self.threshold_scale * gamma), float(self.query_scale * gamma)


def _draw(noise: Noise, scale: Fraction) -> int:
    return int(noise.discrete_laplace(scale, 1)[0])


# ----- charges -----------------------------------------------------------------------------------------
def _charge(terms: Sequence[float], orders: Sequence[float]) -> RdpCurve:
    """The pure curve of Σ terms, rounded up (so the ledger's decimal is ≥ the exact sum)."""
    return RdpCurve.from_pure(pad_up(sum_up(terms)), orders)


def is_monotone(query: AnyQuery, ctx: PublicContext) -> bool:
    """True iff ``query`` never decreases when a row is added (Ghazi et al. Theorem 9's ⪰ = dataset size).

    Only under ``add_remove`` (under ``replace_one`` neighbours are not ordered): counts, with any where
    (the selection is row-wise, so adding a row never deselects another), and sums over int columns whose
    declared min is ≥ 0 (the added row contributes a clipped value ≥ 0 or nothing).
    """
    if ctx.schema.neighboring != "add_remove":
        return False
    if isinstance(query, CountQuery):
        return True
    if isinstance(query, SumQuery):
        column = ctx.schema.column(query.column)
        return isinstance(column, IntColumn) and column.min >= 0
    return False


def _scalar_query(query: AnyQuery, ctx: PublicContext) -> float:
    """Schema checks, scalar output, and the ℓ1 sensitivity derived from the public schema."""
    check_query_on_schema(query, ctx)
    if isinstance(query, HistogramQuery):
        raise ParamsError("query", "needs a scalar query (count, sum or mean), not a histogram")
    return l1(shifts(query, ctx))


# ----- parameter models ----------------------------------------------------------------------------------
class QueryParams(_Frozen):
    """One step of a geometric or dropping session."""

    query: Query
    epsilon: Epsilon | None = Field(
        default=None, description="ε_i of this query (≤ the session's max_query_epsilon; default: that max)"
    )


class LaplaceQueryParams(_Frozen):
    """One step of a Laplace session (the noise is fixed by the session's ε and max_sensitivity)."""

    query: Query


class GeometricSessionParams(_Frozen):
    threshold: StrictInt = Field(ge=-MAX_EXACT_INT, le=MAX_EXACT_INT, description="public integer threshold")
    epsilon_threshold: Epsilon = Field(description="ε′ of the threshold noise k ~ Geom(e^{−ε′})")
    max_query_epsilon: Epsilon = Field(description="largest ε_i a query may use (sets the worst case)")
    max_queries: StrictInt = Field(ge=1, le=MAX_QUERIES, description="the session halts after this many")
    require_monotone: StrictBool = Field(
        default=False, description="accept only monotone queries (add_remove datasets) and charge ε_i + ε′"
    )


class DroppingSessionParams(_Frozen):
    threshold: FiniteFloat = Field(description="public threshold on the released Laplace value")
    epsilon_threshold: Epsilon = Field(description="ε′ of the latent k ~ Geom(e^{−ε′})")
    max_query_epsilon: Epsilon = Field(description="largest ε_i a candidate may use (sets the worst case)")
    max_queries: StrictInt = Field(ge=1, le=MAX_QUERIES, description="the session halts after this many")


class LaplaceSessionParams(_Frozen):
    threshold: FiniteFloat = Field(description="public threshold T")
    epsilon: Epsilon = Field(description="total pure ε: ε/2 for the threshold noise, ε/2 for the queries")
    max_sensitivity: StrictFloat = Field(
        default=1.0, gt=0, le=1e12, allow_inf_nan=False, description="Δ: the largest ℓ1 sensitivity allowed"
    )
    max_queries: StrictInt = Field(ge=1, le=MAX_QUERIES, description="the session halts after this many")


def _check_batch_epsilons(queries: Sequence[QueryParams], max_queries: int, max_epsilon: float) -> None:
    if len(queries) > max_queries:
        raise ValueError(f"{len(queries)} queries, but max_queries is {max_queries}")
    for index, item in enumerate(queries):
        if item.epsilon is not None and item.epsilon > max_epsilon:
            raise ValueError(f"queries.{index}.epsilon exceeds max_query_epsilon")


class GeometricBatchParams(GeometricSessionParams):
    """A whole geometric session in one request: the session fields plus the query list."""

    queries: tuple[QueryParams, ...] = Field(min_length=1, max_length=MAX_QUERIES)

    @model_validator(mode="after")
    def _fits_session(self) -> Self:
        _check_batch_epsilons(self.queries, self.max_queries, self.max_query_epsilon)
        return self


class DroppingBatchParams(DroppingSessionParams):
    """A whole dropping session in one request (the candidate list is fixed before k is drawn)."""

    queries: tuple[QueryParams, ...] = Field(min_length=1, max_length=MAX_QUERIES)

    @model_validator(mode="after")
    def _fits_session(self) -> Self:
        _check_batch_epsilons(self.queries, self.max_queries, self.max_query_epsilon)
        return self


class LaplaceBatchParams(LaplaceSessionParams):
    """A whole Laplace session in one request."""

    queries: tuple[LaplaceQueryParams, ...] = Field(min_length=1, max_length=MAX_QUERIES)

    @model_validator(mode="after")
    def _fits_session(self) -> Self:
        if len(self.queries) > self.max_queries:
            raise ValueError(f"{len(self.queries)} queries, but max_queries is {self.max_queries}")
        return self


# ----- shared session machinery --------------------------------------------------------------------------
ModelT = TypeVar("ModelT", bound=BaseModel)
SessionP = TypeVar("SessionP", bound=BaseModel)
StepQ = TypeVar("StepQ", bound=BaseModel)
BatchP = TypeVar("BatchP", bound=BaseModel)


def _check_asked(asked: int, max_queries: int) -> None:
    if asked < 0:
        raise ValueError("asked must be ≥ 0")
    if asked >= max_queries:
        raise ParamsError("max_queries", f"the session has already answered its {max_queries} queries")


def _query_epsilon(query: QueryParams, max_epsilon: float) -> float:
    """ε_i of a step: the query's own, or the session's max_query_epsilon when omitted."""
    return max_epsilon if query.epsilon is None else query.epsilon


def _check_epsilon(query: QueryParams, max_epsilon: float) -> None:
    if query.epsilon is not None and query.epsilon > max_epsilon:
        raise ParamsError("epsilon", f"{query.epsilon!r} exceeds the session's max_query_epsilon")


def _scalar_value(query: AnyQuery, ctx: PublicContext, table: Table) -> float:
    values, _ = evaluate(query, ctx, table)
    return float(values[0])


def _transcript(steps: Steps, model: type[ModelT], max_queries: int) -> tuple[list[ModelT], bool]:
    """The queries of a public transcript and whether its last answer is an above answer (a halt).

    Raises ValueError on a transcript no session can produce (too long, answers after a halt, wrong
    indices), so a corrupted record is never charged below its true cost silently.
    """
    if len(steps) > max_queries:
        raise ValueError("the transcript is longer than max_queries")
    queries: list[ModelT] = []
    above = False
    for index, (query, answer) in enumerate(steps):
        if above:
            raise ValueError("the transcript continues after an above answer")
        flag = answer.get("above")
        if not isinstance(flag, bool) or answer.get("index") != index:
            raise ValueError(f"step {index} is not an AboveThreshold answer")
        above = flag
        queries.append(model.model_validate(query))
    return queries, above


class AboveThresholdSession(ParamsChecked, ABC, Generic[SessionP, StepQ]):
    """What the three sessions share: the JSON secret-state layout and its validation.

    State: ``{"mechanism": name, <secret_key>: secret, "asked": n, "halted": bool}``; the secret is the
    latent k (int ≥ 0) or the noisy threshold in grid units (int). It never appears in answers, charges or
    error messages.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    params_model: ClassVar[type[BaseModel]]
    query_model: ClassVar[type[BaseModel]]
    batch_params_model: ClassVar[type[BaseModel]]
    cost_parameter: ClassVar[str]
    secret_key: ClassVar[str]

    def _new_state(self, secret: int, asked: int, halted: bool) -> dict[str, Any]:
        return {"mechanism": self.name, self.secret_key: secret, "asked": asked, "halted": halted}

    @abstractmethod
    def check(self, params: SessionP, ctx: PublicContext) -> None: ...

    @abstractmethod
    def worst_case(self, params: SessionP, ctx: PublicContext) -> RdpCurve: ...

    @abstractmethod
    def check_query(self, params: SessionP, ctx: PublicContext, query: StepQ, asked: int) -> None: ...

    @abstractmethod
    def start(self, params: SessionP, ctx: PublicContext, noise: Noise) -> dict[str, Any]: ...

    @abstractmethod
    def step(
        self,
        params: SessionP,
        ctx: PublicContext,
        state: dict[str, Any],
        query: StepQ,
        table: Table,
        noise: Noise,
    ) -> StepResult: ...

    @abstractmethod
    def realized(self, params: SessionP, ctx: PublicContext, steps: Steps, halted: bool) -> RdpCurve: ...

    def _read_state(self, state: dict[str, Any]) -> tuple[Any, int]:
        """(secret, asked) of a live session; ValueError (without the secret) if invalid or halted."""
        expected = {"mechanism", self.secret_key, "asked", "halted"}
        if not isinstance(state, dict) or set(state) != expected or state["mechanism"] != self.name:
            raise ValueError(f"not a {self.name} session state")
        secret, asked, halted = state[self.secret_key], state["asked"], state["halted"]
        if isinstance(secret, bool) or not isinstance(secret, int):
            raise ValueError(f"not a {self.name} session state")
        # the latent k is ≥ 0; a noisy threshold in grid units is any integer (an old float state is refused)
        valid_secret = secret >= 0 or self.secret_key != "k"
        if not valid_secret or isinstance(asked, bool) or not isinstance(asked, int) or asked < 0:
            raise ValueError(f"not a {self.name} session state")
        if halted is not False:
            raise ValueError("the session has halted")
        return secret, asked


class GeometricAboveThreshold(AboveThresholdSession[GeometricSessionParams, QueryParams]):
    """Ghazi et al. Algorithm 1: one-sided geometric noise on integer, sensitivity-≤1 queries."""

    name: ClassVar[str] = "above_threshold"
    summary: ClassVar[str] = (
        "AboveThreshold session with geometric noise on integer counts/sums (Ghazi et al. Alg. 1): "
        "pure ex-post 2ε_i + ε′ at a halt (ε_i + ε′ if monotone), ε′ if nothing crosses."
    )
    params_model: ClassVar[type[BaseModel]] = GeometricSessionParams
    query_model: ClassVar[type[BaseModel]] = QueryParams
    batch_params_model: ClassVar[type[BaseModel]] = GeometricBatchParams
    cost_parameter: ClassVar[str] = "max_query_epsilon"
    secret_key: ClassVar[str] = "k"

    def check(self, p: GeometricSessionParams, ctx: PublicContext) -> None:
        if p.require_monotone and ctx.schema.neighboring != "add_remove":
            reason = "monotone queries exist only on add_remove datasets (replace_one pairs are unordered)"
            raise ParamsError("require_monotone", reason)

    def worst_case(self, p: GeometricSessionParams, ctx: PublicContext) -> RdpCurve:
        eps, eps_threshold = p.max_query_epsilon, p.epsilon_threshold
        return _charge((eps, eps_threshold) if p.require_monotone else (eps, eps, eps_threshold), ctx.orders)

    def check_query(self, p: GeometricSessionParams, ctx: PublicContext, q: QueryParams, asked: int) -> None:
        self.check(p, ctx)
        _check_asked(asked, p.max_queries)
        _check_epsilon(q, p.max_query_epsilon)
        sensitivity = _scalar_query(q.query, ctx)
        integer = isinstance(q.query, CountQuery) or (
            isinstance(q.query, SumQuery) and isinstance(ctx.schema.column(q.query.column), IntColumn)
        )
        if not integer:
            raise ParamsError("query", "needs an integer-valued query: a count, or a sum over an int column")
        if sensitivity > 1.0:
            raise ParamsError("query", f"needs ℓ1 sensitivity ≤ 1, this query has {sensitivity:g} here")
        if p.require_monotone and not is_monotone(q.query, ctx):
            reason = "require_monotone: only counts and sums over int columns with min ≥ 0 are monotone"
            raise ParamsError("query", reason)

    def start(self, p: GeometricSessionParams, ctx: PublicContext, noise: Noise) -> dict[str, Any]:
        return self._new_state(geometric(noise, p.epsilon_threshold), 0, False)

    def step(
        self,
        p: GeometricSessionParams,
        ctx: PublicContext,
        state: dict[str, Any],
        q: QueryParams,
        table: Table,
        noise: Noise,
    ) -> StepResult:
        k, asked = self._read_state(state)
        self.check_query(p, ctx, q, asked)
        eps = _query_epsilon(q, p.max_query_epsilon)
        truth = _scalar_value(q.query, ctx, table)
        if not truth.is_integer():
            raise ValueError("an integer query evaluated to a non-integer")
        value = int(truth) - p.threshold
        noisy = value + geometric(noise, eps)
        if noisy >= k:
            answer: dict[str, Any] = {"above": True, "index": asked, "gap": noisy - k}
            return StepResult(answer, self._new_state(k, asked + 1, True), True)
        halted = asked + 1 >= p.max_queries
        return StepResult({"above": False, "index": asked}, self._new_state(k, asked + 1, halted), halted)

    def realized(self, p: GeometricSessionParams, ctx: PublicContext, steps: Steps, halted: bool) -> RdpCurve:
        queries, above = _transcript(steps, QueryParams, p.max_queries)
        if not queries:
            return RdpCurve.zero(ctx.orders)  # nothing was released: the data was never read
        if not above:
            return _charge((p.epsilon_threshold,), ctx.orders)  # ⊥ (Theorems 8 and 9)
        for q in queries:
            self.check_query(p, ctx, q, 0)  # the transcript must be one this session can answer
        eps = _query_epsilon(queries[-1], p.max_query_epsilon)
        if p.require_monotone:
            return _charge((eps, p.epsilon_threshold), ctx.orders)  # Theorem 9
        return _charge((eps, eps, p.epsilon_threshold), ctx.orders)  # Theorem 8


class DroppingAboveThreshold(AboveThresholdSession[DroppingSessionParams, QueryParams]):
    """Ghazi et al. Algorithm 2: Laplace candidates kept with probability e^{−ε_i·k}, known threshold."""

    name: ClassVar[str] = "above_threshold.dropping"
    summary: ClassVar[str] = (
        "AboveThreshold with random dropping over Laplace releases (Ghazi et al. Alg. 2): the first kept "
        "release ≥ threshold; pure ex-post 2ε_i + ε′ at a halt, ε′ if none."
    )
    params_model: ClassVar[type[BaseModel]] = DroppingSessionParams
    query_model: ClassVar[type[BaseModel]] = QueryParams
    batch_params_model: ClassVar[type[BaseModel]] = DroppingBatchParams
    cost_parameter: ClassVar[str] = "max_query_epsilon"
    secret_key: ClassVar[str] = "k"

    def check(self, p: DroppingSessionParams, ctx: PublicContext) -> None:
        """Nothing schema-dependent to check: the params model validates everything."""

    def worst_case(self, p: DroppingSessionParams, ctx: PublicContext) -> RdpCurve:
        return _charge((p.max_query_epsilon, p.max_query_epsilon, p.epsilon_threshold), ctx.orders)

    def check_query(self, p: DroppingSessionParams, ctx: PublicContext, q: QueryParams, asked: int) -> None:
        _check_asked(asked, p.max_queries)
        _check_epsilon(q, p.max_query_epsilon)
        _scalar_query(q.query, ctx)
        laplace_plan(q.query, ctx, _query_epsilon(q, p.max_query_epsilon))  # ε_i small enough for the grid

    def start(self, p: DroppingSessionParams, ctx: PublicContext, noise: Noise) -> dict[str, Any]:
        return self._new_state(geometric(noise, p.epsilon_threshold), 0, False)

    def step(
        self,
        p: DroppingSessionParams,
        ctx: PublicContext,
        state: dict[str, Any],
        q: QueryParams,
        table: Table,
        noise: Noise,
    ) -> StepResult:
        k, asked = self._read_state(state)
        self.check_query(p, ctx, q, asked)
        eps = _query_epsilon(q, p.max_query_epsilon)
        plan, scale = laplace_plan(q.query, ctx, eps)
        # Always evaluate and draw both noises, so nothing (work, timing, stream use) depends on the drop bit.
        units, _ = evaluate_units(q.query, ctx, table, plan)
        keep = kept(noise, candidate_level(plan, scale), k)
        released = float(plan.grid.from_units(units.astype(object) + noise.discrete_laplace(scale, 1))[0])
        if keep and released >= p.threshold:
            answer: dict[str, Any] = {
                "above": True,
                "index": asked,
                "value": released,
                "granularity": plan.grid.granularity,
            }
            return StepResult(answer, self._new_state(k, asked + 1, True), True)
        halted = asked + 1 >= p.max_queries
        return StepResult({"above": False, "index": asked}, self._new_state(k, asked + 1, halted), halted)

    def realized(self, p: DroppingSessionParams, ctx: PublicContext, steps: Steps, halted: bool) -> RdpCurve:
        queries, above = _transcript(steps, QueryParams, p.max_queries)
        if not queries:
            return RdpCurve.zero(ctx.orders)
        if not above:
            return _charge((p.epsilon_threshold,), ctx.orders)  # ⊥ (Theorem 10)
        last = queries[-1]
        _check_epsilon(last, p.max_query_epsilon)
        eps = _query_epsilon(last, p.max_query_epsilon)
        return _charge((eps, eps, p.epsilon_threshold), ctx.orders)  # Theorem 10


class LaplaceAboveThreshold(AboveThresholdSession[LaplaceSessionParams, LaplaceQueryParams]):
    """Classic AboveThreshold (Dwork & Roth 2014, Alg. 1): Lap(2Δ/ε) threshold, Lap(4Δ/ε) per query."""

    name: ClassVar[str] = "above_threshold.laplace"
    summary: ClassVar[str] = (
        "Classic Laplace AboveThreshold (Dwork & Roth): index of the first query above a noisy "
        "threshold; pure ε at a halt, ε/2 if nothing crosses."
    )
    params_model: ClassVar[type[BaseModel]] = LaplaceSessionParams
    query_model: ClassVar[type[BaseModel]] = LaplaceQueryParams
    batch_params_model: ClassVar[type[BaseModel]] = LaplaceBatchParams
    cost_parameter: ClassVar[str] = "epsilon"
    secret_key: ClassVar[str] = "noisy_threshold_units"

    @staticmethod
    def grid(params: LaplaceSessionParams) -> ThresholdGrid:
        """The session's public grid and discrete Laplace scales (t₁ ≥ 2M/ε, t₂ ≥ 4M/ε grid units)."""
        return ThresholdGrid.build(params.max_sensitivity, params.epsilon)

    @classmethod
    def scales(cls, params: LaplaceSessionParams) -> tuple[float, float]:
        """(threshold scale ≥ 2Δ/ε, query scale ≥ 4Δ/ε) in value units: ε/2 for the threshold, ε/2 for the
        queries (the grid's M·γ ≥ Δ, so these are at least the continuous mechanism's scales)."""
        return cls.grid(params).scales()

    def check(self, p: LaplaceSessionParams, ctx: PublicContext) -> None:
        """Nothing schema-dependent to check: the params model validates everything."""

    def worst_case(self, p: LaplaceSessionParams, ctx: PublicContext) -> RdpCurve:
        return RdpCurve.from_pure(p.epsilon, ctx.orders)

    def check_query(
        self, p: LaplaceSessionParams, ctx: PublicContext, q: LaplaceQueryParams, asked: int
    ) -> None:
        _check_asked(asked, p.max_queries)
        sensitivity = _scalar_query(q.query, ctx)
        if sensitivity > p.max_sensitivity:
            reason = f"ℓ1 sensitivity {sensitivity:g} exceeds max_sensitivity {p.max_sensitivity:g}"
            raise ParamsError("query", reason)

    def start(self, p: LaplaceSessionParams, ctx: PublicContext, noise: Noise) -> dict[str, Any]:
        grid = self.grid(p)
        noisy_threshold = grid.threshold_units(p.threshold) + _draw(noise, grid.threshold_scale)
        return self._new_state(noisy_threshold, 0, False)

    def step(
        self,
        p: LaplaceSessionParams,
        ctx: PublicContext,
        state: dict[str, Any],
        q: LaplaceQueryParams,
        table: Table,
        noise: Noise,
    ) -> StepResult:
        noisy_threshold, asked = self._read_state(state)
        self.check_query(p, ctx, q, asked)
        grid = self.grid(p)
        exact = is_integer_valued(q.query, ctx) and grid.grid.exponent <= 0
        moves = tuple(unit_shift(x, grid.grid, exact) for x in shifts(q.query, ctx))
        plan = GridPlan(grid.grid, exact, moves)
        units, _ = evaluate_units(q.query, ctx, table, plan)
        noisy = int(units[0]) + _draw(noise, grid.query_scale)
        if noisy >= noisy_threshold:  # integers: exact
            answer: dict[str, Any] = {"above": True, "index": asked}
            return StepResult(answer, self._new_state(noisy_threshold, asked + 1, True), True)
        halted = asked + 1 >= p.max_queries
        new_state = self._new_state(noisy_threshold, asked + 1, halted)
        return StepResult({"above": False, "index": asked}, new_state, halted)

    def realized(self, p: LaplaceSessionParams, ctx: PublicContext, steps: Steps, halted: bool) -> RdpCurve:
        queries, above = _transcript(steps, LaplaceQueryParams, p.max_queries)
        if not queries:
            return RdpCurve.zero(ctx.orders)
        if not above:
            return RdpCurve.from_pure(pad_up(p.epsilon / 2.0), ctx.orders)  # ⊥: only the threshold pays
        return RdpCurve.from_pure(p.epsilon, ctx.orders)


# ----- batch forms (non-interactive Mechanism) ------------------------------------------------------------
class BatchAboveThreshold(ParamsChecked, Generic[BatchP]):
    """A whole session in one request: params = the session's fields plus ``queries`` (≤ max_queries).

    Generic over the session (``class X(BatchAboveThreshold[XBatchParams], session=...)``).
    ``run`` = ``start`` and then ``step`` until the session halts or the list ends; the release is
    ``{"answers": [...]}`` (answers up to and including the halt) and the charge is the session's own
    ``realized`` on that transcript. The worst case is the session's. ``cost_parameter`` is the session's
    top-level ε field; when every query omits its ``epsilon`` (so each uses max_query_epsilon) the service
    can bisect it for the affordable value, otherwise lowering it below a query's explicit ε fails
    validation and nothing is affordable (None).
    """

    session: ClassVar[AboveThresholdSession[Any, Any]]
    name: ClassVar[str]
    summary: ClassVar[str]
    params_model: ClassVar[type[BaseModel]]
    cost_parameter: ClassVar[str]
    cost_increases_with_parameter: ClassVar[bool] = True

    def __init_subclass__(cls, /, session: AboveThresholdSession[Any, Any], **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.session = session
        cls.name = f"{session.name}.batch"
        cls.summary = f"Batch form (all queries in one request) of {session.name}: {session.summary}"
        cls.params_model = session.batch_params_model
        cls.cost_parameter = session.cost_parameter

    def split(self, p: BatchP) -> tuple[BaseModel, list[BaseModel]]:
        """The session params and the query list of a batch request."""
        session_params = self.session.params_model.model_validate(p.model_dump(exclude={"queries"}))
        queries: list[BaseModel] = list(getattr(p, "queries"))  # noqa: B009 - field of a dynamic model
        return session_params, queries

    def check(self, p: BatchP, ctx: PublicContext) -> None:
        session_params, queries = self.split(p)
        self.session.check(session_params, ctx)
        for index, query in enumerate(queries):
            try:
                self.session.check_query(session_params, ctx, query, index)
            except ParamsError as exc:
                raise ParamsError(f"queries.{index}.{exc.field}", exc.reason) from None

    def worst_case(self, p: BatchP, ctx: PublicContext) -> RdpCurve:
        session_params, _ = self.split(p)
        return self.session.worst_case(session_params, ctx)

    def run(self, p: BatchP, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        self.check(p, ctx)
        session_params, queries = self.split(p)
        worst = self.session.worst_case(session_params, ctx)
        state = self.session.start(session_params, ctx, noise)
        steps: Steps = []
        halted = False
        for query in queries:
            result = self.session.step(session_params, ctx, state, query, table, noise)
            steps.append((query.model_dump(mode="json"), result.answer))
            state, halted = result.state, result.halted
            if halted:
                break
        realized = self.session.realized(session_params, ctx, steps, halted)
        assert realized <= worst
        return Release(output={"answers": [answer for _, answer in steps]}, realized=realized)


GEOMETRIC = GeometricAboveThreshold()
DROPPING = DroppingAboveThreshold()
LAPLACE = LaplaceAboveThreshold()


class GeometricAboveThresholdBatch(BatchAboveThreshold[GeometricBatchParams], session=GEOMETRIC):
    """``above_threshold.batch``."""


class DroppingAboveThresholdBatch(BatchAboveThreshold[DroppingBatchParams], session=DROPPING):
    """``above_threshold.dropping.batch``."""


class LaplaceAboveThresholdBatch(BatchAboveThreshold[LaplaceBatchParams], session=LAPLACE):
    """``above_threshold.laplace.batch``."""


# ----- Ligett et al.'s InteractiveAboveThreshold (accuracy-first stopping) ---------------------------------
# API (used by mechanisms.reduction.accuracy_first and the accuracy-first ERM learners):
#
#   iat_paper_calibration(query_sensitivity, width, failure, levels, target=0.0) -> IatCalibration
#   iat_reference_calibration(query_sensitivity, width, failure, levels, target=0.0) -> IatCalibration
#   InteractiveAboveThreshold(threshold, epsilon_a, query_sensitivity, noise)  # draws Ŵ once
#       .test(value: float, noise) -> bool                                     # fresh noise per call
#       .to_state() -> dict / InteractiveAboveThreshold.from_state(dict)     # secret JSON state
#   interactive_above_threshold(query, level_epsilons, threshold, epsilon_a, query_sensitivity, noise,
#                               orders=DEFAULT_ORDERS) -> IatOutcome(level | None, epsilon, charge)
#       query(t) -> f_t(D) is called for t = 0, 1, … in order until the first pass (lazily, so a learner
#       computes hypothesis t only when needed).
#   iat_charge(epsilon_a, level_epsilons, level | None, orders) -> RdpCurve   # ε_A + ε_t, or ε_A + ε_{T−1}
#
# Ligett, Neel, Roth, Waggoner, Wu, "Accuracy First" (NeurIPS 2017), Algorithm 2 and Lemma 2.8
# (soundness: docs/privacy.md §8.1.3; calibrations: §8.2.4): Ŵ = W + Lap(2Δ/ε_A) drawn once; at
# level t the query value f_t(D) (a function of the released prefix, sensitivity ≤ Δ for every fixed
# prefix) is compared as f_t(D) + Lap(4Δ/ε_A) ≥ Ŵ; the first pass halts. When the levels come from an
# (ε_0, …, ε_{T−1})-prefix-private generator (Laplace noise reduction), the outcome (t, prefix up to t) is
# ex-post (ε_A + ε_t)-DP (Lemma 2.8); "no pass" after the last level costs ε_A + ε_{T−1} (docs/privacy.md
# §8.1.3; the paper charges ∞ only because it then releases θ*, which this never does).
# Finite precision (docs/privacy.md §10): the comparison is exact on the public grid of ``ThresholdGrid``
# (γ = the largest 2^k ≤ 2^-10·Δ, M = ⌊Δ/γ + 1/64⌋ + 1): round(W/γ) + ρ and round(f_t/γ) + ν_t with ρ, ν_t
# discrete Laplace of scales t₁ ≥ 2M/ε_A, t₂ ≥ 4M/ε_A (grid units). The coupling of Lemma 2.8 shifts ρ by M
# and ν_t by 2M (integers), costing M/t₁ + 2M/t₂ ≤ ε_A, so the charge ε_A holds exactly as given. The
# caller's f_t must have sensitivity ≤ Δ as computed (float error ≤ 2^-7·γ per value, see FLOAT_SLACK).
#
# Calibrations (both give the same privacy, ε_A; they differ in ε_A and W, i.e. in accuracy):
# * paper-theorem (Theorem A.1 / Theorem 3.2): accepted only if f_t(D) ≥ W − 8Δ·ln(2T/γ)/ε_A, except with
#   probability γ. With a target f ≥ L and a width α: W = L + α/2 and ε_A = 16Δ·ln(2T/γ)/α.
# * reference-code (the authors' code, github.com/steven7woo/Accuracy-First-Differential-Privacy, with the
#   factor 2 its plots apply to ε_A; docs/privacy.md §8.2.4): b = α/(4·ln(1.5^{3/4}·√T/γ)), ε_A = 2Δ/b
#   = 8Δ·ln(1.5^{3/4}√T/γ)/α, threshold on the excess s = α/4 + (3/4)·b·ln 1.5 − (1/2)·b·ln T, i.e.
#   W = L + α − s for a target f ≥ L (the excess form of the code, f = −excess, L = −α). Its accuracy is
#   verified numerically (docs/privacy.md §8.2.4: failure 0.0152 ≤ γ = 0.1 at T = 1000), not proven in
#   general; label it.


@dataclass(frozen=True)
class IatCalibration:
    """ε_A and the public threshold W of one InteractiveAboveThreshold instance, and how they were chosen."""

    epsilon_a: float
    threshold: float
    calibration: str


def _check_calibration_inputs(query_sensitivity: float, width: float, failure: float, levels: int) -> None:
    if not (query_sensitivity > 0.0 and math.isfinite(query_sensitivity)):
        raise ValueError("the query sensitivity must be finite and > 0")
    if not (width > 0.0 and math.isfinite(width)):
        raise ValueError("the width α must be finite and > 0")
    if not 0.0 < failure < 1.0:
        raise ValueError("the failure probability γ must be in (0, 1)")
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError("levels must be a positive integer")


def iat_paper_calibration(
    query_sensitivity: float, width: float, failure: float, levels: int, target: float = 0.0
) -> IatCalibration:
    """Paper-theorem calibration: ε_A = 16Δ·ln(2T/γ)/α, W = target + α/2 (Ligett et al. Thm A.1, 3.2).

    Guarantee (Theorem A.1 with α_IAT = α/2): except with probability γ, a level is accepted only if
    f_t(D) ≥ target. With f = −excess risk and target −α this is the ERM setting of Algorithms 3 and 5.
    """
    _check_calibration_inputs(query_sensitivity, width, failure, levels)
    epsilon_a = pad_up(16.0 * query_sensitivity * math.log(2.0 * levels / failure) / width)
    return IatCalibration(epsilon_a, target + width / 2.0, "paper-theorem")


def iat_reference_calibration(
    query_sensitivity: float, width: float, failure: float, levels: int, target: float = 0.0
) -> IatCalibration:
    """Reference-code calibration of Ligett et al.'s code, with its plots' factor 2 applied to ε_A
    (docs/privacy.md §8.2.4).

    b = α/(4·ln(1.5^{3/4}·√T/γ)), ε_A = 2Δ/b, W = target + α − s with s = α/4 + (3/4)·b·ln 1.5 − ½·b·ln T.
    Privacy is the same theorem (ε_A + ε_t); the accuracy is only verified numerically (docs/privacy.md
    §8.2.4).
    """
    _check_calibration_inputs(query_sensitivity, width, failure, levels)
    log_term = math.log(1.5**0.75 * math.sqrt(levels) / failure)
    if log_term <= 0.0:
        raise ValueError("the reference calibration needs 1.5^{3/4}·√T > γ")
    b = width / (4.0 * log_term)
    s = width / 4.0 + 0.75 * b * math.log(1.5) - 0.5 * b * math.log(levels)
    epsilon_a = pad_up(2.0 * query_sensitivity / b)
    return IatCalibration(epsilon_a, target + width - s, "reference-code")


def iat_scales(epsilon_a: float, query_sensitivity: float) -> tuple[float, float]:
    """(threshold scale ≥ 2Δ/ε_A, query scale ≥ 4Δ/ε_A) of Ligett et al. Algorithm 2, in value units: the
    discrete Laplace scales of ``ThresholdGrid`` times γ (exact floats)."""
    return ThresholdGrid.build(query_sensitivity, epsilon_a).scales()


class InteractiveAboveThreshold:
    """One IAT instance: the noisy threshold Ŵ is drawn once at construction (secret), never re-drawn.

    Ŵ is round(W/γ) + ρ in grid units (an int, ``ThresholdGrid``). ``test(value, noise)`` draws fresh query
    noise and returns whether round(f_t/γ) + ν_t ≥ Ŵ. After the first pass the instance is closed (Algorithm 2
    halts at its first pass):
    further tests raise. ``to_state``/``from_state`` persist it as JSON.
    """

    def __init__(
        self,
        threshold: float,
        epsilon_a: float,
        query_sensitivity: float,
        noise: Noise | None = None,
        *,
        noisy_threshold: int | None = None,
        halted: bool = False,
    ) -> None:
        if not math.isfinite(threshold):
            raise ValueError("the threshold must be finite")
        if not (query_sensitivity > 0.0 and math.isfinite(query_sensitivity)):
            raise ValueError("the query sensitivity must be finite and > 0")
        if not (epsilon_a > 0.0 and math.isfinite(epsilon_a)):
            raise ValueError("epsilon_a must be finite and > 0")
        self._grid = ThresholdGrid.build(query_sensitivity, epsilon_a)
        self.threshold = float(threshold)
        self.epsilon_a = float(epsilon_a)
        self.query_sensitivity = float(query_sensitivity)
        self._query_units = self._grid.query_scale
        if noisy_threshold is None:
            if noise is None:
                raise ValueError("a new instance needs a Noise (the rng) to draw its noisy threshold")
            noisy_threshold = self._grid.threshold_units(threshold) + _draw(noise, self._grid.threshold_scale)
        if isinstance(noisy_threshold, bool) or not isinstance(noisy_threshold, int):
            raise ValueError("the noisy threshold must be an integer number of grid units")
        self._noisy_threshold = noisy_threshold
        self.halted = bool(halted)

    @property
    def granularity(self) -> float:
        """γ: the public grid on which values and the threshold are compared."""
        return self._grid.grid.granularity

    @property
    def query_scale(self) -> float:
        """The query noise scale in value units (t₂·γ ≥ 4Δ/ε_A)."""
        return float(self._query_units * Fraction(self._grid.grid.granularity))

    @query_scale.setter
    def query_scale(self, value: float) -> None:
        """For audits of broken variants only: the query noise becomes ⌈value/γ⌉ (dyadic) grid units."""
        self._query_units = dyadic_scale_up(Fraction(value) / Fraction(self._grid.grid.granularity))

    def test(self, value: float, noise: Noise) -> bool:
        """One query: True (and the instance halts) iff round(f/γ) + ν ≥ round(W/γ) + ρ, exactly."""
        if self.halted:
            raise ValueError("this InteractiveAboveThreshold instance has halted; start a new one")
        if not math.isfinite(value):
            raise ValueError("a query value must be finite")
        passed = self._grid.value_units(value) + _draw(noise, self._query_units) >= self._noisy_threshold
        self.halted = passed
        return passed

    def to_state(self) -> dict[str, Any]:
        """Secret JSON state (contains Ŵ in grid units): store it only in the secret-state table."""
        return {
            "threshold": self.threshold,
            "epsilon_a": self.epsilon_a,
            "query_sensitivity": self.query_sensitivity,
            "noisy_threshold": self._noisy_threshold,
            "halted": self.halted,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> InteractiveAboveThreshold:
        expected = {"threshold", "epsilon_a", "query_sensitivity", "noisy_threshold", "halted"}
        if not isinstance(state, dict) or set(state) != expected or not isinstance(state["halted"], bool):
            raise ValueError("not an InteractiveAboveThreshold state")
        secret = state["noisy_threshold"]
        if isinstance(secret, bool) or not isinstance(secret, int):  # an old float state is refused
            raise ValueError("not an InteractiveAboveThreshold state")
        return cls(
            float(state["threshold"]),
            float(state["epsilon_a"]),
            float(state["query_sensitivity"]),
            noisy_threshold=secret,
            halted=state["halted"],
        )

    def __repr__(self) -> str:  # never show Ŵ
        return f"InteractiveAboveThreshold(threshold={self.threshold!r}, epsilon_a={self.epsilon_a!r})"


def iat_charge(
    epsilon_a: float, level_epsilons: Sequence[float], level: int | None, orders: Sequence[float]
) -> RdpCurve:
    """Lemma 2.8: pure ε_A + ε_t for a pass at level t; ε_A + ε_{T−1} when no level passed (⊥)."""
    if not level_epsilons:
        raise ValueError("the level grid is empty")
    index = len(level_epsilons) - 1 if level is None else level
    if not 0 <= index < len(level_epsilons):
        raise ValueError(f"level {level} is outside the grid")
    return _charge((epsilon_a, float(level_epsilons[index])), orders)


@dataclass(frozen=True)
class IatOutcome:
    """The first level that passed (None: no level passed), its pure ex-post ε and the charge curve."""

    level: int | None
    epsilon: float
    charge: RdpCurve


def interactive_above_threshold(
    query: Callable[[int], float],
    level_epsilons: Sequence[float],
    threshold: float,
    epsilon_a: float,
    query_sensitivity: float,
    noise: Noise,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> IatOutcome:
    """Run Ligett et al. Algorithm 2 over the levels of a prefix-private generator (Lemma 2.8).

    ``query(t)`` returns f_t(D) for level t (a function of the generator's released prefix up to t, with
    sensitivity ≤ ``query_sensitivity`` for every fixed prefix); it is called in order t = 0, 1, … and not
    beyond the first pass. ``level_epsilons[t]`` is the prefix-privacy level ε_t of the generator.
    """
    iat = InteractiveAboveThreshold(threshold, epsilon_a, query_sensitivity, noise)
    for t in range(len(level_epsilons)):
        if iat.test(float(query(t)), noise):
            charge = iat_charge(epsilon_a, level_epsilons, t, orders)
            return IatOutcome(t, charge.pure, charge)
    charge = iat_charge(epsilon_a, level_epsilons, None, orders)
    return IatOutcome(None, charge.pure, charge)
