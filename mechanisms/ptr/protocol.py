"""The seam of an approximate-DP mechanism (docs/privacy/approximate.md#approximate-implementation).

Like ``mechanisms.base.Mechanism`` plus ``approximate_charge``: the (ε, δ) charge computed from public
parameters only, before the data is read. ``worst_case`` returns its curve part (so refusal and
affordability code that reads curves keeps working) and ``run`` returns a ``Release`` whose ``realized`` is
that same curve: an approximate request commits what it reserved, ⊥ included.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel

from mechanisms.accounting import RdpCurve
from mechanisms.accounting.approximate import ApproximateCharge
from mechanisms.base import ParamsChecked, PublicContext, Release, Table
from mechanisms.noise import Noise

P = TypeVar("P", bound=BaseModel, contravariant=True)


@runtime_checkable
class ApproximateMechanism(Protocol[P]):
    name: ClassVar[str]
    summary: ClassVar[str]
    params_model: ClassVar[type[BaseModel]]
    approximate: ClassVar[bool]

    def check(self, p: P, ctx: PublicContext) -> None: ...

    def approximate_charge(self, p: P, ctx: PublicContext) -> ApproximateCharge: ...

    def worst_case(self, p: P, ctx: PublicContext) -> RdpCurve: ...

    def run(self, p: P, ctx: PublicContext, table: Table, noise: Noise) -> Release: ...


def is_approximate(mechanism: object) -> bool:
    """Whether the filter must admit ``mechanism`` through the δ-ledger
    (docs/privacy/approximate.md#approximate-dp)."""
    return bool(getattr(mechanism, "approximate", False))


class ApproximateBase(ParamsChecked, Generic[P]):
    """What the (ε, δ) mechanisms share: the cost parameter is ε (the refusal's affordability search
    prices the curve part), ``worst_case`` is the charge's curve, and a release's realized charge is that
    same curve — an approximate request commits what it reserved, ⊥ included
    (docs/privacy/approximate.md#condition-e-delta)."""

    cost_parameter: ClassVar[str] = "epsilon"
    cost_increases_with_parameter: ClassVar[bool] = True
    approximate: ClassVar[bool] = True

    def approximate_charge(self, p: P, ctx: PublicContext) -> ApproximateCharge:
        raise NotImplementedError

    def worst_case(self, p: P, ctx: PublicContext) -> RdpCurve:
        return self.approximate_charge(p, ctx).curve

    def release(self, p: P, ctx: PublicContext, output: dict[str, Any]) -> Release:
        return Release(output=output, realized=self.worst_case(p, ctx))
