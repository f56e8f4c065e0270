"""The gate of individual datasets (service.datasets.check_individual): every session, and every request of
a mechanism without an individual analysis, is refused with a 422 naming ``mechanism`` before anything is
reserved — whatever the mechanism's name (a session never runs on a unit's own filter)."""

from __future__ import annotations

import pytest

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.catalog import MECHANISMS, WITH_INDIVIDUAL
from mechanisms.data.schema import DatasetSchema
from service.datasets import check_individual
from service.errors import InvalidInput

COLUMNS = [
    {"name": "user", "type": "int", "min": 0, "max": 99},
    {"name": "x", "type": "float", "min": 0, "max": 1},
]


def context(accounting: str) -> PublicContext:
    schema = {
        "columns": COLUMNS,
        "neighboring": "add_remove",
        "privacy_unit": {"column": "user", "max_rows": 1},
    }
    return PublicContext(
        DatasetSchema.model_validate({**schema, "accounting": accounting}), None, DEFAULT_ORDERS
    )


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_requests_pass_exactly_for_the_individual_families(mechanism: str) -> None:
    if mechanism in WITH_INDIVIDUAL:
        check_individual(context("individual"), mechanism)
        return
    with pytest.raises(InvalidInput) as refused:
        check_individual(context("individual"), mechanism)
    assert refused.value.extensions["errors"][0]["field"] == "mechanism"


@pytest.mark.parametrize("mechanism", ["laplace", "noise_reduction.laplace", "above_threshold"])
def test_sessions_are_refused_whatever_the_mechanism(mechanism: str) -> None:
    with pytest.raises(InvalidInput, match="interactive sessions have no individual analysis"):
        check_individual(context("individual"), mechanism, "session")
    check_individual(context("dataset"), mechanism, "session")  # a dataset-level dataset: not this gate's
