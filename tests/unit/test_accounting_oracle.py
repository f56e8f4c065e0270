"""Cross-checks of the accounting core against Google's ``dp_accounting`` (a test-only dependency).

Conventions of dp_accounting 0.6.0 (read from ``dp_accounting/rdp/rdp_privacy_accountant.py`` and
``dp_accounting/dp_event.py``):
* ``GaussianDpEvent(noise_multiplier)``: noise std / ℓ2 sensitivity, so σ/Δ₂; RDP α/(2·nm²) (q = 1).
* ``LaplaceDpEvent(noise_multiplier)``: Laplace scale / ℓ1 sensitivity, so b/Δ₁; the accountant uses
  ε = 1/nm in Mironov 2017 Prop. 6 (``_laplace_rdp``).
* ``get_epsilon(δ)``: Balle et al. 2020 / Asoodeh et al. conversion
  ε = r + log1p(−1/α) − log(δα)/(α−1), minimised over the orders (orders ≤ 1.01 give +∞, and an order with
  δ² + expm1(−r) > 0 gives 0 through the KL bound; neither occurs for the parameters below).

Our values must never be below theirs (we only ever round up) and must agree to 1e-9 relative.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import GaussianDpEvent, LaplaceDpEvent
from dp_accounting.rdp import RdpAccountant

from mechanisms.accounting import (
    DEFAULT_ORDERS,
    RdpCurve,
    epsilon_at_delta,
    epsilon_at_delta_tight,
    laplace_scale,
)

ORDERS = DEFAULT_ORDERS
ODD_ORDERS = (1.3, 1.7, 2.0, 3.5, 7.25, 19.0, 77.0, 300.0)
REL = 1e-9


def accountant_rdp(accountant: RdpAccountant) -> np.ndarray:
    # dp_accounting exposes no public getter for the composed RDP vector.
    return np.asarray(accountant._rdp, dtype=float)


def assert_above_and_close(ours: tuple[float, ...] | list[float], theirs: np.ndarray) -> None:
    ours_array = np.asarray(ours, dtype=float)
    assert np.all(ours_array >= theirs), (ours_array - theirs) / theirs
    np.testing.assert_allclose(ours_array, theirs, rtol=REL, atol=0.0)


# ----- Gaussian RDP -------------------------------------------------------------------------------------
@pytest.mark.parametrize("orders", [ORDERS, ODD_ORDERS], ids=["default", "odd"])
@pytest.mark.parametrize("sigma", [0.77, 1.3, 4.1, 17.0, 123.4])
@pytest.mark.parametrize("l2", [0.3, 1.0, 2.6])
def test_gaussian_rdp_matches_dp_accounting(orders: tuple[float, ...], sigma: float, l2: float) -> None:
    ours = RdpCurve.gaussian(l2, sigma, orders)
    accountant = RdpAccountant(list(orders))
    accountant.compose(GaussianDpEvent(noise_multiplier=sigma / l2))
    assert_above_and_close(ours.values, accountant_rdp(accountant))


# ----- Laplace RDP --------------------------------------------------------------------------------------
@pytest.mark.parametrize("orders", [ORDERS, ODD_ORDERS], ids=["default", "odd"])
@pytest.mark.parametrize(
    ("l1", "epsilon"), [(1.0, 0.37), (1.7, 1.3), (0.45, 2.9), (1.0, 7.7), (13.0, 0.61), (2.0, 0.93)]
)
def test_laplace_rdp_matches_dp_accounting(orders: tuple[float, ...], l1: float, epsilon: float) -> None:
    ours = RdpCurve.laplace([l1], epsilon, orders)
    accountant = RdpAccountant(list(orders))
    accountant.compose(LaplaceDpEvent(noise_multiplier=laplace_scale(l1, epsilon) / l1))
    assert_above_and_close(ours.values, accountant_rdp(accountant))
    assert ours.pure == epsilon


@pytest.mark.parametrize("epsilon", [0.1, 0.0123, 1e-3, 1e-5])
def test_laplace_rdp_small_epsilon_not_below_dp_accounting(epsilon: float) -> None:
    # Regression: the logaddexp form of Prop. 6 cancelled for small ε and fell below dp_accounting's value.
    # Both sides lose digits here (dp_accounting's log1p form cancels too), and αε²/2 (zCDP) is used
    # where it is smaller, so only 1e-5 agreement is asked.
    ours = RdpCurve.laplace([1.0], epsilon, ORDERS)
    accountant = RdpAccountant(list(ORDERS))
    accountant.compose(LaplaceDpEvent(noise_multiplier=laplace_scale(1.0, epsilon)))
    theirs = accountant_rdp(accountant)
    assert np.all(np.asarray(ours.values) >= theirs)
    np.testing.assert_allclose(ours.values, theirs, rtol=1e-5, atol=0.0)


def test_laplace_coordinates_compose_like_independent_events() -> None:
    shifts = (0.4, 0.4, 1.2)
    epsilon = 1.9
    ours = RdpCurve.laplace(shifts, epsilon, ORDERS)
    scale = laplace_scale(math.fsum(shifts), epsilon)
    accountant = RdpAccountant(list(ORDERS))
    for shift in shifts:
        accountant.compose(LaplaceDpEvent(noise_multiplier=scale / shift))
    assert_above_and_close(ours.values, accountant_rdp(accountant))


# ----- conversions --------------------------------------------------------------------------------------
@pytest.mark.parametrize("delta", [1e-5, 1e-7, 1e-10, 0.013])
@pytest.mark.parametrize("count", [1, 3, 10, 250])
@pytest.mark.parametrize(("l2", "sigma"), [(1.0, 0.77), (1.0, 4.1), (2.6, 17.0), (0.3, 1.3)])
def test_tight_conversion_matches_dp_accounting(delta: float, count: int, l2: float, sigma: float) -> None:
    curve = RdpCurve.gaussian(l2, sigma, ORDERS)
    total = curve
    for _ in range(count - 1):
        total = total + curve
    accountant = RdpAccountant(list(ORDERS))
    accountant.compose(GaussianDpEvent(noise_multiplier=sigma / l2), count)
    assert_above_and_close(total.values, accountant_rdp(accountant))
    theirs = accountant.get_epsilon(delta)
    tight = epsilon_at_delta_tight(total, delta)
    assert tight >= theirs
    assert tight == pytest.approx(theirs, rel=REL)
    # The Mironov conversion (the only one valid ex-post) is never tighter than Balle et al.
    assert epsilon_at_delta(total, delta) >= tight


@pytest.mark.parametrize("delta", [1e-5, 1e-8])
def test_tight_conversion_of_a_mixed_composition(delta: float) -> None:
    gaussian = RdpCurve.gaussian(1.0, 3.3, ORDERS)
    laplace = RdpCurve.laplace([1.0], 0.7, ORDERS)
    total = gaussian + laplace + laplace
    accountant = RdpAccountant(list(ORDERS))
    accountant.compose(GaussianDpEvent(noise_multiplier=3.3))
    accountant.compose(LaplaceDpEvent(noise_multiplier=laplace_scale(1.0, 0.7)), 2)
    assert_above_and_close(total.values, accountant_rdp(accountant))
    theirs = accountant.get_epsilon(delta)
    assert epsilon_at_delta_tight(total, delta) >= theirs
    assert epsilon_at_delta_tight(total, delta) == pytest.approx(theirs, rel=REL)
    assert epsilon_at_delta(total, delta) >= epsilon_at_delta_tight(total, delta)


def test_pure_curve_conversion_is_capped_by_the_pure_bound() -> None:
    # dp_accounting has no pure bound; ours clamps the converted ε to ε_pure (valid for an ex-ante pure ε).
    curve = RdpCurve.laplace([1.0], 0.5, ORDERS)
    accountant = RdpAccountant(list(ORDERS))
    accountant.compose(LaplaceDpEvent(noise_multiplier=laplace_scale(1.0, 0.5)))
    theirs = accountant.get_epsilon(1e-9)
    assert theirs > 0.5
    for ours in (epsilon_at_delta_tight(curve, 1e-9), epsilon_at_delta(curve, 1e-9)):
        assert 0.5 <= ours <= 0.5 * (1 + 1e-14)  # the pure bound, padded up by a few ulps
