"""Property-based tests of the accounting core: curve algebra, rounding direction, conversions, capacity,
and the filter's admission rule (a simulation and a reserve/commit/abort state machine).

The filter model below is the service's rule (docs/privacy/filter.md#filter): a request with worst-case charge
w is admitted iff some slot j has capacity cap[j] ≠ None and spent[j] + reserved[j] + w[j] finite and ≤
cap[j]; a commit replaces the reservation by the realized charge (≤ the reservation); an abort releases it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Decimal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule

from mechanisms.accounting import (
    DEFAULT_ORDERS,
    UNITS_PER_EPSILON,
    RdpCurve,
    UnitsVector,
    capacity_units,
    epsilon_at_delta,
    filter_epsilon,
    units_down,
    units_up,
)

# The numbers of examples and of steps per stateful run come from the Hypothesis profile (tests/conftest.py):
# 200 examples of 40 steps under the ci profile, a small sample by default.
SETTINGS = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ORDERS = DEFAULT_ORDERS
TOLERANCE = 1e-9  # float printing of the filter's ε; the ledger itself is exact

# ----- strategies ---------------------------------------------------------------------------------------
grids = st.lists(st.sampled_from(DEFAULT_ORDERS), min_size=1, max_size=8, unique=True).map(
    lambda orders: tuple(sorted(orders))
)
epsilons = st.one_of(
    st.sampled_from([0.0, 0.1, 0.3, 1.0, 1 / 3, 2.5, 7.7]),
    st.floats(min_value=0.0, max_value=20.0, allow_nan=False, allow_infinity=False),
)
positive_deltas = st.one_of(
    st.sampled_from([1e-12, 1e-9, 1e-6, 1e-5, 1e-3, 0.05, 0.5]),
    st.floats(min_value=1e-15, max_value=0.9, allow_nan=False, allow_infinity=False),
)
deltas = st.one_of(st.just(0.0), positive_deltas)
losses = st.one_of(
    st.floats(min_value=0.0, max_value=50.0, allow_nan=False, allow_infinity=False),
    st.just(math.inf),
)
fractions_01 = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(min_value=0.0, max_value=1.0))


def curves(orders: Sequence[float]) -> st.SearchStrategy[RdpCurve]:
    """Pure, Gaussian, Laplace and arbitrary curves (some with +∞ orders) on ``orders``."""
    n = len(orders)
    pure = st.floats(min_value=0.0, max_value=5.0).map(lambda e: RdpCurve.from_pure(e, orders))
    gaussian = st.builds(
        lambda d, s: RdpCurve.gaussian(d, s, orders),
        st.floats(min_value=0.0, max_value=10.0),
        st.floats(min_value=0.05, max_value=200.0),
    )
    laplace = st.builds(
        lambda shifts, e: RdpCurve.laplace(shifts, e, orders),
        st.lists(st.floats(min_value=0.0, max_value=5.0), min_size=1, max_size=3).filter(
            lambda s: sum(s) > 0
        ),
        st.floats(min_value=0.05, max_value=10.0),
    )
    arbitrary = st.builds(
        lambda values, p: RdpCurve(tuple(orders), tuple(values), p),
        st.lists(losses, min_size=n, max_size=n),
        losses,
    )
    return st.one_of(pure, gaussian, laplace, arbitrary)


def request_curves(orders: Sequence[float]) -> st.SearchStrategy[RdpCurve]:
    """Requests of the service's shape: mostly pure and Gaussian, a few with +∞ at the high orders."""
    n = len(orders)
    pure = st.floats(min_value=0.0, max_value=3.0).map(lambda e: RdpCurve.from_pure(e, orders))
    gaussian = st.builds(
        lambda d, s: RdpCurve.gaussian(d, s, orders),
        st.floats(min_value=0.01, max_value=3.0),
        st.floats(min_value=0.3, max_value=50.0),
    )
    ceiling = st.builds(
        lambda s, k: RdpCurve(
            tuple(orders), tuple(a / (2 * s * s) if j < k else math.inf for j, a in enumerate(orders))
        ),
        st.floats(min_value=0.5, max_value=20.0),
        st.integers(min_value=0, max_value=n),
    )
    return st.one_of(pure, pure, gaussian, gaussian, ceiling)


def realize(worst: RdpCurve, fraction: float) -> RdpCurve:
    """A realized curve ≤ ``worst``: finite values scaled by ``fraction``; +∞ kept (0 if fraction = 0)."""

    def scale(v: float) -> float:
        if math.isinf(v):
            return math.inf if fraction > 0 else 0.0
        return v * fraction

    return RdpCurve(worst.orders, tuple(scale(v) for v in worst.values), scale(worst.pure))


def charge_le(a: UnitsVector, b: UnitsVector) -> bool:
    """Slot-wise a ≤ b, where a slot with an infinite charge is +∞."""
    for j in range(len(a)):
        if b.is_infinite(j):
            continue
        if a.is_infinite(j) or a.finite[j] > b.finite[j]:
            return False
    return True


def close(x: float, y: float, rel: float) -> bool:
    if math.isinf(x) or math.isinf(y):
        return x == y
    return abs(x - y) <= rel * max(abs(x), abs(y), 1e-300)


# ----- curve algebra ------------------------------------------------------------------------------------
@SETTINGS
@given(st.data())
def test_addition_is_commutative(data: st.DataObject) -> None:
    orders = data.draw(grids)
    a, b = data.draw(curves(orders)), data.draw(curves(orders))
    assert a + b == b + a


@SETTINGS
@given(st.data())
def test_addition_is_associative_within_padding(data: st.DataObject) -> None:
    orders = data.draw(grids)
    a, b, c = (data.draw(curves(orders)) for _ in range(3))
    left, right = (a + b) + c, a + (b + c)
    for x, y in zip((*left.values, left.pure), (*right.values, right.pure), strict=True):
        assert close(x, y, 1e-13), (x, y)


@SETTINGS
@given(st.data())
def test_addition_dominates_each_operand(data: st.DataObject) -> None:
    orders = data.draw(grids)
    a, b = data.draw(curves(orders)), data.draw(curves(orders))
    total = a + b
    assert total >= a
    assert total >= b
    assert charge_le(UnitsVector.charge(a), UnitsVector.charge(total))


@SETTINGS
@given(st.data())
def test_maximum_is_between_operands_and_sum(data: st.DataObject) -> None:
    orders = data.draw(grids)
    a, b = data.draw(curves(orders)), data.draw(curves(orders))
    m = a.maximum(b)
    assert m >= a
    assert m >= b
    assert m <= a + b
    assert m == b.maximum(a)


# ----- rounding direction -------------------------------------------------------------------------------
@SETTINGS
@given(st.floats(min_value=0.0, max_value=1e12, allow_nan=False, allow_infinity=False))
def test_units_round_charges_up_and_capacities_down(x: float) -> None:
    up, down = units_up(x), units_down(x)
    assert up is not None
    exact = Decimal(repr(x))
    assert Decimal(up) / UNITS_PER_EPSILON >= exact
    assert Decimal(up - 1) / UNITS_PER_EPSILON < exact or up == 0
    assert Decimal(down) / UNITS_PER_EPSILON <= exact
    assert Decimal(down + 1) / UNITS_PER_EPSILON > exact
    assert up - down in (0, 1)


@SETTINGS
@given(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False))
def test_units_down_of_any_finite_value(x: float) -> None:
    assert Decimal(units_down(x)) / UNITS_PER_EPSILON <= Decimal(repr(x))


@SETTINGS
@given(st.lists(st.sampled_from([0.1, 0.2, 0.3, 0.7, 1e-12, 0.05]), min_size=1, max_size=60))
def test_sums_of_decimal_charges_never_drift(charges: list[float]) -> None:
    total = UnitsVector.zeros(2)
    for c in charges:
        total = total + UnitsVector.charge(RdpCurve.from_pure(c, (2.0,)))
    exact = sum((Decimal(repr(c)) for c in charges), Decimal(0))
    assert Decimal(total.finite[1]) / UNITS_PER_EPSILON == exact


# ----- conversions --------------------------------------------------------------------------------------
@SETTINGS
@given(st.data(), positive_deltas, positive_deltas)
def test_epsilon_at_delta_decreases_in_delta(data: st.DataObject, d1: float, d2: float) -> None:
    orders = data.draw(grids)
    curve = data.draw(curves(orders))
    small, large = min(d1, d2), max(d1, d2)
    assert epsilon_at_delta(curve, small) >= epsilon_at_delta(curve, large)
    # δ = 0 is the pure bound; δ > 0 can only be smaller (up to the few-ulp padding)
    assert epsilon_at_delta(curve, large) <= curve.pure * (1 + 1e-14)


@SETTINGS
@given(st.data(), positive_deltas)
def test_epsilon_at_delta_increases_in_the_curve(data: st.DataObject, delta: float) -> None:
    orders = data.draw(grids)
    a, b = data.draw(curves(orders)), data.draw(curves(orders))
    for bigger in (a + b, a.maximum(b)):
        assert a <= bigger
        assert epsilon_at_delta(a, delta) <= epsilon_at_delta(bigger, delta)


# ----- capacity -----------------------------------------------------------------------------------------
def cap_le(a: int | None, b: int | None) -> bool:
    return a is None or (b is not None and a <= b)


@SETTINGS
@given(grids, epsilons, epsilons, deltas)
def test_capacity_monotone_in_epsilon(orders: tuple[float, ...], e1: float, e2: float, delta: float) -> None:
    small, large = min(e1, e2), max(e1, e2)
    for a, b in zip(capacity_units(small, delta, orders), capacity_units(large, delta, orders), strict=True):
        assert cap_le(a, b)


@SETTINGS
@given(grids, epsilons, deltas, deltas)
def test_capacity_monotone_in_delta(orders: tuple[float, ...], epsilon: float, d1: float, d2: float) -> None:
    small, large = min(d1, d2), max(d1, d2)
    caps_small, caps_large = capacity_units(epsilon, small, orders), capacity_units(epsilon, large, orders)
    for a, b in zip(caps_small, caps_large, strict=True):
        assert cap_le(a, b)
    assert caps_small[-1] == caps_large[-1] == units_down(epsilon)


@SETTINGS
@given(grids, epsilons, deltas)
def test_capacity_never_exceeds_epsilon(orders: tuple[float, ...], epsilon: float, delta: float) -> None:
    for cap in capacity_units(epsilon, delta, orders):
        assert cap is None or 0 <= cap <= units_down(epsilon)


# ----- the filter: a simulation of the admission rule ---------------------------------------------------
def admissible(total: UnitsVector, caps: Sequence[int | None]) -> bool:
    return any(total.fits(caps))


def check_guarantee(
    spent: UnitsVector, caps: Sequence[int | None], epsilon: float, delta: float, orders: Sequence[float]
) -> None:
    assert admissible(spent, caps)  # some slot has spent ≤ capacity
    assert filter_epsilon(spent, delta, orders) <= epsilon + TOLERANCE


@SETTINGS
@given(st.data(), epsilons, deltas)
def test_filter_sequence_keeps_the_guarantee(data: st.DataObject, epsilon: float, delta: float) -> None:
    orders = data.draw(st.one_of(st.just(ORDERS), grids))
    caps = capacity_units(epsilon, delta, orders)
    requests = data.draw(st.lists(st.tuples(request_curves(orders), fractions_01), max_size=60))
    spent = UnitsVector.zeros(len(orders) + 1)
    admitted = 0
    for worst, fraction in requests:
        w = UnitsVector.charge(worst)
        if not admissible(spent + w, caps):
            continue
        admitted += 1
        realized = realize(worst, fraction)
        assert realized <= worst
        r = UnitsVector.charge(realized)
        assert charge_le(r, w)
        spent = spent + r
        check_guarantee(spent, caps, epsilon, delta, orders)
    check_guarantee(spent, caps, epsilon, delta, orders)
    if delta == 0.0:  # a pure filter: only the pure slot exists, every admitted request had a pure bound
        assert not spent.is_infinite(len(orders))
        assert spent.finite[-1] <= units_down(epsilon)


@SETTINGS
@given(epsilons, positive_deltas, st.floats(min_value=0.3, max_value=30.0))
def test_gaussian_only_filter_stops(epsilon: float, delta: float, sigma: float) -> None:
    """Repeating one Gaussian request: admitted exactly while some order's B(α) still has room."""
    caps = capacity_units(epsilon, delta, ORDERS)
    w = UnitsVector.charge(RdpCurve.gaussian(1.0, sigma, ORDERS))
    expected = max(
        (cap // w.finite[j] for j, cap in enumerate(caps[:-1]) if cap is not None and w.finite[j] > 0),
        default=0,
    )
    spent, admitted = UnitsVector.zeros(len(ORDERS) + 1), 0
    while admissible(spent + w, caps) and admitted <= expected:
        spent, admitted = spent + w, admitted + 1
    assert admitted == expected
    check_guarantee(spent, caps, epsilon, delta, ORDERS)


# ----- the filter: reserve / commit / abort --------------------------------------------------------------
class FilterMachine(RuleBasedStateMachine):
    """The service's ledger for one filter, with concurrent reservations."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.orders: tuple[float, ...] = ORDERS
        self.epsilon = 1.0
        self.delta = 1e-5
        self.caps: tuple[int | None, ...] = ()
        self.spent = UnitsVector.zeros(len(ORDERS) + 1)
        self.reserved = UnitsVector.zeros(len(ORDERS) + 1)
        self.outstanding: dict[int, UnitsVector] = {}
        self.next_id = 0

    @initialize(orders=st.one_of(st.just(ORDERS), grids), epsilon=epsilons, delta=deltas)
    def configure(self, orders: tuple[float, ...], epsilon: float, delta: float) -> None:
        self.orders, self.epsilon, self.delta = orders, epsilon, delta
        self.caps = capacity_units(epsilon, delta, orders)
        self.spent = UnitsVector.zeros(len(orders) + 1)
        self.reserved = UnitsVector.zeros(len(orders) + 1)

    def _admit(self, worst: RdpCurve) -> UnitsVector | None:
        w = UnitsVector.charge(worst)
        if admissible(self.spent + self.reserved + w, self.caps):
            self.reserved = self.reserved + w
            return w
        return None

    @rule(target=requests, data=st.data())
    def reserve(self, data: st.DataObject) -> object:
        worst = data.draw(request_curves(self.orders))
        if self._admit(worst) is None:
            return multiple()
        request_id = self.next_id
        self.next_id += 1
        self.outstanding[request_id] = UnitsVector.charge(worst)
        return (request_id, worst)

    @rule(data=st.data())
    def reserve_then_abort(self, data: st.DataObject) -> None:
        before = self.reserved
        w = self._admit(data.draw(request_curves(self.orders)))
        if w is not None:
            self.reserved = self.reserved - w
        assert self.reserved == before  # exact, even with +∞ parts

    @rule(request=consumes(requests), fraction=fractions_01)
    def commit(self, request: tuple[int, RdpCurve], fraction: float) -> None:
        request_id, worst = request
        w = self.outstanding.pop(request_id)
        realized = realize(worst, fraction)
        assert realized <= worst
        r = UnitsVector.charge(realized)
        assert charge_le(r, w)
        self.reserved = self.reserved - w
        self.spent = self.spent + r

    @rule(request=consumes(requests))
    def abort(self, request: tuple[int, RdpCurve]) -> None:
        request_id, _ = request
        before = self.reserved
        w = self.outstanding.pop(request_id)
        self.reserved = self.reserved - w
        assert self.reserved + w == before

    @invariant()
    def reserved_is_the_sum_of_outstanding(self) -> None:
        total = UnitsVector.zeros(len(self.orders) + 1)
        for w in self.outstanding.values():
            total = total + w
        assert self.reserved == total

    @invariant()
    def guarantee_holds(self) -> None:
        if not self.caps:
            return
        check_guarantee(self.spent, self.caps, self.epsilon, self.delta, self.orders)
        # the last admission left some slot with spent + reserved ≤ B; commits and aborts only lower it
        check_guarantee(self.spent + self.reserved, self.caps, self.epsilon, self.delta, self.orders)


TestFilterMachine = FilterMachine.TestCase
TestFilterMachine.settings = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
