"""Private adaptive clipping for ``dp_gd`` (Andrew, Thakkar, McMahan, Ramaswamy 2021; Theorem DPGD-ADAPT,
docs/privacy/gradient_descent.md#theorem-dpgd-adapt): the charge against ``dp_accounting`` and the closed
form, the count's sensitivity, the clip update, and the service mechanism's release."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from dp_accounting import GaussianDpEvent, SelfComposedDpEvent
from dp_accounting.rdp import RdpAccountant

from mechanisms.accounting import DEFAULT_ORDERS, epsilon_at_delta
from mechanisms.base import ParamsError, PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.learners.dp_gd import (
    AdaptiveClip,
    DpGdConfig,
    DpGdMechanism,
    DpGdParams,
    Neighboring,
    adaptive_dp_gd_train,
    adaptive_split,
    clip_count,
    count_noise_units,
    dp_gd_curve,
    gradient_multiplier,
    grid_records,
    next_clip,
    noise_multiplier_for,
    noise_units,
    regrid,
    term_unit,
)
from mechanisms.noise import Noise

ORDERS = DEFAULT_ORDERS


def _config(z: float, share: float, steps: int = 7, neighboring: Neighboring = "replace_one") -> DpGdConfig:
    return DpGdConfig("squared", 0.01, steps, 0.5, 1.3, z, neighboring, 10.0, AdaptiveClip(0.5, 0.2, share))


@pytest.mark.parametrize("neighboring", ["replace_one", "add_remove"])
@pytest.mark.parametrize(("z", "share"), [(0.8, 0.05), (3.16, 0.1), (12.0, 0.5), (1.1, 0.9)])
def test_charge_matches_dp_accounting_composition(neighboring: Neighboring, z: float, share: float) -> None:
    config = _config(z, share, neighboring=neighboring)
    ours = np.asarray(dp_gd_curve(config, neighboring, ORDERS).values)
    z_g, sigma_b = adaptive_split(z, share)
    accountant = RdpAccountant(list(ORDERS))
    step = [GaussianDpEvent(noise_multiplier=z_g), GaussianDpEvent(noise_multiplier=sigma_b / 1.0)]
    for event in step:
        accountant.compose(SelfComposedDpEvent(event, config.steps))
    theirs = np.asarray(accountant._rdp, dtype=float)  # no public getter for the composed RDP vector
    assert np.all(ours >= theirs)
    np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=0.0)
    # the combined-noise closed form: the same T·α/(2z²) as fixed clipping (the count costs a share φ)
    closed = config.steps * np.asarray(ORDERS) / (2 * z * z)
    np.testing.assert_allclose(ours, closed, rtol=1e-9, atol=0.0)


def test_adaptive_charge_never_exceeds_the_fixed_one_and_meets_the_target() -> None:
    z = noise_multiplier_for(1.0, 1e-6, 50, ORDERS)
    adaptive = _config(z, 0.05, steps=50)
    fixed = DpGdConfig("squared", 0.01, 50, 0.5, 1.3, z, "replace_one", 10.0)
    ours = dp_gd_curve(adaptive, "replace_one", ORDERS)
    base = dp_gd_curve(fixed, "replace_one", ORDERS)
    assert all(a <= b * (1 + 1e-12) for a, b in zip(ours.values, base.values, strict=True))
    assert epsilon_at_delta(ours, 1e-6) <= 1.0


def test_mismatched_relation_never_undercharges() -> None:
    config = _config(2.0, 0.2, neighboring="add_remove")  # noise for add/remove (Δ = C), asked replace-one
    asked = dp_gd_curve(config, "replace_one", ORDERS).values
    z_g, sigma_b = adaptive_split(2.0, 0.2)
    for alpha, value in zip(ORDERS, asked, strict=True):
        assert value >= config.steps * alpha * (4 / (2 * z_g * z_g) + 1 / (2 * sigma_b * sigma_b))


def test_count_moves_by_at_most_one_on_neighbours() -> None:
    rng = np.random.default_rng(3)
    n, d = 200, 4
    x = rng.normal(size=(n, d))
    y = rng.uniform(-1, 1, size=n)
    for trial in range(50):
        theta = rng.normal(size=d) * 3
        clip = float(rng.uniform(0.05, 3))
        x2, y2 = x.copy(), y.copy()
        x2[trial] = rng.normal(size=d) * 100
        y2[trial] = rng.uniform(-50, 50)
        a = clip_count(theta, grid_records(x, y, clip), "squared", clip)
        b = clip_count(theta, grid_records(x2, y2, clip), "squared", clip)
        assert abs(a - b) <= 1
        norms = np.abs(x @ theta - y) * np.linalg.norm(x, axis=1)
        assert abs(a - int(np.sum(norms <= clip))) <= 2  # grid rounding touches only ties


def test_next_clip_is_a_clamped_geometric_step() -> None:
    config = _config(2.0, 0.1)
    assert next_clip(config, 1.0, 50, 100.0) == pytest.approx(1.0)  # b/n = γ = 0.5: no move
    assert next_clip(config, 1.0, 100, 100.0) == pytest.approx(math.exp(-0.1))
    assert next_clip(config, 1.0, -(10**9), 100.0) == pytest.approx(min(math.exp(50.0), 1e6))
    assert next_clip(config, 1e-6, 10**9, 100.0) == 1e-6


@pytest.mark.parametrize("start", [0.01, 100.0])
def test_clip_tracks_the_median_gradient_norm(start: float) -> None:
    rng = np.random.default_rng(0)
    n, d = 4000, 3
    x = rng.normal(size=(n, d)) / 2
    y = np.clip(x @ rng.normal(size=d) + 0.3 * rng.normal(size=n), -1, 1)
    config = DpGdConfig(
        "squared", 0.01, 80, 1.0, start, 3.0, "replace_one", 10.0, AdaptiveClip(0.5, 0.3, 0.05)
    )
    path, clips, counts = adaptive_dp_gd_train(config, x, y, float(n), Noise.seeded(4))
    assert clips.shape == (80,)
    assert counts.shape == (80,)
    norms = np.abs(x @ path[-2] - y) * np.linalg.norm(x, axis=1)
    assert clips[-1] == pytest.approx(float(np.median(norms)), rel=0.15)


def _ctx() -> PublicContext:
    schema = DatasetSchema.model_validate(
        {
            "columns": [
                {"name": "a", "type": "float", "min": -1, "max": 1},
                {"name": "b", "type": "float", "min": -1, "max": 1},
                {"name": "y", "type": "float", "min": -1, "max": 1},
            ],
            "neighboring": "replace_one",
        }
    )
    return PublicContext(schema, 300, ORDERS)


def test_mechanism_worst_case_is_public_and_equal_to_fixed_clipping() -> None:
    mech = DpGdMechanism()
    base = {"features": ["a", "b"], "label": "y", "model": "ridge", "steps": 20}
    target = {"target_epsilon": 1.0, "target_delta": 1e-6}
    fixed = DpGdParams.model_validate(base | target)
    adaptive = DpGdParams.model_validate(base | target | {"clipping": "adaptive", "clip": 0.1})
    ctx = _ctx()
    mech.check(adaptive, ctx)
    worst = mech.worst_case(adaptive, ctx)
    assert worst.values == pytest.approx(mech.worst_case(fixed, ctx).values, rel=1e-9)
    assert epsilon_at_delta(worst, 1e-6) <= 1.0
    rng = np.random.default_rng(1)
    table = {"a": rng.uniform(-1, 1, 300), "b": rng.uniform(-1, 1, 300), "y": rng.uniform(-1, 1, 300)}
    release = mech.run(adaptive, ctx, table, Noise.seeded(2))
    assert release.realized == worst
    clipping = release.output["clipping"]
    assert clipping["mode"] == "adaptive"
    assert len(clipping["clip_path"]) == 20
    assert clipping["clip_path"][0] == 0.1
    assert release.output["columns"]


@pytest.mark.parametrize("clip", [1e-6, 0.013, 0.5, 7.0, 3e4])
def test_regrid_equals_grid_records_at_the_new_clip(clip: float) -> None:
    rng = np.random.default_rng(9)
    x = rng.normal(size=(300, 5)) * np.exp(rng.uniform(-5, 5, size=(300, 1)))
    x[3] = 0.0
    y = rng.uniform(-2, 2, size=300)
    base = grid_records(x, y, 1.0, noise_multiplier=3.0)
    fresh = grid_records(x, y, clip, noise_multiplier=3.0)
    moved = regrid(base, clip, 3.0)
    assert moved.unit == fresh.unit
    assert moved.chunk == fresh.chunk
    np.testing.assert_array_equal(moved.cap, fresh.cap)
    np.testing.assert_array_equal(moved.rows, fresh.rows)


@pytest.mark.parametrize("neighboring", ["replace_one", "add_remove"])
@pytest.mark.parametrize(("z", "share"), [(0.3, 0.05), (1.99, 0.05), (3.16, 0.5), (700.0, 0.9)])
def test_charge_covers_the_noise_drawn_at_every_clip(
    neighboring: Neighboring, z: float, share: float
) -> None:
    """Per step, the RDP of what is really drawn at clip C_t, α·Δ(C_t)²/(2(t·ω)²) + α/(2t_b²) in exact
    rationals (t·ω the gradient noise std on the grid of C_t, t_b the count's integer std, sensitivities
    Δ(C_t) and 1), is ≤ the charged curve / T, for C_t over the whole clip range [1e-6, 1e6] (C_t is
    data-dependent through the released counts, so the charge must hold for every value it can take)."""
    config = _config(z, share, steps=5, neighboring=neighboring)
    charged = dp_gd_curve(config, neighboring, ORDERS).values
    t_b = count_noise_units(z, share)
    assert t_b >= z / math.sqrt(share)
    rng = np.random.default_rng(11)
    clips = [1e-6, 1e6, 1.0, 2.0, *np.exp(rng.uniform(math.log(1e-6), math.log(1e6), 300)).tolist()]
    for clip in clips:
        delta = Fraction(2 * clip if neighboring == "replace_one" else clip)
        std = noise_units(config, clip) * Fraction(term_unit(clip, gradient_multiplier(config)))
        assert std >= Fraction(z / math.sqrt(1 - share)) * delta  # z/√(1 − φ)·Δ(C), un-inflated
        per_order = (delta / std) ** 2 + Fraction(1, t_b * t_b)  # times α/2
        for alpha, value in zip(ORDERS, charged, strict=True):
            assert Fraction(alpha) / 2 * per_order * config.steps <= Fraction(value), (clip, alpha)


def _discrete_gaussian_rdp(t: int, shift: int, alpha: float) -> float:
    """D_α(N_Z(shift, t²) ‖ N_Z(0, t²)) by summation over |x| ≤ 60t + |shift| (the rest is < e^{−1800})."""
    x = np.arange(-60 * t - abs(shift), 60 * t + abs(shift) + 1, dtype=np.float64)
    log_p = -((x - shift) ** 2) / (2.0 * t * t)
    log_q = -(x * x) / (2.0 * t * t)

    def lse(v: np.ndarray) -> float:
        top = float(np.max(v))
        return top + math.log(float(np.sum(np.exp(v - top))))

    log_p = log_p - lse(log_p)
    log_q = log_q - lse(log_q)
    return lse(alpha * log_p + (1.0 - alpha) * log_q) / (alpha - 1.0)


@pytest.mark.parametrize(("z", "share"), [(0.3, 0.05), (0.8, 0.05), (1.5, 0.5), (3.16, 0.9), (12.0, 0.01)])
def test_count_noise_is_a_discrete_gaussian_within_its_share(z: float, share: float) -> None:
    """The count (integer, sensitivity 1) gets N_Z(0, t_b²): its exact Rényi divergence at shift 1 is at most
    the count's share α·φ/(2z²) = α/(2σ_b²) of the per-step charge (Canonne, Kamath, Steinke 2020, checked
    here by summation rather than assumed)."""
    t_b = count_noise_units(z, share)
    for alpha in (1.5, 2.0, 4.0, 16.0, 64.0, 256.0):
        exact = _discrete_gaussian_rdp(t_b, 1, alpha)
        assert 0.0 < exact <= alpha * share / (2 * z * z) * (1 + 1e-9), (alpha, exact)


def test_released_grid_is_the_grid_used() -> None:
    """z = 8100 and z_g = 8100/√0.95 ≈ 8310 straddle 2^13, so their term grids (``term_bits``) differ by
    2×: the release must state the grid of z_g, the one the noisy sums are on (noise_std = t·granularity,
    t an integer)."""
    mech = DpGdMechanism()
    ctx = _ctx()
    params = DpGdParams.model_validate(
        {
            "features": ["a", "b"],
            "label": "y",
            "model": "ridge",
            "steps": 3,
            "noise_multiplier": 8100.0,
            "clipping": "adaptive",
        }
    )
    rng = np.random.default_rng(1)
    table = {"a": rng.uniform(-1, 1, 300), "b": rng.uniform(-1, 1, 300), "y": rng.uniform(-1, 1, 300)}
    output = mech.run(params, ctx, table, Noise.seeded(2)).output
    z_g = output["clipping"]["gradient_noise_multiplier"]
    assert term_unit(1.0, z_g) != term_unit(1.0, 8100.0)
    granularity = output["noisy_sum_grid"]["granularity"]
    assert granularity == term_unit(1.0, z_g)
    units = output["noise_std"] / granularity
    assert units == int(units)
    assert units >= z_g * 2.0 / granularity


def test_count_noise_beyond_the_sampler_is_refused_by_check() -> None:
    """φ so small that z/√φ > 2^52 used to pass ``check`` and fail inside the run; now a 4xx on the field."""
    params = DpGdParams.model_validate(
        {
            "features": ["a", "b"],
            "label": "y",
            "model": "ridge",
            "steps": 3,
            "noise_multiplier": 2.0,
            "clipping": "adaptive",
            "count_noise_share": 1e-40,
        }
    )
    with pytest.raises(ParamsError) as caught:
        DpGdMechanism().check(params, _ctx())
    assert caught.value.field == "count_noise_share"
