"""The filter's pure semantics (service.filter.state): the RDP slots and the δ-ledger of approximate-DP
requests (docs/privacy/filter.md#filter,
docs/privacy/approximate.md#theorem-approx-filter): admission, reservation, commit, abort, and strict
parsing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mechanisms.accounting import UnitsVector
from service.filter.state import FilterSnapshot, FilterState, delta_units, read

SLOTS = 3
ZERO = UnitsVector.zeros(SLOTS)


def charge(units: int) -> UnitsVector:
    return UnitsVector((units,) * SLOTS, (0,) * SLOTS)


def state(capacity: int = 100, delta_capacity: int | None = 10) -> FilterState:
    return FilterState((capacity,) * SLOTS, ZERO, ZERO, delta_capacity)


def test_delta_is_admitted_only_within_the_share() -> None:
    flt = state(delta_capacity=10)
    assert flt.admits(charge(1), 10)
    assert not flt.admits(charge(1), 11)
    assert not state(delta_capacity=None).admits(charge(1), 1)
    assert state(delta_capacity=None).admits(charge(1), 0)  # requests without δ never need a share
    assert not flt.admits(charge(101), 1)  # both halves must fit


def test_commit_spends_the_reserved_delta_and_abort_releases_it() -> None:
    flt = state().reserve(charge(5), 4).reserve(charge(5), 4)
    assert (flt.delta_reserved, flt.delta_spent) == (8, 0)
    assert not flt.admits(charge(1), 3)  # 8 reserved + 3 > 10
    committed = flt.settle(charge(5), charge(2), 4)
    assert (committed.delta_reserved, committed.delta_spent) == (4, 4)
    assert committed.spent == charge(2)
    assert committed.reserved == charge(5)
    aborted = committed.settle(charge(5), None, 4)
    assert (aborted.delta_reserved, aborted.delta_spent) == (0, 4)
    assert aborted.admits(charge(1), 6)
    assert not aborted.admits(charge(1), 7)


def test_settling_more_delta_than_reserved_is_an_error() -> None:
    with pytest.raises(ValueError, match="more δ than is reserved"):
        state().reserve(charge(1), 2).settle(charge(1), charge(1), 3)


def test_ever_admits_needs_a_share_large_enough() -> None:
    assert state(delta_capacity=10).ever_admits(charge(1), 10)
    assert not state(delta_capacity=10).ever_admits(charge(1), 11)
    assert not state(delta_capacity=None).ever_admits(charge(1), 1)


@pytest.mark.parametrize("text", ["1e5", "-1", "1.0", " 1", "", "١"])
def test_stored_delta_amounts_are_parsed_strictly(text: str) -> None:
    with pytest.raises(ValueError, match="decimal digits"):
        delta_units(text)


def test_read_takes_the_stored_delta_ledger() -> None:
    row = FilterSnapshot("*", [100] * SLOTS, ZERO.to_json(), ZERO.to_json(), "10", "3", "4")
    flt = read(row)
    assert (flt.delta_capacity, flt.delta_spent, flt.delta_reserved) == (10, 3, 4)
    assert flt.admits(charge(1), 3)
    assert not flt.admits(charge(1), 4)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 6), st.sampled_from(["commit", "abort"])), max_size=25
    )
)
def test_admitted_requests_never_overspend_delta(steps: list[tuple[int, int, str]]) -> None:
    """Admit what fits, settle every admitted request: spent + reserved stays within capacity at every
    step, and the final δ spent is the sum of the committed requests' δ."""
    flt, committed = state(capacity=200, delta_capacity=20), 0
    for units, delta, outcome in steps:
        if not flt.admits(charge(units), delta):
            continue
        flt = flt.reserve(charge(units), delta)
        assert flt.delta_spent + flt.delta_reserved <= 20
        realized = charge(units // 2) if outcome == "commit" else None
        flt = flt.settle(charge(units), realized, delta)
        committed += delta if outcome == "commit" else 0
    assert (flt.delta_spent, flt.delta_reserved) == (committed, 0)


def test_a_ledger_body_is_encoded_by_the_published_recipe() -> None:
    """Clients verify the chain by re-encoding each parsed body with ``json.dumps(sort_keys=True,
    separators=(",", ":"), ensure_ascii=False)``: the body's text must be exactly that (a faster encoder
    writing ``1e-6`` for ``1e-06`` would break every client's verification)."""
    from service.filter.ledger import canonical_json

    body = {"params": {"epsilon": 1e-06, "scale": 2.5e16}, "actor": "anaïs", "at": "2026-12-02T01:00Z"}
    expected = '{"actor":"anaïs","at":"2026-12-02T01:00Z","params":{"epsilon":1e-06,"scale":2.5e+16}}'
    assert canonical_json(body) == expected
