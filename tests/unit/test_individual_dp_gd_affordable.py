"""Review 37c (fixed): a refused ``dp_gd`` request on an individual dataset is told what it can afford.

Admission there asks only that ONE step fits a unit with nothing spent (``Validated.unit_charge``,
``DpGdMechanism.individual_worst_case``; docs/privacy/individual.md#individual-dp-gd-proof), but the
refusal's ``affordable`` search (``service.runs.admission.affordable``) prices the whole T-step run against
an unspent filter. For T = 400 at ε = 1 it suggests noise_multiplier ≈ 118 where ≈ 5.9 is admitted: the
suggestion is admitted (safe) but about 20× more noise than needed. Public information only: not a
privacy bug, a wrong answer in the 409 body.
"""

from __future__ import annotations

from typing import Any, cast

from mechanisms.accounting import DEFAULT_ORDERS, UnitsVector
from mechanisms.accounting.conversion import capacity_units
from mechanisms.base import PublicContext, with_cost
from mechanisms.data.schema import DatasetSchema
from mechanisms.learners.dp_gd import DpGdMechanism, DpGdParams
from service.filter.batch import Refused, admits
from service.filter.state import FilterSnapshot
from service.runs.admission import Validated, affordable
from service.store.models import DATASET_SCOPE

SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            {"name": "user", "type": "int", "min": 0, "max": 10**6},
            {"name": "a", "type": "float", "min": -1.0, "max": 1.0},
            {"name": "y", "type": "categorical", "values": ["no", "yes"]},
        ],
        "neighboring": "add_remove",
        "privacy_unit": {"column": "user", "max_rows": 3},
        "accounting": "individual",
    }
)
CTX = PublicContext(SCHEMA, None, DEFAULT_ORDERS)


def _validated(params: DpGdParams) -> Validated:
    mechanism = DpGdMechanism()
    worst = mechanism.worst_case(params, CTX)
    step = UnitsVector.charge(mechanism.individual_worst_case(params, CTX))
    dataset = cast(Any, None)  # ``affordable`` reads the mechanism, params, context and filters only
    return Validated(
        dataset, mechanism, params, CTX, worst, UnitsVector.charge(worst), "fp", unit_charge=step
    )


def _admitted(params: DpGdParams, flt: FilterSnapshot) -> bool:
    """What admission decides for ``params`` (the dataset filter of an individual dataset)."""
    v = _validated(params)
    return admits(flt, v.charge, v.delta, True, v.unit_charge)


def test_affordable_noise_multiplier_is_near_the_smallest_admitted_one() -> None:
    capacity = [*capacity_units(1.0, 1e-6, CTX.orders)]
    zero = UnitsVector.zeros(len(capacity)).to_json()
    flt = FilterSnapshot(DATASET_SCOPE, capacity, zero, zero)
    asked = DpGdParams.model_validate(
        {"features": ["a"], "label": "y", "steps": 400, "noise_multiplier": 0.5, "n_hint": 1000}
    )
    assert not _admitted(asked, flt)  # one step at z = 0.5 does not fit ε = 1
    found = affordable(_validated(asked), Refused(flt, [flt]))
    assert found is not None
    assert found["parameter"] == "noise_multiplier"
    suggested = float(found["value"])
    assert _admitted(with_cost(asked, "noise_multiplier", suggested), flt)
    # the suggestion should be (close to) the least noise admission accepts, not the run's whole T steps
    assert not _admitted(with_cost(asked, "noise_multiplier", suggested / 2.0), flt), (
        f"affordable suggests noise_multiplier {suggested:g}, but half of it is admitted too"
    )
