"""Ex-post private hyperparameter tuning, including choosing ε itself: the selection numerics.

Source: Ghazi, Kamath, Knop, Kumar, Manurangsi, Zhang, "Private hyperparameter tuning with ex-post
guarantee" (2025; cited "Ghazi et al." with the paper's own section, algorithm and theorem numbers). The
service mechanism ``tuning.select`` built on these functions lives in ``mechanisms.tuning.candidates`` (base
learners) and at the bottom of this module (``TuningSelect``). Docs: docs/mechanisms/tuning.md,
docs/privacy/tuning.md#tuning.

Algorithm 3 (best-of with random dropping, Ghazi et al. §4)
-----------------------------------------------------------
Candidates M_1 … M_n (a fixed list, repeats allowed), **drop parameters** c_1 … c_n fixed before running,
ε′ > 0, and a data-independent total order on outputs with ⊥ minimal::

    k ← latent (Geom_{e^{−ε′}} on {0,1,…} for pure DP; Exp with rate ε′ for RDP)      # SECRET
    for i = 1..n: keep i with probability e^{−c_i·k}                                   # SECRET
                  if kept: o_i ← M_i(D)
    return max over kept (o_i, i), or ⊥ if nothing was kept

* **Pure (Theorem 11)**: if every M_j is c_j-DP (pure), the output (o, i) is ex-post (2c_i + ε′)-DP and ⊥
  is 0 (P(⊥) does not depend on the data). The charge does not depend on n or on the other candidates.
* **RDP (Theorem 13)**, at one order α: if every M_j is (α, c_j)-RDP (i.e. its RDP at α is ≤ c_j), then
  with τ = Σ_j ε′/(ε′ + c_j) (the expected number of runs, repeats included) and any ℓ_i ≥ 0::

      ε̃_α(o, i) = (2 + ℓ_i)c_i + (1 + ℓ_i)ε′ + [log(1 + τ) + Σ_{j≠i} e^{−c_j(1 + αℓ_i)}]/(α − 1)
      ε̃_α(⊥)    = log(1 + τ)/(α − 1)

  ℓ_i is analysis-only slack, optimised per (α, c_i) by bisection on the derivative (the objective is
  convex, docs/privacy/tuning.md#tuning-theorems); the charge is always **evaluated at the ℓ actually used**.
  A mechanism that is (α, ε_i(α))-RDP with ε_i(α) ≤ c_i is (α, c_i)-RDP, so the paper's statement applies with
  c_i in every place. At an order where some candidate's RDP exceeds its drop parameter nothing is proven:
  every outcome is charged +∞ there (docs/privacy/rules.md#rule-infinity-unproven).

Algorithm 2 (known threshold, Ghazi et al. §3.2, Theorem 10): the first kept candidate whose output passes a
data-independent threshold is released; charge 2c_i + ε′ for it and ε′ for ⊥ (geometric latent).

The worst case is max(ε̃(⊥), max_i ε̃(o, i)) order by order, computed from the public list before the data
is touched (docs/privacy/tuning.md#tuning-filter-needs).

Secrets (docs/privacy/tuning.md#tuning-secrets): the latent k, the keep bits, which and how many candidates
ran, their outputs and timings. Nothing here returns them except ``sample_kept`` (a sampler for tests and
simulations; the service never calls it directly and never exposes its result). The service mechanism always
pads: every candidate runs whatever k is (dropped ones are discarded), and noise-free shared work (the ERM
minimiser per λ) is done before k is drawn, so the amount of work does not depend on k;
``pad_to_worst_case_time`` must be true (docs/privacy/tuning.md#tuning-secrets: the run count voids Theorem
11, and what remains of the timing channel).

Numerics (docs/privacy/finite_precision_tuning.md#fp-tuning). The latent and the keep bits are exact
(``mechanisms/noise/tuning.py``, docs/privacy/finite_precision.md#finite-precision): k ~ Geom_{e^{−ε′}} by
exact inversion of one uniform real revealed 64 bits at a time
(k = max{m : U < e^{−ε′m}}, each comparison decided by a rigorous integer enclosure of e^{−ε′m}); given k,
candidate i is kept iff a fresh uniform V_i < e^{−c_i k} (same exact comparison). The exponential latent of
Theorem 13 is never materialised: its keep mask is the set of clocks still running when X ~ Exp(ε′) rings in
an exact race against T_i ~ Exp(c_i) (rational rates, one ``randbelow`` per event), which has exactly the
law of keeping i with probability e^{−c_i x} given x. ε′ and the c_i are read as the exact binary values of
their floats, the very numbers the charges use. The Theorem 13 charge is computed per distinct drop value
(thousands of candidates with a few distinct ε cost nothing extra), in blocks to bound memory, and padded
upwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel

from mechanisms.accounting import RdpCurve
from mechanisms.base import (
    ParamsChecked,
    ParamsError,
    ProgressFn,
    PublicContext,
    Release,
    Table,
    no_progress,
)
from mechanisms.learners.features import check_features, column_names, design_matrix, dimension
from mechanisms.noise import Noise
from mechanisms.noise.tuning import exponential_race, geometric_latent, keep_given_latent
from mechanisms.tuning.candidates import (
    LEARNERS,
    CandidateConfig,
    PublicShape,
    objpert_candidate_config,
    objpert_sigma,
    split_rows,
)
from mechanisms.tuning.charges import Latent, check_drop, check_eps_prime, pure_charges, rdp_charges
from mechanisms.tuning.params import TuningParams


# ----- samplers (exact: mechanisms/noise/tuning.py) ----------------------------------------------------
def draw_latent(noise: Noise, latent: Latent, eps_prime: float, size: int | None = None) -> Any:
    """k ~ Geom_{e^{−ε′}} on {0,1,…} (P(k ≥ m) = e^{−ε′m} exactly, for the float ε′ read exactly).

    Exact inversion of one uniform real per draw (``geometric_latent``). The exponential latent of
    Theorem 13 is never materialised: ``sample_kept`` draws its keep mask from the exact law by an
    exponential race, so asking for x itself is an error.
    """
    eps_prime = check_eps_prime(eps_prime)
    if latent == "geometric":
        k = geometric_latent(noise, eps_prime, 1 if size is None else size)
        return int(k[0]) if size is None else k
    if latent == "exponential":
        raise ValueError("the exponential latent is not materialised; use sample_kept (exact race)")
    raise ValueError(f"unknown latent {latent!r}")


def sample_kept(
    drop: Sequence[float] | np.ndarray,
    latent: Latent,
    eps_prime: float,
    noise: Noise,
    size: int | None = None,
) -> np.ndarray:
    """The drop step with **one** shared latent: a boolean keep mask, shape (n,) or (size, n).

    Geometric latent: k by exact inversion, then entry i kept iff V_i < e^{−c_i k} (exact lazy comparison
    of a uniform with an enclosure of e^{−c_i k}). Exponential latent: the kept set {i : T_i > X} of an
    exact race of T_i ~ Exp(c_i) against X ~ Exp(ε′) (same law as keeping i w.p. e^{−c_i x} given x).
    The result is SECRET (it reveals k); only simulations and ``algorithm3``/``algorithm2`` use it.
    """
    c = check_drop(drop)
    eps_prime = check_eps_prime(eps_prime)
    values, index = _exact_drop(tuple(c.tolist()))
    runs = 1 if size is None else size
    if latent == "geometric":
        k = geometric_latent(noise, eps_prime, runs)
        batch = keep_given_latent(noise, values, index, k)
    elif latent == "exponential":
        batch = exponential_race(noise, values, index, Fraction(eps_prime), runs)
    else:
        raise ValueError(f"unknown latent {latent!r}")
    result: np.ndarray = batch[0] if size is None else batch
    return result


@lru_cache(maxsize=256)
def _exact_drop(drop: tuple[float, ...]) -> tuple[list[Fraction], np.ndarray]:
    """The distinct drop values as exact rationals (the floats' binary values) and each entry's index."""
    distinct, index = np.unique(np.array(drop), return_inverse=True)
    index.flags.writeable = False  # shared by every call with this list
    return [Fraction(float(v)) for v in distinct], index


# ----- the algorithms ---------------------------------------------------------------------------------------
ScoreKey = tuple[float, ...]
"""A candidate's position in the public total order: compared lexicographically, then by list index."""


def total_key(key: Sequence[float]) -> ScoreKey:
    """Make a key total: NaN (and anything non-float) becomes −∞, so a failed score is the minimum."""
    out = []
    for value in key:
        v = float(value)
        out.append(-math.inf if math.isnan(v) else v)
    return tuple(out)


@dataclass(frozen=True)
class Selection:
    """The released outcome only: the winning list index (None for ⊥) and that candidate's output."""

    index: int | None
    output: Any


def algorithm3(
    drop: Sequence[float] | np.ndarray,
    eps_prime: float,
    latent: Latent,
    run_candidate: Callable[[int], tuple[Sequence[float], Any]],
    noise: Noise,
    *,
    pad: bool = False,
    progress: ProgressFn = no_progress,
) -> Selection:
    """Algorithm 3: run the kept candidates in list order and return the maximum under (key, index).

    ``run_candidate(i)`` returns (key, output): the key must be a data-independent function of M_i's DP
    output (docs/privacy/tuning.md#tuning-order). With ``pad`` every dropped candidate is run
    too and its result discarded, so the amount of work does not depend on the latent (closes the gross timing
    channel; docs/privacy/tuning.md#tuning-secrets). ``TuningSelect`` always pads; ``pad=False`` is for
    simulations, where nobody observes the time. ``progress`` is called after every candidate (a heartbeat;
    the fraction is secret and must not be shown).
    """
    c = check_drop(drop)
    mask = sample_kept(c, latent, eps_prime, noise)
    best: tuple[ScoreKey, int] | None = None
    best_output: Any = None
    for i in range(c.size):
        if mask[i] or pad:
            key, output = run_candidate(i)
            if mask[i]:
                ranked = (total_key(key), i)
                if best is None or ranked > best:
                    best, best_output = ranked, output
        progress((i + 1) / c.size)
    if best is None:
        return Selection(None, None)
    return Selection(best[1], best_output)


def algorithm2(
    drop: Sequence[float] | np.ndarray,
    eps_prime: float,
    run_candidate: Callable[[int], tuple[bool, Any]],
    noise: Noise,
    *,
    progress: ProgressFn = no_progress,
) -> Selection:
    """Algorithm 2 (known threshold, geometric latent): the first kept candidate whose output passes.

    ``run_candidate(i)`` returns (passes, output), ``passes`` a data-independent function of the DP output
    (e.g. o_i ≥ thr). Charges: ``pure_charges`` for (o, i), ε′ for ⊥ (Theorem 10).
    """
    c = check_drop(drop)
    mask = sample_kept(c, "geometric", eps_prime, noise)
    for i in range(c.size):
        if mask[i]:
            passes, output = run_candidate(i)
            if passes:
                progress(1.0)
                return Selection(i, output)
        progress((i + 1) / c.size)
    return Selection(None, None)


# ----- the service mechanism ``tuning.select`` ------------------------------------------------------------
def noise_sd(noise: dict[str, Any]) -> float:
    """Standard deviation of the score noise from its public description (Laplace: √2·scale)."""
    if noise["distribution"] == "laplace":
        return math.sqrt(2.0) * float(noise["scale"])
    return float(noise["sigma"])


@dataclass(frozen=True)
class TuningPlan:
    """Everything public about one request: the list, the drop parameters and the charges per outcome."""

    candidates: list[CandidateConfig]
    drop: np.ndarray
    charges: np.ndarray
    """(n, |A|): ε̃(o, i) at every order (pure mode: the constant 2c_i + ε′)."""
    bottom: np.ndarray
    worst: RdpCurve
    holdout: int
    shape: PublicShape


PAD_REFUSAL = (
    "must be true: the number of candidates that ran is a function of the secret latent k, and the elapsed "
    "time reveals it; revealing it voids the charge of Theorem 11 (2ε + ε′ becomes up to n·ε), so every "
    "candidate always runs"
)


class TuningSelect(ParamsChecked):
    """``tuning.select``: ex-post private selection of a model **and its ε** (Ghazi et al. Alg. 3)."""

    name: ClassVar[str] = "tuning.select"
    summary: ClassVar[str] = (
        "Hyperparameter tuning incl. choosing ε (ex-post, Ghazi et al. Algorithm 3); pure: 2ε_i + ε′ of the "
        "selected candidate, 0 for none; rdp: Theorem 13."
    )
    params_model: ClassVar[type[BaseModel]] = TuningParams
    cost_parameter: ClassVar[str] = "epsilon_prime"
    cost_increases_with_parameter: ClassVar[bool] = True
    long_running: ClassVar[bool] = True
    progress_is_public: ClassVar[bool] = False

    def check(self, p: TuningParams, ctx: PublicContext) -> None:
        learner = LEARNERS[p.learner]
        check_features(p.features, ctx, learner.task, "features")
        if ctx.n_rows is None or ctx.schema.neighboring != "replace_one":
            raise ParamsError("learner", "tuning needs a replace_one dataset (public row count)")
        holdout = math.floor(p.holdout_fraction * ctx.n_rows)
        if holdout < 1 or ctx.n_rows - holdout < 1:
            raise ParamsError("holdout_fraction", "the split leaves an empty training or held-out part")
        if p.mode == "pure" and not learner.has_pure_guarantee:
            raise ParamsError("learner", "pure mode needs candidates with a pure ε guarantee")
        if p.order is not None and p.order not in ctx.orders:
            raise ParamsError("order", f"must be one of the dataset's orders {list(ctx.orders)}")
        if not p.pad_to_worst_case_time:
            raise ParamsError("pad_to_worst_case_time", PAD_REFUSAL)
        if p.learner == "objpert.logistic":
            assert p.order is not None
            shape = self.shape(p, ctx)
            for config in p.grid():
                try:
                    objpert_sigma(config.epsilon, config.reg, p.order)
                except ValueError as exc:
                    raise ParamsError("epsilons", str(exc)) from exc
                try:  # τ = max(1e-6, 2 × the public minimum): the certified stop is always reachable
                    objpert_candidate_config(config.epsilon, config.reg, p.order, shape.d, shape.n_train)
                except ValueError as exc:
                    raise ParamsError("regularization", str(exc)) from exc

    @staticmethod
    def shape(p: TuningParams, ctx: PublicContext) -> PublicShape:
        """The public sizes: n_t = n − ⌊h·n⌋ training rows, m = ⌊h·n⌋ held-out rows, d design columns."""
        assert ctx.n_rows is not None
        holdout = math.floor(p.holdout_fraction * ctx.n_rows)
        return PublicShape(ctx.n_rows - holdout, holdout, dimension(p.features, ctx))

    def plan(self, p: TuningParams, ctx: PublicContext) -> TuningPlan:
        """The public plan (list, drop parameters, every outcome's charge); no data is read."""
        self.check(p, ctx)
        assert ctx.n_rows is not None
        learner = LEARNERS[p.learner]
        candidates = p.candidates()
        drop = np.array([config.epsilon for config in candidates])
        shape = self.shape(p, ctx)
        holdout = shape.n_hold
        orders = tuple(ctx.orders)
        if p.mode == "pure":
            per = pure_charges(drop, p.epsilon_prime)
            charges = np.repeat(per[:, None], len(orders), axis=1)
            bottom = np.zeros(len(orders))
            worst = RdpCurve.from_pure(float(per.max()), orders)
            return TuningPlan(candidates, drop, charges, bottom, worst, holdout, shape)
        try:
            curves = {config: learner.curve(config, orders, p.order, shape) for config in p.grid()}
        except ValueError as exc:
            raise ParamsError("epsilons", str(exc)) from exc
        rdp = np.array([curves[config].values for config in candidates])
        table = rdp_charges(drop, p.epsilon_prime, orders, rdp)
        index = {float(v): u for u, v in enumerate(table.drops)}
        charges = table.per_drop[:, [index[float(c)] for c in drop]].T
        worst_values = np.maximum(table.bottom, charges.max(axis=0))
        worst = RdpCurve(orders, tuple(float(v) for v in worst_values))
        return TuningPlan(candidates, drop, charges, table.bottom, worst, holdout, shape)

    def worst_case(self, p: TuningParams, ctx: PublicContext) -> RdpCurve:
        return self.plan(p, ctx).worst

    def realized(self, p: TuningParams, plan: TuningPlan, index: int | None) -> RdpCurve:
        """The ex-post charge of the released outcome (a function of the outcome and the public plan)."""
        orders = plan.worst.orders
        if index is None:
            if p.mode == "pure":
                return RdpCurve.zero(orders)  # Theorem 11: ⊥ is free
            return RdpCurve(orders, tuple(float(v) for v in plan.bottom))
        values = tuple(float(v) for v in plan.charges[index])
        if p.mode == "pure":
            return RdpCurve.from_pure(values[0], orders)
        return RdpCurve(orders, values)

    def run(
        self,
        p: TuningParams,
        ctx: PublicContext,
        table: Table,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> Release:
        plan = self.plan(p, ctx)  # before the data is touched
        learner = LEARNERS[p.learner]
        x, y = design_matrix(p.features, ctx, table, learner.task)
        split = split_rows(x, y, plan.holdout, noise)
        if (
            split.x_train.shape != (plan.shape.n_train, plan.shape.d)
            or split.x_hold.shape[0] != plan.shape.n_hold
        ):
            raise RuntimeError("the data does not have the public shape the charge was computed for")
        # noise-free shared work (ERM minimisers) before the latent is drawn: its time does not depend on k
        learner.prepare(p.grid(), split, lambda _fraction: progress(0.0))
        learner.predraw(plan.candidates, split, noise)  # every entry's noise, one batch (law unchanged)
        n = len(plan.candidates)
        done = [0]

        def run_candidate(i: int) -> tuple[Sequence[float], Any]:
            config = plan.candidates[i]

            def inner(fraction: float) -> None:
                progress(min(1.0, (done[0] + fraction) / n))

            theta, score, score_noise = learner.fit_and_score(config, split, p.order, noise, inner)
            done[0] += 1
            passes = bool(score - p.pass_margin * noise_sd(score_noise) >= p.utility_bar)  # NaN fails
            key = (1.0 if passes else 0.0, -config.epsilon, score)
            return key, (theta, score, passes, score_noise)

        selection = algorithm3(
            plan.drop,
            p.epsilon_prime,
            "geometric" if p.mode == "pure" else "exponential",
            run_candidate,
            noise,
            pad=True,  # always: the work must not depend on k (check refuses pad_to_worst_case_time=false)
            progress=progress,
        )
        realized = self.realized(p, plan, selection.index)
        assert realized <= plan.worst
        charge = realized.as_dict()
        if selection.index is None:
            return Release({"outcome": "none", "charge": charge}, realized)
        theta, score, passes, score_noise = selection.output
        config = plan.candidates[selection.index]
        output = {
            "outcome": "selected",
            "selected": {**config.as_dict(p.learner), "index": selection.index},
            "model": {
                "columns": column_names(p.features, ctx),
                "coefficients": [float(v) if math.isfinite(v) else None for v in theta],
            },
            "score": {
                "metric": "accuracy" if learner.task == "classification" else "negative_mse",
                "value": float(score) if math.isfinite(score) else None,
                "passes": passes,
                "noise": score_noise,
            },
            "charge": charge,
        }
        return Release(output, realized)
