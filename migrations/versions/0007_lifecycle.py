"""lifecycle: archived datasets

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 00:15:00.000000

A dataset gains ``archived_at``/``archived_by`` (NULL: not archived). An archived dataset admits no new
requests or sessions; its history, budget views and ledger stay. Revoking an API key uses the existing
``api_keys.revoked_at``; revoking a grant deletes the ``grants`` row and appends a ``revoke`` ledger entry
(the analyst's sub-filter and history stay), so neither needs a schema change.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("archived_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("archived_by", sa.String(length=100), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_column("archived_by")
        batch_op.drop_column("archived_at")
