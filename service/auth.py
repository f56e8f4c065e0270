"""API keys (stored as SHA-256 hashes) and roles: admin, analyst, viewer."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from sqlalchemy.orm import Session

from service.db.models import DATASET_SCOPE, ApiKey
from service.db.repositories import KeyRepository
from service.errors import Conflict, InvalidInput

KEY_PREFIX = "xp_"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,99}$")


class Role(StrEnum):
    admin = "admin"
    analyst = "analyst"
    viewer = "viewer"


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role

    @property
    def is_admin(self) -> bool:
        return self.role is Role.admin


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def validate_name(name: str, field: str = "name") -> str:
    if name == DATASET_SCOPE or not NAME_PATTERN.match(name):
        raise InvalidInput(field, "1-100 characters: letters, digits, and _ . @ - (not starting with one)")
    return name


def create_key(session: Session, name: str, role: Role) -> str:
    """Create a key and return it in clear (shown once); only its hash is stored."""
    keys = KeyRepository(session)
    validate_name(name)
    if keys.by_name(name) is not None:
        raise Conflict(f"a key named {name!r} already exists")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    keys.add(
        ApiKey(
            name=name, role=role.value, key_hash=hash_key(key), prefix=key[:10], created_at=datetime.now(UTC)
        )
    )
    return key


def principal_for(session: Session, key: str) -> Principal | None:
    found = KeyRepository(session).by_hash(hash_key(key))
    return None if found is None else Principal(found.name, Role(found.role))
