"""API keys (stored as SHA-256 hashes) and roles: admin, analyst, viewer."""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from sqlalchemy.orm import Session, sessionmaker

from service.errors import Conflict, InvalidInput, NotFound, Unauthenticated
from service.store.models import DATASET_SCOPE, ApiKey
from service.store.repositories import KeyRepository

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


REVOKED = "unknown or revoked API key"
"""The detail of the 401 of a revoked key, from authentication or (another process's cache) admission."""


def revoke_key(session: Session, name: str) -> ApiKey:
    """Revoke the key named ``name`` (idempotent: a revoked key keeps its first ``revoked_at``).

    The name stays taken, so a new key never inherits the revoked one's grants or sub-budgets. The last
    active admin key cannot be revoked (nobody could create keys over HTTP any more). This sets the mark
    only: ``service.runs.sessions.revoke_key`` (the API and ``expost keys revoke``) calls it holding the
    key's filters and closes its open sessions in the same transaction."""
    keys = KeyRepository(session)
    key = keys.by_name(name)
    if key is None:
        raise NotFound(f"no API key named {name!r}")
    if key.revoked_at is None:
        if key.role == Role.admin.value and keys.active_count(Role.admin.value) <= 1:
            raise Conflict("this is the last active admin key; create another admin key first")
        key.revoked_at = datetime.now(UTC)
    return key


def check_key_active(session: Session, name: str) -> None:
    """Raise the 401 of a revoked key unless the key ``name`` is active, read from the database now (never
    from a :class:`KeyCache`). Admission calls it under the filter locks, which a revocation also takes:
    a key revoked through any process is refused by every process's next admission."""
    if not KeyRepository(session).is_active(name):
        raise Unauthenticated(REVOKED)


def principal_for(session: Session, key: str) -> Principal | None:
    found = KeyRepository(session).by_hash(hash_key(key))
    return None if found is None else Principal(found.name, Role(found.role))


class KeyCache:
    """Authenticates keys by hash, caching each answer for ``ttl`` seconds (0: no cache)."""

    def __init__(self, sessions: sessionmaker[Session], ttl: float) -> None:
        self.sessions, self.ttl = sessions, ttl
        self._principals: dict[str, tuple[Principal, float]] = {}
        self._lock = threading.Lock()
        self._forgotten = 0  # bumped by forget: an answer read from the database before it is not cached

    def cached(self, key: str) -> Principal | None:
        """The principal of ``key`` if a fresh answer is cached (no database read), else None."""
        return self._fresh(hash_key(key), time.monotonic())

    def _fresh(self, digest: str, now: float) -> Principal | None:
        cached = self._principals.get(digest)
        return cached[0] if cached is not None and cached[1] > now else None

    def authenticate(self, key: str) -> Principal | None:
        digest, now = hash_key(key), time.monotonic()
        cached = self._fresh(digest, now)
        if cached is not None:
            return cached
        generation = self._forgotten
        with self.sessions() as session:
            principal = principal_for(session, key)
        if principal is not None and self.ttl > 0:
            with self._lock:
                if generation != self._forgotten:  # a revocation raced with this lookup
                    return principal
                if len(self._principals) > 10_000:
                    self._principals.clear()
                self._principals[digest] = (principal, now + self.ttl)
        return principal

    def forget(self, name: str) -> None:
        """Drop the cached principal of key ``name`` (after revoking it): this process refuses it at once.
        Other processes refuse it when their entry expires, at most ``ttl`` seconds later."""
        with self._lock:
            self._forgotten += 1
            for digest in [d for d, (p, _) in self._principals.items() if p.name == name]:
                del self._principals[digest]
