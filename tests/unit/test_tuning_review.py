"""Privacy review of ``tuning.select`` (mechanisms/tuning/select.py, mechanisms/tuning/candidates.py).

What is pinned here (all exact or deterministic; each test well under 10 s):

* Theorem 11 (pure Algorithm 3, geometric latent) for **heterogeneous** candidates under **every** total order
  of a small output space: exact masses, |log ratio| ≤ ``pure_charges`` and ⊥ has ratio exactly 1. The
  engineer's tests only cover T identical copies under one order.
* Theorem 13 (exponential latent) with the module's own ``rdp_charges`` for heterogeneous drop parameters:
  the Def. 6 sums are ≤ 1 in both directions under many orders.
* The engineer's erratum of note §7.2 ((1, i) has log ratio exactly ε only at i = T).
* The logistic ERM solver of output perturbation converges far inside its iteration cap on adversarial
  (separable, λ = 1e-6) designs, so its data-dependent failure path is not reachable in practice.

What is demonstrated (findings of the review, both fixed; the tests below pin the fixes):

* Without padding, the amount of work equals the number of kept candidates, and revealing that count
  (through ``elapsed_seconds``) voids Theorem 11: the exact loss is T·ε, not 2ε + ε′. Fix: the service always
  pads (``pad_to_worst_case_time`` defaults to true and false is refused with a ParamsError); the library
  ``algorithm3`` keeps ``pad=False`` for simulations.
* ``objpert.logistic`` candidates ran with ObjPertConfig's default solver tolerance τ = 1e-6 without the
  ``minimum_tolerance`` guard that the stand-alone ``objpert.logistic`` mechanism enforces for its failure
  channel; for moderate n the certified stop was unreachable (every run failed after reading the data).
  Fix: each candidate's τ is raised to max(1e-6, 2 × the public minimum), the same τ in curve and fit.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
from scipy.integrate import quad

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import ParamsError, PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.learners.objective_perturbation import ObjPertConfig, minimum_tolerance
from mechanisms.noise import Noise
from mechanisms.tuning.candidates import SOLVER_TOLERANCE, objpert_sigma, solve_erm
from mechanisms.tuning.select import (
    TuningParams,
    TuningSelect,
    algorithm3,
    pure_charges,
    rdp_charges,
    sample_kept,
)


def _q1(eps: float) -> float:
    return math.exp(eps) / (1.0 + math.exp(eps))


def _rr_rdp(eps: float, alpha: float) -> float:
    p = _q1(eps)
    return math.log(p**alpha * (1 - p) ** (1 - alpha) + (1 - p) ** alpha * p ** (1 - alpha)) / (alpha - 1)


Outcome = tuple[int, int]


def _beats(q1s: list[float], rank: dict[Outcome, int], o: int, i: int) -> list[float]:
    """Q_j(U^j_{o,i}): probability that candidate j's output ranks above (o, i)."""
    return [
        sum((q1s[j] if oo else 1 - q1s[j]) for oo in (0, 1) if rank[(oo, j)] > rank[(o, i)])
        for j in range(len(q1s))
    ]


def _pure_masses(
    eps: list[float], eps_prime: float, q1s: list[float], rank: dict[Outcome, int]
) -> dict[Any, float]:
    """Exact masses of Algorithm 3 (geometric latent) on RR candidates under the total order ``rank``."""
    k = np.arange(0, math.ceil(45 / eps_prime) + 1, dtype=float)
    weight = -np.expm1(-eps_prime) * np.exp(-eps_prime * k)
    keep = [np.exp(-e * k) for e in eps]
    out: dict[Any, float] = {}
    for i in range(len(eps)):
        for o in (0, 1):
            beats = _beats(q1s, rank, o, i)
            term = keep[i] * (q1s[i] if o else 1 - q1s[i])
            for j in range(len(eps)):
                if j != i:
                    term = term * (1 - keep[j] * beats[j])
            out[(o, i)] = float(np.sum(weight * term))
    bottom = np.ones_like(k)
    for j in range(len(eps)):
        bottom = bottom * (1 - keep[j])
    out["bottom"] = float(np.sum(weight * bottom))
    return out


@pytest.mark.parametrize(
    ("eps", "eps_prime"), [([0.2, 1.0, 2.0], 0.1), ([1.5, 0.1, 0.7], 0.05), ([1.0, 1.0, 0.3], 0.3)]
)
def test_theorem11_exact_for_heterogeneous_candidates_under_every_order(
    eps: list[float], eps_prime: float
) -> None:
    charges = pure_charges(eps, eps_prime)
    outcomes = [(o, i) for i in range(len(eps)) for o in (0, 1)]
    smallest_slack = math.inf
    for perm in itertools.permutations(range(len(outcomes))):  # all 720 total orders on (o, i)
        rank = {outcomes[p]: r for r, p in enumerate(perm)}
        on_d = _pure_masses(eps, eps_prime, [_q1(e) for e in eps], rank)
        on_d2 = _pure_masses(eps, eps_prime, [1 - _q1(e) for e in eps], rank)
        assert sum(on_d.values()) == pytest.approx(1.0, abs=1e-9)
        assert on_d["bottom"] == pytest.approx(on_d2["bottom"], rel=1e-12)  # ⊥ free (data-independent)
        for key in outcomes:
            loss = abs(math.log(on_d[key] / on_d2[key]))
            assert loss <= charges[key[1]]
            smallest_slack = min(smallest_slack, charges[key[1]] - loss)
    assert smallest_slack < 0.08  # power: the bound is nearly attained by some order


def _exp_masses(
    drops: list[float], eps_prime: float, q1s: list[float], rank: dict[Outcome, int]
) -> dict[Any, float]:
    """Exact masses of Algorithm 3 with the Exp(ε′) latent (u = e^{−ε′x}), by adaptive quadrature."""
    r = [c / eps_prime for c in drops]
    out: dict[Any, float] = {}
    for i in range(len(drops)):
        for o in (0, 1):
            beats = _beats(q1s, rank, o, i)
            own = q1s[i] if o else 1 - q1s[i]

            def f(u: float, i: int = i, own: float = own, beats: list[float] = beats) -> float:
                value = float(u ** r[i] * own)
                for j in range(len(drops)):
                    if j != i:
                        value *= 1 - u ** r[j] * beats[j]
                return value

            out[(o, i)] = quad(f, 0.0, 1.0, epsabs=0.0, epsrel=1e-11, limit=200)[0]
    out["bottom"] = quad(
        lambda u: float(np.prod([1 - u**rj for rj in r])), 0.0, 1.0, epsabs=0.0, epsrel=1e-11
    )[0]
    return out


@pytest.mark.parametrize(
    ("eps0", "eps_prime", "alpha"),
    [([0.3, 1.0, 2.5], 0.1, 2.0), ([0.3, 1.0, 2.5], 0.1, 8.0), ([2.0, 0.2, 0.2], 0.05, 4.0)],
)
def test_theorem13_charges_hold_for_heterogeneous_drops(
    eps0: list[float], eps_prime: float, alpha: float
) -> None:
    drops = [_rr_rdp(e, alpha) for e in eps0]  # drop = the candidate's RDP at α (tightest allowed)
    table = rdp_charges(drops, eps_prime, [alpha], np.array(drops)[:, None])
    charge = [float(table.for_drop(c)[0]) for c in drops]
    bottom = float(table.bottom[0])
    outcomes = [(o, i) for i in range(len(drops)) for o in (0, 1)]
    perms = list(itertools.permutations(range(len(outcomes))))[::24]  # 30 orders
    for perm in perms:
        rank = {outcomes[p]: r for r, p in enumerate(perm)}
        on_d = _exp_masses(drops, eps_prime, [_q1(e) for e in eps0], rank)
        on_d2 = _exp_masses(drops, eps_prime, [1 - _q1(e) for e in eps0], rank)
        assert sum(on_d.values()) == pytest.approx(1.0, abs=1e-8)
        for p, q in ((on_d, on_d2), (on_d2, on_d)):
            total = sum(
                p[key] ** alpha
                * q[key] ** (1 - alpha)
                * math.exp(-(alpha - 1) * (bottom if key == "bottom" else charge[key[1]]))
                for key in p
            )
            assert total <= 1.0


def test_note_7_2_erratum_one_i_is_below_eps_before_the_last_index() -> None:
    """(1, 1), T = 2, ε = 1, ε′ = 0.1: log ratio 0.4173 (the note claims exactly ε for every (1, i))."""
    eps, eps_prime = 1.0, 0.1
    rank = {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}  # output first, then index
    on_d = _pure_masses([eps, eps], eps_prime, [_q1(eps)] * 2, rank)
    on_d2 = _pure_masses([eps, eps], eps_prime, [1 - _q1(eps)] * 2, rank)
    assert math.log(on_d[(1, 0)] / on_d2[(1, 0)]) == pytest.approx(0.4173, abs=1e-4)
    assert math.log(on_d[(1, 1)] / on_d2[(1, 1)]) == pytest.approx(eps, abs=1e-12)


# ----- the run-count (elapsed time) channel ----------------------------------------------------------------
def test_unpadded_work_equals_the_number_of_kept_candidates() -> None:
    """Without padding the work (hence ``elapsed_seconds``) is the kept count, a function of the secret k."""
    drops = [1.0] * 20
    counts = set()
    for seed in range(40):
        ran: list[int] = []

        def candidate(i: int, ran: list[int] = ran) -> tuple[tuple[float, ...], Any]:
            ran.append(i)
            return (0.0,), i

        mask = sample_kept(drops, "geometric", 0.1, Noise.seeded(seed))
        algorithm3(drops, 0.1, "geometric", candidate, Noise.seeded(seed))
        assert len(ran) == int(mask.sum())
        counts.add(len(ran))
    assert len(counts) >= 5  # it varies with the latent


def _masses_with_run_count(eps: float, eps_prime: float, copies: int, q1: float) -> dict[Any, float]:
    """Exact masses of (o, i, K): Algorithm 3 on T copies of RR, order (o, index), K = number of runs."""
    k = np.arange(0, math.ceil(45 / eps_prime) + 1, dtype=float)
    weight = -np.expm1(-eps_prime) * np.exp(-eps_prime * k)
    q = np.exp(-eps * k)
    out: dict[Any, float] = {}
    for runs in range(1, copies + 1):
        base = float(np.sum(weight * q**runs * (1 - q) ** (copies - runs)))
        for i in range(1, copies + 1):
            if runs - 1 <= i - 1:  # all runs output 0, i is the last kept index
                out[(0, i, runs)] = base * math.comb(i - 1, runs - 1) * (1 - q1) ** runs
            ones = 0.0
            for before in range(runs):
                after = runs - 1 - before
                if before <= i - 1 and after <= copies - i:
                    ones += math.comb(i - 1, before) * math.comb(copies - i, after) * (1 - q1) ** after
            out[(1, i, runs)] = base * q1 * ones
    out["bottom"] = float(np.sum(weight * (1 - q) ** copies))
    return out


def test_revealing_the_run_count_voids_the_pure_charge() -> None:
    eps, eps_prime, copies = 1.0, 0.1, 20
    on_d = _masses_with_run_count(eps, eps_prime, copies, _q1(eps))
    on_d2 = _masses_with_run_count(eps, eps_prime, copies, 1 - _q1(eps))
    assert sum(on_d.values()) == pytest.approx(1.0, abs=1e-9)
    charge = float(pure_charges([eps], eps_prime)[0])  # 2.1
    losses = {key: math.log(on_d2[key] / on_d[key]) for key in on_d if on_d[key] > 0}
    assert max(losses.values()) == pytest.approx(copies * eps, abs=1e-9)  # (0, T, T): T·ε = 20 ≫ 2.1
    excess = sum(on_d2[key] for key, loss in losses.items() if loss > charge)
    assert excess > 0.06  # not a negligible event: 6.5% of the mass under D′ exceeds the charge


_SCHEMA = {
    "columns": [
        {"name": "a", "type": "float", "min": -1, "max": 1},
        {"name": "b", "type": "float", "min": -1, "max": 1},
        {"name": "y", "type": "float", "min": 0, "max": 1},
        {"name": "g", "type": "categorical", "values": ["u", "v"]},
    ],
    "neighboring": "replace_one",
}


def _ctx(n: int) -> PublicContext:
    return PublicContext(DatasetSchema.model_validate(_SCHEMA), n, DEFAULT_ORDERS)


def _params(**changes: Any) -> TuningParams:
    base: dict[str, Any] = {
        "learner": "output_perturbation.logistic",
        "features": {"features": ["a", "b", "g"], "label": "y"},
        "epsilons": [0.1, 0.3, 1.0],
        "epsilon_prime": 0.05,
        "utility_bar": 0.6,
        "mode": "pure",
    }
    return TuningParams.model_validate({**base, **changes})


def test_service_default_hides_the_run_count() -> None:
    assert _params().pad_to_worst_case_time is True
    with pytest.raises(ParamsError):  # and it cannot be turned off
        TuningSelect().check(_params(pad_to_worst_case_time=False), _ctx(1000))
    # the service runs every candidate whatever the latent: the work is n, not the kept count
    import mechanisms.tuning.candidates as tc

    learner = tc.LEARNERS["output_perturbation.logistic"]
    original = learner.fit_and_score
    runs: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        runs.append(1)
        return original(*args, **kwargs)

    rng = np.random.default_rng(5)
    noise = Noise.seeded(5)
    table = {
        "a": rng.uniform(-1, 1, 1000),
        "b": rng.uniform(-1, 1, 1000),
        "y": rng.integers(0, 2, 1000).astype(float),
        "g": rng.integers(0, 2, 1000),
    }
    learner.fit_and_score = counting  # type: ignore[method-assign]
    try:
        counts = set()
        for _ in range(20):
            runs.clear()
            TuningSelect().run(_params(), _ctx(1000), table, noise)
            counts.add(len(runs))
    finally:
        learner.fit_and_score = original  # type: ignore[method-assign]
    assert counts == {3}


# ----- failure channel -----------------------------------------------------------------------------------
def test_logistic_erm_solver_converges_far_inside_its_cap_on_separable_data() -> None:
    import mechanisms.tuning.candidates as tc

    rng = np.random.default_rng(0)
    calls = [0]
    original = tc._logistic_grad_hess

    def counting(*args: Any) -> Any:
        calls[0] += 1
        return original(*args)

    n, d = 20_000, 5
    x = rng.normal(size=(n, d))
    x /= np.linalg.norm(x, axis=1)[:, None]
    y = np.where(x[:, 0] >= 0, 1.0, -1.0)  # separable, the hardest case for tiny λ
    tc._logistic_grad_hess = counting  # type: ignore[assignment]
    try:
        solve_erm(x, y, 1e-6, "classification", SOLVER_TOLERANCE / n)
    finally:
        tc._logistic_grad_hess = original
    assert 3 <= calls[0] <= 30  # the cap is 100 Newton iterations


def test_tuning_objpert_tolerance_is_below_the_public_minimum_for_moderate_n() -> None:
    """ObjPertConfig's default τ = 1e-6 (what the tuning candidate used before the fix) is unreachable."""
    eps, lam, order, d = 1.0, 1.0, 8.0, 5
    sigma = objpert_sigma(eps, lam, order)
    n_train = 40_000  # n = 50 000 rows with the default holdout 0.2
    config = ObjPertConfig(lam=lam, sigma=sigma, neighboring="replace_one")
    bounds = config.stopping_bounds(n_train, d)
    assert minimum_tolerance(lam, sigma, 1.0, d, n_train) > config.tau
    # worse: the public rounding slack alone exceeds the stopping target, so every run raises after
    # reading the data (ObjPertDidNotConverge, worst case charged, nothing released)
    assert bounds.public_slack(d) > 0.99 * config.tau


def test_tuning_refuses_objpert_whose_certified_stop_is_unreachable() -> None:
    """Adapted to the chosen fix ("raise τ" rather than "refuse"): at 50 000 rows, λ = 1, the request is
    accepted and every objpert candidate runs with a τ whose certified stop is reachable on every dataset
    (0.99τ ≥ 10 × the public rounding slack, i.e. τ ≥ ``minimum_tolerance``), in the curve and in the fit.
    Where no τ can work (n·d/λ beyond float64 precision) the request is refused with a ParamsError."""
    from mechanisms.learners.objective_perturbation import objpert_curve
    from mechanisms.tuning.candidates import LEARNERS, PublicShape, objpert_candidate_config

    params = _params(learner="objpert.logistic", mode="rdp", order=8.0, epsilons=[1.0], regularization=[1.0])
    ctx = _ctx(50_000)
    TuningSelect().check(params, ctx)
    n_train, d = 40_000, 5
    for config in params.grid():
        op = objpert_candidate_config(config.epsilon, config.reg, 8.0, d, n_train)
        assert op.tau >= minimum_tolerance(op.lam, op.sigma, 1.0, d, n_train)
        assert 0.99 * op.tau >= 10 * op.stopping_bounds(n_train, d).public_slack(d)
        shape = PublicShape(n_train, 10_000, d)
        assert objpert_curve(op, ctx.orders) <= LEARNERS["objpert.logistic"].curve(
            config, ctx.orders, 8.0, shape
        )
    with pytest.raises(ParamsError):
        TuningSelect().check(params, _ctx(10**14))
