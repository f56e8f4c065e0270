from __future__ import annotations

from fastapi import APIRouter

from mechanisms.catalog import INTERACTIVE, MECHANISMS, WITH_INDIVIDUAL, WITH_UNITS
from mechanisms.ptr.protocol import is_approximate
from service.api.deps import AnyRole
from service.api.openapi import json_safe_schema
from service.api.schemas import MechanismOut

router = APIRouter(prefix="/v1/mechanisms", tags=["mechanisms"])


@router.get(
    "",
    operation_id="listMechanisms",
    summary="The mechanism catalog with the JSON schema of each one's params",
)
def catalog(_who: AnyRole) -> list[MechanismOut]:
    requests = [
        {
            "name": name,
            "kind": "request",
            "summary": mechanism.summary,
            "cost_parameter": mechanism.cost_parameter,
            "approximate": is_approximate(mechanism),
            "privacy_units": name in WITH_UNITS,
            "individual_accounting": name in WITH_INDIVIDUAL,
            "params_schema": json_safe_schema(mechanism.params_model.model_json_schema()),
        }
        for name, mechanism in MECHANISMS.items()
    ]
    sessions = [
        {
            "name": name,
            "kind": "session",
            "summary": mechanism.summary,
            "params_schema": json_safe_schema(mechanism.params_model.model_json_schema()),
            "query_schema": json_safe_schema(mechanism.query_model.model_json_schema()),
            "privacy_units": name in WITH_UNITS,
            "individual_accounting": name in WITH_INDIVIDUAL,
        }
        for name, mechanism in INTERACTIVE.items()
    ]
    return [MechanismOut.model_validate(entry) for entry in requests + sessions]
