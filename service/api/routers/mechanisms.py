from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from mechanisms.catalog import INTERACTIVE, MECHANISMS
from mechanisms.ptr.protocol import is_approximate
from service.api.deps import AnyRole

router = APIRouter(prefix="/v1/mechanisms", tags=["mechanisms"])


@router.get("", summary="The mechanism catalog with the JSON schema of each one's params")
def catalog(_who: AnyRole) -> list[dict[str, Any]]:
    requests = [
        {
            "name": name,
            "kind": "request",
            "summary": mechanism.summary,
            "cost_parameter": mechanism.cost_parameter,
            "approximate": is_approximate(mechanism),
            "params_schema": mechanism.params_model.model_json_schema(),
        }
        for name, mechanism in MECHANISMS.items()
    ]
    sessions = [
        {
            "name": name,
            "kind": "session",
            "summary": mechanism.summary,
            "params_schema": mechanism.params_model.model_json_schema(),
            "query_schema": mechanism.query_model.model_json_schema(),
        }
        for name, mechanism in INTERACTIVE.items()
    ]
    return requests + sessions
