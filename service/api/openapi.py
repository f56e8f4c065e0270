"""The OpenAPI document, made conventional for generated clients.

* ``operation_id``: every route gets a stable camelCase ``operationId``. Routes name theirs
  (``submitRequest``, ``getBudget``, …); a route that does not gets its function's name in camelCase
  (``privacy_report`` → ``privacyReport``), so routes added later get a sane id too.
* ``add_mechanism_unions``: the bodies of ``POST …/requests``, ``…/requests:estimate`` and ``…/sessions``
  become discriminated unions by ``mechanism``, one variant per mechanism of the catalog (read when the
  document is built, so every registered mechanism is included), each with its own ``params`` model. The
  server validates exactly these models (``service.runs.admission``); the union only documents them.
* ``json_safe_schema``: integers beyond ±2^53 (parameter bounds such as ±10^300) are written as JSON
  floats (``1e+300``), which every JSON parser reads; a 300-digit literal is not portable.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from fastapi.routing import APIRoute
from pydantic import BaseModel

SAFE_INTEGER = 2**53
"""The largest integer every JSON parser reads exactly (IEEE double)."""

REF_PREFIX = "#/components/schemas/"


def operation_id(route: APIRoute) -> str:
    """The ``operationId`` of a route without an explicit one: its function's name in camelCase."""
    head, *rest = route.name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def json_safe_schema(node: Any) -> Any:
    """``node`` with every integer outside ±2^53 turned into a float (booleans are left alone)."""
    if isinstance(node, dict):
        return {key: json_safe_schema(value) for key, value in node.items()}
    if isinstance(node, list):
        return [json_safe_schema(value) for value in node]
    if isinstance(node, int) and not isinstance(node, bool) and abs(node) > SAFE_INTEGER:
        return float(node)
    return node


def camel(mechanism: str) -> str:
    """``above_threshold.laplace.batch`` → ``AboveThresholdLaplaceBatch``."""
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[._\-]+", mechanism) if part)


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(REF_PREFIX):
            yield ref[len(REF_PREFIX) :]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _renamed(node: Any, names: Mapping[str, str]) -> Any:
    if isinstance(node, dict):
        out = {key: _renamed(value, names) for key, value in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and ref.startswith(REF_PREFIX) and ref[len(REF_PREFIX) :] in names:
            out["$ref"] = REF_PREFIX + names[ref[len(REF_PREFIX) :]]
        return out
    if isinstance(node, list):
        return [_renamed(value, names) for value in node]
    return node


class SchemaRegistry:
    """Adds models' JSON schemas to ``components/schemas`` without clashes: a definition identical to one
    already there (with everything it refers to) is shared; a different one with the same name gets the
    mechanism's prefix."""

    def __init__(self, schemas: dict[str, Any]) -> None:
        self.schemas = schemas
        self.by_content: dict[str, str] = {}  # the digest of a definition and its closure → its name

    def free(self, name: str, prefix: str) -> str:
        candidate, n = (name if name not in self.schemas else prefix + name), 2
        while candidate in self.schemas:
            candidate, n = f"{prefix}{name}{n}", n + 1
        return candidate

    def add(self, model: type[BaseModel], name: str, prefix: str) -> str:
        """Register ``model`` as ``name`` (or a free variant of it) and its definitions; returns the name."""
        schema = json_safe_schema(model.model_json_schema(ref_template=REF_PREFIX + "{model}"))
        defs: dict[str, Any] = schema.pop("$defs", {})

        def closure(root: str) -> str:
            seen, todo = {}, [root]
            while todo:
                current = todo.pop()
                if current in seen or current not in defs:
                    continue
                seen[current] = defs[current]
                todo.extend(_refs(defs[current]))
            return hashlib.sha256(json.dumps(seen, sort_keys=True).encode()).hexdigest()

        names: dict[str, str] = {}
        new: list[str] = []
        for local in defs:
            digest = closure(local)
            shared = self.by_content.get(digest)
            if shared is None:
                shared = self.free(local, prefix)
                self.schemas[shared] = {}  # claimed now: a later definition cannot take the same name
                self.by_content[digest] = shared
                new.append(local)
            names[local] = shared
        for local in new:
            self.schemas[names[local]] = _renamed(defs[local], names)
        final = self.free(name, prefix)
        self.schemas[final] = {**_renamed(schema, names), "title": final}
        return final


def _variant(title: str, mechanism: str, params_ref: str, description: str) -> dict[str, Any]:
    return {
        "title": title,
        "description": description,
        "type": "object",
        "properties": {
            "mechanism": {"type": "string", "const": mechanism},
            "params": {"$ref": REF_PREFIX + params_ref},
        },
        "required": ["mechanism", "params"],
        "additionalProperties": False,
    }


def add_mechanism_unions(
    document: dict[str, Any],
    requests: Mapping[str, Any],
    sessions: Mapping[str, Any],
) -> None:
    """Replace the ``RequestIn`` and ``SessionIn`` schemas by discriminated unions over the catalog
    (``requests`` and ``sessions``: name → mechanism with ``params_model`` and ``summary``)."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    registry = SchemaRegistry(schemas)
    for body, kind, catalog in (("RequestIn", "Request", requests), ("SessionIn", "Session", sessions)):
        if body not in schemas:
            continue
        mapping: dict[str, str] = {}
        for name, mechanism in catalog.items():
            prefix = camel(name) + (kind if kind == "Session" else "")
            params = registry.add(mechanism.params_model, f"{prefix}Params", prefix)
            title = registry.free(f"{prefix}{kind}In" if kind == "Request" else f"{prefix}In", prefix)
            schemas[title] = _variant(title, name, params, str(getattr(mechanism, "summary", "") or name))
            mapping[name] = REF_PREFIX + title
        schemas[body] = {
            "title": body,
            "description": f"A {kind.lower()}: `mechanism` names an entry of GET /v1/mechanisms and selects "
            "the model of `params` (one variant per mechanism).",
            "oneOf": [{"$ref": ref} for ref in mapping.values()],
            "discriminator": {"propertyName": "mechanism", "mapping": mapping},
        }
