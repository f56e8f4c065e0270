"""The mechanism seam (docs/privacy/filter.md#filter, docs/privacy/rules.md#rules): what every mechanism
exposes to the service.

* ``params_model``: frozen, validated pydantic model of **public** inputs (no seeds, no data).
* ``check(params, ctx)``: schema-dependent validation (unknown column, wrong type); raises ``ParamsError``
  before anything is reserved.
* ``worst_case(params, ctx)``: the largest ex-post loss any outcome can have, from public information only.
* ``run(params, ctx, table, noise)``: the DP release and its realized ex-post curve,
  ``realized <= worst_case``; all randomness from ``noise`` (``mechanisms.noise``).
* ``cost_parameter``/``with_cost``: the main scalar cost knob (ε, σ, γ, z, …), so a refusal can say what is
  affordable.

The protocols are generic in the params model: an implementation is a ``Mechanism[LaplaceParams]`` and its
methods take ``p: LaplaceParams`` directly. A registry of heterogeneous mechanisms holds ``Mechanism[Any]``
and must validate raw params with ``mechanism.params_model`` before calling anything. Implementations derive
from ``ParamsChecked``, which turns a params (or query) object of the wrong model into a ``TypeError`` at
the call, so a programming error can never reach the data as a half-valid model.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, ClassVar, Protocol, TypeVar, Union, get_args, get_origin, runtime_checkable

import numpy as np
from pydantic import BaseModel

from mechanisms.accounting import RdpCurve
from mechanisms.accounting.individual import UnitCharges
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise

Table = Mapping[str, np.ndarray]


class ParamsError(ValueError):
    """Public parameters that cannot be run on this dataset: names the offending field and why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


ModelT = TypeVar("ModelT", bound=BaseModel)
P = TypeVar("P", bound=BaseModel, contravariant=True)
"""The params model of a mechanism (contravariant: ``Mechanism[Any]`` holds every mechanism)."""
Q = TypeVar("Q", bound=BaseModel, contravariant=True)
"""The query model of one session step."""


_CHECKED_METHODS = ("check", "worst_case", "run", "check_query", "start", "step", "realized")
_QUERY_POSITION = {"check_query": 1, "step": 2}
"""Where the query sits among the arguments after ``params`` (``InteractiveMechanism``'s signatures)."""


def _checked(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` raising TypeError unless ``params`` is a ``self.params_model`` (and, for ``check_query``
    and ``step``, the query a ``self.query_model``)."""
    name = method.__name__
    position = _QUERY_POSITION.get(name)
    query_name = list(inspect.signature(method).parameters)[position + 2] if position is not None else ""

    @functools.wraps(method)
    def checked(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        _expect(params, self.params_model, type(self), name)
        if position is not None:
            query = kwargs[query_name] if query_name in kwargs else args[position]
            _expect(query, self.query_model, type(self), name)
        return method(self, params, *args, **kwargs)

    setattr(checked, "_params_checked", True)  # noqa: B010 - marker on a function object
    return checked


def _expect(value: object, model: type[BaseModel], owner: type, method: str) -> None:
    if not isinstance(value, model):
        got = type(value).__name__
        raise TypeError(f"{owner.__name__}.{method}: expected {model.__name__}, got {got}")


class ParamsChecked:
    """Base class of the mechanism implementations: the seam's methods (check, worst_case, run, check_query,
    start, step, realized) defined by a subclass get a runtime check that ``params`` is an instance of the
    class's ``params_model`` (and ``query`` of its ``query_model``), raising TypeError otherwise. Statically
    the methods keep their precise ``p: P`` signatures."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _CHECKED_METHODS:
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "_params_checked", False):
                setattr(cls, name, _checked(method))


@dataclass(frozen=True)
class PublicContext:
    """What a mechanism may know about a dataset without reading it.

    ``n_rows`` is public only under replace-one neighbouring (neighbours have the same size), else None.
    """

    schema: DatasetSchema
    n_rows: int | None
    orders: tuple[float, ...]


@dataclass(frozen=True)
class Release:
    """A DP output (JSON-serialisable) and the ex-post loss of exactly that output. On an individual
    dataset, ``units`` is what each admitted unit pays (secret: it goes to the units' filters only,
    docs/privacy/individual.md#theorem-individual)."""

    output: dict[str, Any]
    realized: RdpCurve
    units: UnitCharges | None = None


@runtime_checkable
class Mechanism(Protocol[P]):
    """A one-shot mechanism whose params model is ``P`` (``params_model`` is that model)."""

    name: ClassVar[str]
    summary: ClassVar[str]
    params_model: ClassVar[type[BaseModel]]
    cost_parameter: ClassVar[str]
    cost_increases_with_parameter: ClassVar[bool]

    def check(self, params: P, ctx: PublicContext) -> None: ...

    def worst_case(self, params: P, ctx: PublicContext) -> RdpCurve: ...

    def run(self, params: P, ctx: PublicContext, table: Table, noise: Noise) -> Release: ...


# ----- long-running mechanisms ---------------------------------------------------------------------------

ProgressFn = Callable[[float], None]
"""Called by a long-running ``run`` with the fraction done in [0, 1]; also the worker's heartbeat."""


def no_progress(fraction: float) -> None:
    """The default progress callback: ignore it."""


@runtime_checkable
class LongRunningMechanism(Mechanism[P], Protocol[P]):
    """A mechanism whose ``run`` may take minutes (training, tuning).

    ``run`` takes an extra keyword ``progress`` and must call it regularly (at least every few seconds of
    work): the service uses each call to renew the worker's lease, so a live run is never reaped.
    ``progress_is_public``: whether the fraction may be shown to the analyst. It must be False when the
    amount of work done is itself secret (e.g. the latent number of candidates of ex-post tuning); the
    service then shows only the state and the elapsed time.
    """

    long_running: ClassVar[bool]
    progress_is_public: ClassVar[bool]

    def run(
        self,
        params: P,
        ctx: PublicContext,
        table: Table,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> Release: ...


def is_long_running(mechanism: object) -> bool:
    return bool(getattr(mechanism, "long_running", False))


def has_public_progress(mechanism: object) -> bool:
    """Whether a run's progress (and anything that tracks it, such as heartbeat times) may be shown."""
    return is_long_running(mechanism) and bool(getattr(mechanism, "progress_is_public", False))


def with_cost(params: ModelT, name: str, value: float) -> ModelT:
    """A copy of ``params`` with its cost parameter set to ``value`` (re-validated)."""
    return type(params).model_validate({**params.model_dump(), name: value})


def _is_number(annotation: object) -> bool:
    """float or int, possibly Optional and/or Annotated (e.g. ``StrictFloat | None``)."""
    if annotation in (float, int):
        return True
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Annotated:
        return _is_number(args[0])
    return bool(args) and get_origin(annotation) in (Union, UnionType) and all(map(_is_number, args))


def _constraints(annotation: object) -> list[object]:
    """The constraints a type carries inside ``Annotated`` (also within ``X | None``), e.g. ``Gt(gt=0)``."""
    if get_origin(annotation) is Annotated:
        first, *extras = get_args(annotation)
        inner = [c for extra in extras for c in getattr(extra, "metadata", [extra])]
        return _constraints(first) + inner
    if get_origin(annotation) in (Union, UnionType):
        return [c for arg in get_args(annotation) for c in _constraints(arg)]
    return []


def cost_range(model: type[BaseModel], name: str) -> tuple[float, float] | None:
    """The interval [lo, hi] ⊆ [1e-9, 1e9] the model accepts for a scalar cost field (None: not scalar)."""
    field = model.model_fields.get(name)
    if field is None or not _is_number(field.annotation):
        return None
    lo, hi = 1e-9, 1e9
    for bound in [*field.metadata, *_constraints(field.annotation)]:
        if getattr(bound, "ge", None) is not None:
            lo = max(lo, float(bound.ge))
        if getattr(bound, "gt", None) is not None:
            lo = max(lo, math.nextafter(float(bound.gt), math.inf))
        if getattr(bound, "le", None) is not None:
            hi = min(hi, float(bound.le))
        if getattr(bound, "lt", None) is not None:
            hi = min(hi, math.nextafter(float(bound.lt), -math.inf))
    return (lo, hi) if 0 < lo < hi else None


def cost_knob(mechanism: Mechanism[Any], params: BaseModel) -> tuple[str, bool]:
    """(name, cost increases with it) of the knob an affordable value is searched on for ``params``: the
    mechanism's ``cost_knob(params)`` when it defines one (a learner given a target ε is priced by that
    target, not by the noise scale it is calibrated to), else its ``cost_parameter``."""
    own = getattr(mechanism, "cost_knob", None)
    if callable(own):
        name, increases = own(params)
        return str(name), bool(increases)
    return mechanism.cost_parameter, mechanism.cost_increases_with_parameter


def _checked_edge(
    mechanism: Mechanism[ModelT], params: ModelT, ctx: PublicContext, name: str, cheap: float, dear: float
) -> float | None:
    """The value nearest ``cheap`` (towards ``dear``) that the mechanism's ``check`` accepts: a 65-point log
    scan for the first accepted value, then bisection between it and the refused point before it (the
    accepted set is taken to be an interval). None when no scanned value is accepted."""

    def accepted(value: float) -> bool:
        try:
            mechanism.check(with_cost(params, name, value), ctx)
            return True
        except (ValueError, ArithmeticError):
            return False

    scan = [math.exp(v) for v in np.linspace(math.log(cheap), math.log(dear), 65)]
    first = next((i for i, value in enumerate(scan) if accepted(value)), None)
    if first is None:
        return None
    if first == 0:
        return scan[0]
    refused, good = math.log(scan[first - 1]), math.log(scan[first])
    for _ in range(50):
        mid = (refused + good) / 2
        if accepted(math.exp(mid)):
            good = mid
        else:
            refused = mid
    return math.exp(good)


def best_affordable_cost(
    mechanism: Mechanism[ModelT],
    params: ModelT,
    ctx: PublicContext,
    admissible: Callable[[RdpCurve], bool],
    iterations: int = 60,
) -> float | None:
    """The most expensive value of the cost knob (``cost_knob``) that ``admissible`` still accepts, or None.

    Bisection in log space over the field's own accepted range (within [1e-9, 1e9]) assuming the worst case
    is monotone in the parameter; a value counts only if the mechanism's ``check`` accepts it too. A mechanism
    whose check refuses the cheap end of the range may define ``cost_floor(params, ctx)``, the smallest value
    its check accepts (for accuracy_first's epsilon_max: just above the test's own ε_A); otherwise the edge
    of what ``check`` accepts nearest the cheap end is searched (``_checked_edge``: a dp_gd target ε whose
    noise multiplier would exceed the sampler's range, an RGM target below its floor). The
    returned value is on the admissible side of the bracket (checked again before returning). None when the
    cost parameter is not a scalar or nothing in range is admissible.
    """
    name, increases = cost_knob(mechanism, params)
    bracket = cost_range(type(params), name)
    if bracket is None:
        return None

    def ok(value: float) -> bool:
        try:
            candidate = with_cost(params, name, value)
            mechanism.check(candidate, ctx)
            return admissible(mechanism.worst_case(candidate, ctx))
        except (ValueError, ArithmeticError):  # ParamsError and pydantic's ValidationError are ValueErrors
            return False

    low, high = bracket
    cheap, dear = (low, high) if increases else (high, low)
    floor = getattr(mechanism, "cost_floor", None)
    if callable(floor) and increases:  # the knob's smallest value ``check`` can accept (a public bound)
        try:
            least = floor(params, ctx)
        except (ValueError, ArithmeticError):
            least = None
        if least is not None and cheap < least < dear:
            cheap = least
    if not ok(cheap):
        edge = _checked_edge(mechanism, params, ctx, name, cheap, dear)
        if edge is None or not ok(edge):
            return None
        cheap = edge
    if ok(dear):
        return dear
    lo, hi = math.log(cheap), math.log(dear)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if ok(math.exp(mid)):
            lo = mid
        else:
            hi = mid
    best = float(f"{math.exp(lo):.6g}")
    return best if ok(best) else math.exp(lo)


# ----- interactive mechanisms (sessions) --------------------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    """One step of a session: the public ``answer`` and the new **secret** ``state`` (never released)."""

    answer: dict[str, Any]
    state: dict[str, Any]
    halted: bool


@runtime_checkable
class InteractiveMechanism(Protocol[P, Q]):
    """A session: ``start`` draws the secret state without reading data; each ``step`` answers one query.

    * ``params_model``: the session's public parameters (validated at open).
    * ``query_model``: the public parameters of one step.
    * ``worst_case(params, ctx)``: reserved at open; bounds every outcome of the whole session.
    * ``check_query``: schema- and session-dependent validation of one step, before any data is read.
    * ``realized(params, ctx, steps, halted)``: the ex-post charge of the session's actual outcome, a
      function of the public transcript only (the queries and the released answers).
    The state is JSON-serialisable so the service can persist it between calls (secret-state table). ``P``
    is the params model, ``Q`` the query model; a registry holds ``InteractiveMechanism[Any, Any]``.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    params_model: ClassVar[type[BaseModel]]
    query_model: ClassVar[type[BaseModel]]

    def check(self, params: P, ctx: PublicContext) -> None: ...

    def worst_case(self, params: P, ctx: PublicContext) -> RdpCurve: ...

    def check_query(self, params: P, ctx: PublicContext, query: Q, asked: int) -> None: ...

    def start(self, params: P, ctx: PublicContext, noise: Noise) -> dict[str, Any]: ...

    def step(
        self,
        params: P,
        ctx: PublicContext,
        state: dict[str, Any],
        query: Q,
        table: Table,
        noise: Noise,
    ) -> StepResult: ...

    def realized(
        self,
        params: P,
        ctx: PublicContext,
        steps: list[tuple[dict[str, Any], dict[str, Any]]],
        halted: bool,
    ) -> RdpCurve: ...
