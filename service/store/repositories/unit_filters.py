"""The per-unit filters of individually accounted datasets (``unit_filters``, ``unit_filter_blocks``): secret,
read by the run that computes a release and written by the batch that settles it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, insert, select, update

from service.store.models import UnitFilterBlock, UnitFilterState
from service.store.repositories.base import Repository


class UnitFilterRepository(Repository):
    def version(self, dataset_id: str) -> int:
        """The number of releases that charged the dataset's units (0 before the first)."""
        found = self.session.scalar(
            select(UnitFilterState.version).where(UnitFilterState.dataset_id == dataset_id)
        )
        return 0 if found is None else int(found)

    def blocks(self, dataset_id: str, after: int, upto: int) -> Sequence[tuple[int, bool, bytes]]:
        """(version, base, state) of the blocks with ``after`` < version ≤ ``upto``, in version order."""
        rows = self.session.execute(
            select(UnitFilterBlock.version, UnitFilterBlock.base, UnitFilterBlock.state)
            .where(
                UnitFilterBlock.dataset_id == dataset_id,
                UnitFilterBlock.version > after,
                UnitFilterBlock.version <= upto,
            )
            .order_by(UnitFilterBlock.version)
        ).all()
        return [(int(v), bool(b), bytes(s)) for v, b, s in rows]

    def append(self, dataset_id: str, expected: int, base: bool, state: bytes, now: datetime) -> None:
        """Store version ``expected + 1`` (a block; a base block deletes the older ones). The caller holds the
        dataset's filter lock and has checked that the stored version is ``expected`` (:meth:`version`)."""
        version = expected + 1
        if expected == 0:
            self.session.execute(
                insert(UnitFilterState).values(dataset_id=dataset_id, version=version, updated_at=now)
            )
        else:
            self.session.execute(
                update(UnitFilterState)
                .where(UnitFilterState.dataset_id == dataset_id, UnitFilterState.version == expected)
                .values(version=version, updated_at=now)
            )
        block = {"dataset_id": dataset_id, "version": version, "base": base, "state": state}
        self.session.execute(insert(UnitFilterBlock).values(**block))
        if base:
            self.session.execute(
                delete(UnitFilterBlock).where(
                    UnitFilterBlock.dataset_id == dataset_id, UnitFilterBlock.version < version
                )
            )
