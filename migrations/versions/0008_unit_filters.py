"""unit filters: the secret per-unit filter state of individually accounted datasets

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-08 03:30:00.000000

``unit_filters`` has one row per dataset with ``accounting: individual`` once a release charged its units:
``version`` counts those releases (public: it also appears in their ledger entries). ``unit_filter_blocks``
holds the state itself, secret like ``secret_states`` (never in a response, a log or the ledger;
docs/privacy/individual.md#unit-state): every release appends its units' charges as a block, and every
``BASE_EVERY``-th version is a base block (the whole state), after which older blocks are deleted.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "unit_filters",
        sa.Column("dataset_id", sa.String(length=40), sa.ForeignKey("datasets.id"), primary_key=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "unit_filter_blocks",
        sa.Column("dataset_id", sa.String(length=40), sa.ForeignKey("datasets.id"), primary_key=True),
        sa.Column("version", sa.Integer(), primary_key=True),
        sa.Column("base", sa.Boolean(), nullable=False),
        sa.Column("state", sa.LargeBinary(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("unit_filter_blocks")
    op.drop_table("unit_filters")
