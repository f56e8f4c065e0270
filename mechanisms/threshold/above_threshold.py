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

Samplers (docs/privacy/finite_precision.md#finite-precision, finite precision): every draw is exact and comes
from ``Noise`` (the OS CSPRNG). Geom_{e^{−ε}} on {0, 1, …} is folded from one discrete Laplace draw Z of scale
t = 1/ε rounded up (``dyadic_scale_up``): Z if Z ≥ 0, else −Z − 1 (P ∝ e^{−z/t}(1 + e^{−1/t}), a geometric
law). The drop step is an exact Bernoulli(exp(−ε̂_i·k)) with ε̂_i the candidate's own rational pure level.
Dropping candidates are released on their public grid (as ``mechanisms.queries.laplace``); the classic Laplace
session compares integers on a grid (round(f/γ) + ν ≥ round(T/γ) + ρ with discrete Laplace ρ, ν). Rounding the
scales up makes each actual parameter ≤ the charged one, and every theorem's charge is increasing in its
parameters, so the charges below are unchanged (the derivation is in docs/mechanisms/above_threshold.md §8).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
from pydantic import BaseModel

from mechanisms.accounting import RdpCurve, pad_up, sum_up
from mechanisms.base import ParamsChecked, ParamsError, PublicContext, Release, StepResult, Table
from mechanisms.data.schema import IntColumn
from mechanisms.noise import Grid, Noise, dyadic_scale_up, laplace_grid
from mechanisms.queries.language import (
    RANGE_BITS,
    AnyQuery,
    CountQuery,
    GridPlan,
    HistogramQuery,
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
from mechanisms.threshold.params import (
    DroppingBatchParams,
    DroppingSessionParams,
    GeometricBatchParams,
    GeometricSessionParams,
    LaplaceBatchParams,
    LaplaceQueryParams,
    LaplaceSessionParams,
    QueryParams,
)

Steps = list[tuple[dict[str, Any], dict[str, Any]]]


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


def draw_units(noise: Noise, scale: Fraction) -> int:
    return int(noise.discrete_laplace(scale, 1)[0])


# ----- charges -----------------------------------------------------------------------------------------
def pure_charge(terms: Sequence[float], orders: Sequence[float]) -> RdpCurve:
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

    def _answer(self, secret: int, asked: int, max_queries: int, above: dict[str, Any] | None) -> StepResult:
        """Query ``asked``'s result: the halt with the ``above`` answer, else a below answer (which halts the
        session when it was the last of its ``max_queries``)."""
        if above is not None:
            return StepResult(above, self._new_state(secret, asked + 1, True), True)
        halted = asked + 1 >= max_queries
        return StepResult(
            {"above": False, "index": asked}, self._new_state(secret, asked + 1, halted), halted
        )

    def check(self, params: SessionP, ctx: PublicContext) -> None:
        """Nothing schema-dependent to check: the params model validates everything."""

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
        return pure_charge(
            (eps, eps_threshold) if p.require_monotone else (eps, eps, eps_threshold), ctx.orders
        )

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
        above = {"above": True, "index": asked, "gap": noisy - k} if noisy >= k else None
        return self._answer(k, asked, p.max_queries, above)

    def realized(self, p: GeometricSessionParams, ctx: PublicContext, steps: Steps, halted: bool) -> RdpCurve:
        queries, above = _transcript(steps, QueryParams, p.max_queries)
        if not queries:
            return RdpCurve.zero(ctx.orders)  # nothing was released: the data was never read
        if not above:
            return pure_charge((p.epsilon_threshold,), ctx.orders)  # ⊥ (Theorems 8 and 9)
        for q in queries:
            self.check_query(p, ctx, q, 0)  # the transcript must be one this session can answer
        eps = _query_epsilon(queries[-1], p.max_query_epsilon)
        if p.require_monotone:
            return pure_charge((eps, p.epsilon_threshold), ctx.orders)  # Theorem 9
        return pure_charge((eps, eps, p.epsilon_threshold), ctx.orders)  # Theorem 8


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

    def worst_case(self, p: DroppingSessionParams, ctx: PublicContext) -> RdpCurve:
        return pure_charge((p.max_query_epsilon, p.max_query_epsilon, p.epsilon_threshold), ctx.orders)

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
        above: dict[str, Any] | None = None
        if keep and released >= p.threshold:
            above = {"above": True, "index": asked, "value": released, "granularity": plan.grid.granularity}
        return self._answer(k, asked, p.max_queries, above)

    def realized(self, p: DroppingSessionParams, ctx: PublicContext, steps: Steps, halted: bool) -> RdpCurve:
        queries, above = _transcript(steps, QueryParams, p.max_queries)
        if not queries:
            return RdpCurve.zero(ctx.orders)
        if not above:
            return pure_charge((p.epsilon_threshold,), ctx.orders)  # ⊥ (Theorem 10)
        last = queries[-1]
        _check_epsilon(last, p.max_query_epsilon)
        eps = _query_epsilon(last, p.max_query_epsilon)
        return pure_charge((eps, eps, p.epsilon_threshold), ctx.orders)  # Theorem 10


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
        noisy_threshold = grid.threshold_units(p.threshold) + draw_units(noise, grid.threshold_scale)
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
        noisy = int(units[0]) + draw_units(noise, grid.query_scale)
        above = {"above": True, "index": asked} if noisy >= noisy_threshold else None  # integers: exact
        return self._answer(noisy_threshold, asked, p.max_queries, above)

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
