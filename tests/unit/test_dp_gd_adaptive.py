"""Private adaptive clipping for ``dp_gd`` (Andrew, Thakkar, McMahan, Ramaswamy 2021; Theorem DPGD-ADAPT,
docs/privacy.md §8.3.6.1): the charge against ``dp_accounting`` and the closed form, the count's
sensitivity, the clip update, and the service mechanism's release."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import GaussianDpEvent, SelfComposedDpEvent
from dp_accounting.rdp import RdpAccountant

from mechanisms.accounting import DEFAULT_ORDERS, epsilon_at_delta
from mechanisms.base import PublicContext
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
    dp_gd_curve,
    grid_records,
    next_clip,
    noise_multiplier_for,
    regrid,
)
from mechanisms.noise import Noise

ORDERS = DEFAULT_ORDERS


def _config(z: float, share: float, steps: int = 7, neighboring: Neighboring = "replace_one") -> DpGdConfig:
    return DpGdConfig("squared", 0.01, steps, 0.5, 1.3, z, neighboring, 10.0, AdaptiveClip(count_share=share))


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
