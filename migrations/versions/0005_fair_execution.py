"""fair, cancellable execution: per-analyst limits, cancellation, indexes for the claim order

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 20:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "analyst_limits",
        sa.Column("analyst", sa.String(length=100), nullable=False),
        sa.Column("max_running_requests", sa.Integer(), nullable=True),
        sa.Column("max_open_sessions", sa.Integer(), nullable=True),
        sa.Column("updated_by", sa.String(length=100), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("analyst", name=op.f("pk_analyst_limits")),
    )
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cancelled_by", sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column("queue", sa.String(length=64), nullable=True))
        batch_op.create_index("ix_requests_analyst_state", ["analyst", "state"], unique=False)
        batch_op.create_index("ix_requests_analyst_started", ["analyst", "started_at"], unique=False)
    # Requests admitted before this revision and not yet claimed wait in the queue now: their lease
    # starts when a worker claims them (the reaper only charges claimed requests).
    # They belong to the default queue; a deployment with another EXPOST_QUEUE_NAME can move them
    # (UPDATE requests SET queue = '<name>' WHERE queue = 'expost'), else they are aborted without
    # charge after EXPOST_MAX_QUEUE_SECONDS.
    op.execute(
        "UPDATE requests SET lease_expires_at = NULL, queue = 'expost' "
        "WHERE state = 'running' AND kind = 'request' AND lease_owner IS NULL"
    )


def downgrade() -> None:
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_index("ix_requests_analyst_started")
        batch_op.drop_index("ix_requests_analyst_state")
        batch_op.drop_column("queue")
        batch_op.drop_column("cancelled_by")
    op.drop_table("analyst_limits")
