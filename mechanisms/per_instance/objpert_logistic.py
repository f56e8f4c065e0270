"""``objpert.logistic``: objective perturbation for logistic regression with per-instance privacy reports.

The training and its Rényi-DP bound live in ``mechanisms.learners.objective_perturbation`` (Redberg, Koskela
and Wang 2023); the reports in ``mechanisms.per_instance.reports`` (Redberg's thesis, chapter 2). This module
only joins the two behind the mechanism seam, so neither of them imports the other's user.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel

from mechanisms.accounting import RdpCurve
from mechanisms.base import ParamsChecked, ParamsError, ProgressFn, PublicContext, Release, Table, no_progress
from mechanisms.learners.features import check_features, column_names, design_matrix, dimension
from mechanisms.learners.objective_perturbation import (
    ObjPertLogisticParams,
    effective_tolerance,
    fit_objpert,
    minimum_tolerance,
    objpert_curve,
    output_grid,
    output_noise_units,
    public_row_bound,
    round_up_shown,
)
from mechanisms.noise import Noise
from mechanisms.per_instance.reports import (
    data_dependent_requirements,
    data_dependent_statistics,
    is_adaptive,
    lower_lambda,
    range_requirement,
    report_curve,
    report_metadata,
)


class ObjPertLogistic(ParamsChecked):
    """Objective perturbation (approximate minimizer + output noise) for logistic regression."""

    name: ClassVar[str] = "objpert.logistic"
    summary: ClassVar[str] = (
        "Logistic regression by objective perturbation (Rényi DP, Redberg et al. 2023) with an optional "
        "per-instance privacy report."
    )
    params_model: ClassVar[type[BaseModel]] = ObjPertLogisticParams
    cost_parameter: ClassVar[str] = "sigma"
    cost_increases_with_parameter: ClassVar[bool] = False
    long_running: ClassVar[bool] = True
    progress_is_public: ClassVar[bool] = False  # the number of solver rounds depends on the data

    def check(self, p: ObjPertLogisticParams, ctx: PublicContext) -> None:
        check_features(p, ctx, "classification")
        d = dimension(p, ctx)
        n_bound = public_row_bound(p, ctx)
        # public: the certified stop must be reachable on every dataset
        # (docs/privacy/objective_perturbation.md#objpert-rdp-charge)
        needed = minimum_tolerance(p.regularization, p.sigma, p.row_norm, d, n_bound)
        if p.tolerance < needed:
            raise ParamsError(
                "tolerance",
                f"must be ≥ {round_up_shown(needed)!r} (10× the solver's float64 rounding slack at these "
                "public bounds); raise tolerance or regularization, or lower max_rows",
            )
        if p.report == "data_dependent":
            reason = data_dependent_requirements(p, d)
            if reason is not None:
                raise ParamsError("report_hessian_sigma", reason)
            out_of_range = range_requirement(p, d, n_bound)
            if out_of_range is not None:
                raise ParamsError(*out_of_range)

    def worst_case(self, p: ObjPertLogisticParams, ctx: PublicContext) -> RdpCurve:
        config = p.config(ctx.schema.neighboring)
        curve = objpert_curve(config, ctx.orders)
        if p.report == "data_dependent":
            curve = curve + report_curve(
                p, ctx.schema.neighboring, ctx.orders, dimension(p, ctx), public_row_bound(p, ctx)
            )
        return curve

    def run(
        self,
        p: ObjPertLogisticParams,
        ctx: PublicContext,
        table: Table,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> Release:
        self.check(p, ctx)
        worst = self.worst_case(p, ctx)
        progress(0.0)
        x, y = design_matrix(p, ctx, table, "classification", row_norm=p.row_norm)
        # n̄ = max(n, public bound) inside: sound even if the data has more rows than declared (then, and only
        # then, the failure channel depends on n; documented on the mechanism page)
        config = p.config(ctx.schema.neighboring, public_row_bound(p, ctx))
        fit = fit_objpert(x, y, config, noise, progress)
        output: dict[str, Any] = {
            "theta": [float(v) for v in fit.released],
            "columns": column_names(p, ctx),  # public: the design matrix's columns, in theta's order
            "loss": "logistic",
            "regularization": p.regularization,
            "sigma": p.sigma,
            "tolerance": p.tolerance,
            "output_sigma": config.output_sigma,
            "output_grid": {
                **output_grid(config.tau, config.lam, config.sigma, config.output_sigma).describe(),
                "noise_std": output_noise_units(config.tau, config.lam, config.sigma, config.output_sigma)
                * output_grid(config.tau, config.lam, config.sigma, config.output_sigma).granularity,
                "noise": "discrete Gaussian in grid units; theta is an exact multiple of the granularity",
            },
            "effective_tolerance": effective_tolerance(config.tau, config.sigma),
            "row_norm": p.row_norm,
            "lipschitz": config.lipschitz,
            "beta": config.beta,
        }
        if p.report != "none":
            output["report"] = report_metadata(p, fit.released.shape[0], public_row_bound(p, ctx))
        if p.report == "data_dependent":
            output["report"].update(
                data_dependent_statistics(p, x, y, fit, noise, n_bound=public_row_bound(p, ctx))
            )
            if is_adaptive(p):
                # Alg 9's λ_lo: post-processing of the released λ̂_min and public constants
                output["report"]["lambda_lo"] = lower_lambda(p, output["report"])
        progress(1.0)
        # realized = worst case by theorem, not by comparison: the RDP bound of approximate objective
        # perturbation (Redberg, Koskela, Wang 2023, Theorem 4.3.2 of Redberg's thesis) and the report's
        # Gaussian charge depend on public parameters only, never on the output
        # (docs/privacy/objective_perturbation.md#objpert-rdp-charge and
        # docs/privacy/objective_perturbation.md#objpert-data-dependent-report)
        return Release(output=output, realized=worst)
