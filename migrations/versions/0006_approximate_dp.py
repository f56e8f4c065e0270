"""approximate DP through the filter: a δ-ledger beside the RDP slots
(docs/privacy/approximate.md#approximate-dp)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 23:00:00.000000

Each filter gains the admin's δ share δ_A (``delta_share``, a float like ``delta``) and three exact
integers in units of 10⁻³⁰ stored as decimal strings (they exceed 64 bits): the δ capacity (rounded
down; NULL while no share is set), the δ spent and the δ reserved. Existing filters have no share and
nothing spent, so every earlier ledger replays unchanged.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("filters", schema=None) as batch_op:
        batch_op.add_column(sa.Column("delta_share", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("delta_capacity", sa.String(length=40), nullable=True))
        batch_op.add_column(
            sa.Column("delta_spent", sa.String(length=40), nullable=False, server_default="0")
        )
        batch_op.add_column(
            sa.Column("delta_reserved", sa.String(length=40), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("filters", schema=None) as batch_op:
        batch_op.drop_column("delta_reserved")
        batch_op.drop_column("delta_spent")
        batch_op.drop_column("delta_capacity")
        batch_op.drop_column("delta_share")
