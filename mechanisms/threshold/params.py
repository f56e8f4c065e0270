"""The parameter models of the AboveThreshold sessions and of their batch forms (public inputs only).

The sessions and their charges: ``mechanisms.threshold.above_threshold``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

from mechanisms.data.schema import MAX_EXACT_INT
from mechanisms.queries.language import Query

MAX_QUERIES = 10_000
MIN_EPSILON = 1e-9
"""Smallest ε accepted anywhere here: keeps ⌊E/ε⌋ finite and far from float overflow."""
MAX_EPSILON = 100.0

Epsilon = Annotated[float, Field(strict=True, ge=MIN_EPSILON, le=MAX_EPSILON, allow_inf_nan=False)]
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class _EpsilonBatch(_Frozen):
    """The check of a batch whose queries carry their own ε_i (geometric, dropping): the session's fields
    and ``queries`` come from the class that mixes this in."""

    if TYPE_CHECKING:
        queries: tuple[QueryParams, ...]
        max_queries: int
        max_query_epsilon: float

    @model_validator(mode="after")
    def _fits_session(self) -> Self:
        _check_batch_epsilons(self.queries, self.max_queries, self.max_query_epsilon)
        return self


class GeometricBatchParams(GeometricSessionParams, _EpsilonBatch):
    """A whole geometric session in one request: the session fields plus the query list."""

    queries: tuple[QueryParams, ...] = Field(min_length=1, max_length=MAX_QUERIES)


class DroppingBatchParams(DroppingSessionParams, _EpsilonBatch):
    """A whole dropping session in one request (the candidate list is fixed before k is drawn)."""

    queries: tuple[QueryParams, ...] = Field(min_length=1, max_length=MAX_QUERIES)


class LaplaceBatchParams(LaplaceSessionParams):
    """A whole Laplace session in one request."""

    queries: tuple[LaplaceQueryParams, ...] = Field(min_length=1, max_length=MAX_QUERIES)

    @model_validator(mode="after")
    def _fits_session(self) -> Self:
        if len(self.queries) > self.max_queries:
            raise ValueError(f"{len(self.queries)} queries, but max_queries is {self.max_queries}")
        return self
