"""API keys (``api_keys``)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select

from service.store.models import ApiKey
from service.store.repositories.base import Repository, storable


class KeyRepository(Repository):
    def by_hash(self, key_hash: str) -> ApiKey | None:
        return self.session.scalar(
            select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
        )

    def by_name(self, name: str) -> ApiKey | None:
        if not storable(name):
            return None
        return self.session.scalar(select(ApiKey).where(ApiKey.name == name))

    def add(self, key: ApiKey) -> None:
        self.session.add(key)

    def all(self) -> Sequence[ApiKey]:
        return self.session.scalars(select(ApiKey).order_by(ApiKey.id)).all()

    def active_count(self, role: str) -> int:
        """How many keys of ``role`` are not revoked."""
        active = select(func.count()).select_from(ApiKey).where(ApiKey.revoked_at.is_(None))
        return int(self.session.scalar(active.where(ApiKey.role == role)) or 0)

    def is_active(self, name: str) -> bool:
        """Whether a key named ``name`` exists and is not revoked, read from the database now."""
        if not storable(name):
            return False
        found = self.session.scalar(select(ApiKey.id).where(ApiKey.name == name, ApiKey.revoked_at.is_(None)))
        return found is not None
