"""The public schema of a dataset: its columns, their declared bounds, and the neighbour relation.

Everything here is **public**: mechanisms derive sensitivities from the declared bounds and categories and
never from the data (docs/privacy/rules.md#rule-public-charges). The data is clipped to the declared bounds on
load (``mechanisms.data.table``), so a bound is a promise the data cannot break.

JSON shape::

    {"columns": [{"name": "age", "type": "float", "min": 0, "max": 100},
                 {"name": "n", "type": "int", "min": 0, "max": 10},
                 {"name": "group", "type": "categorical", "values": ["a", "b"]}],
     "neighboring": "replace_one"}

``neighboring`` is ``replace_one`` (neighbours differ in one row's content; the row count is public) or
``add_remove`` (neighbours differ by one row's presence; the row count is private). A schema has 1 to
``MAX_COLUMNS`` (1000) columns with unique names.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: The column a snapshot of a dataset with a privacy unit carries beside the declared ones: a keyed hash
#: of each row, the order in which a unit's rows are kept (mechanisms/data/plan.py); never a user column.
ORDER_COLUMN = "__order"

MAX_COLUMNS = 1000
"""A schema (and so an upload's CSV header) has at most this many columns. Wider input is refused before any
column is validated: a 422 naming ``schema.columns`` (a header wider than its schema is refused by the
header check, ``mechanisms.data.table``). Every check over the columns is linear in their number."""

MAX_EXACT_INT = 2**53 - 1
"""Int bounds must lie in ±(2⁵³ − 1) so that they and every parsed value up to them are exact in float64."""

ColumnName = Annotated[str, Field(min_length=1, max_length=200, strict=True)]
MAX_ABS_BOUND = 1e15
"""Declared bounds stay within ±1e15 so that no sum of clipped values can overflow float64 (even 1e290
rows would stay finite); an overflowing, data-dependent infinite release would escape the proof."""
FiniteBound = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-MAX_ABS_BOUND, le=MAX_ABS_BOUND)]
IntBound = Annotated[int, Field(strict=True, ge=-MAX_EXACT_INT, le=MAX_EXACT_INT)]
Category = Annotated[str, Field(min_length=1, strict=True)]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_range(low: float, high: float) -> None:
    if low > high:
        raise ValueError(f"min ({low!r}) must be ≤ max ({high!r})")
    if not math.isfinite(float(high) - float(low)):
        raise ValueError("max − min must be a finite float")


class FloatColumn(_Frozen):
    """A real-valued column; values are clipped to [min, max]."""

    name: ColumnName
    type: Literal["float"]
    min: FiniteBound
    max: FiniteBound

    @model_validator(mode="after")
    def _bounds_ordered(self) -> Self:
        _check_range(self.min, self.max)
        return self


class IntColumn(_Frozen):
    """An integer-valued column; values are clipped to [min, max]."""

    name: ColumnName
    type: Literal["int"]
    min: IntBound
    max: IntBound

    @model_validator(mode="after")
    def _bounds_ordered(self) -> Self:
        _check_range(self.min, self.max)
        return self


class CategoricalColumn(_Frozen):
    """A column taking one of the declared ``values``; stored as int codes (index into ``values``)."""

    name: ColumnName
    type: Literal["categorical"]
    values: tuple[Category, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _values_unique(self) -> Self:
        if len(set(self.values)) != len(self.values):
            raise ValueError("categorical values must be unique")
        return self


Column = Annotated[FloatColumn | IntColumn | CategoricalColumn, Field(discriminator="type")]
NumericColumn = FloatColumn | IntColumn


MAX_ROWS_PER_UNIT = 1_000_000


class PrivacyUnit(_Frozen):
    """Who is protected: the rows sharing a value of ``column`` (an int or categorical column: a person, an
    account) form one unit, and neighbouring datasets differ by one unit with all its rows. ``max_rows`` is
    the public contribution bound: every query keeps at most that many of a unit's selected rows, chosen
    by a keyed hash the analyst can neither steer nor predict (``mechanisms.data.plan.UnitBound``)."""

    column: ColumnName
    max_rows: int = Field(strict=True, ge=1, le=MAX_ROWS_PER_UNIT)


class DatasetSchema(_Frozen):
    """The public description of a dataset (at least one column, unique names)."""

    columns: tuple[Column, ...] = Field(min_length=1, max_length=MAX_COLUMNS)
    neighboring: Literal["replace_one", "add_remove"]
    privacy_unit: PrivacyUnit | None = None
    accounting: Literal["dataset", "individual"] = "dataset"
    """``dataset``: one filter for the whole dataset. ``individual``: every privacy unit keeps its own
    filter at the dataset's budget and is left out of a release it cannot afford (Feldman–Zrnic;
    docs/privacy/individual.md#theorem-individual). Needs a declared ``privacy_unit`` and ``add_remove``
    neighbours (the theorem is for adding or removing one unit)."""

    @field_validator("columns", mode="before")
    @classmethod
    def _at_most_max_columns(cls, value: Any) -> Any:
        """Refuse a wide schema before validating any of its columns (validating 100 000 takes seconds)."""
        if isinstance(value, list | tuple) and len(value) > MAX_COLUMNS:
            raise ValueError(f"a schema has at most {MAX_COLUMNS} columns, this one has {len(value)}")
        return value

    @model_validator(mode="after")
    def _names_unique(self) -> Self:
        counts = Counter(c.name for c in self.columns)  # linear: no ``list.count`` per name
        duplicates = sorted(n for n, k in counts.items() if k > 1)
        if duplicates:
            raise ValueError(f"duplicate column names: {', '.join(map(repr, duplicates))}")
        return self

    @model_validator(mode="after")
    def _unit_is_an_identifier(self) -> Self:
        unit = self.privacy_unit
        if unit is not None and ORDER_COLUMN in self.names:
            raise ValueError(
                f"privacy_unit: a dataset with a privacy unit may not have a column named {ORDER_COLUMN!r} "
                "(the name of the bounding order the service adds)"
            )
        if unit is not None:
            column = self.column(unit.column)
            if column is None:
                raise ValueError(f"privacy_unit.column: no column named {unit.column!r}")
            if isinstance(column, FloatColumn):
                raise ValueError(
                    f"privacy_unit.column: {unit.column!r} is a float column; a unit is identified by an int "
                    "or categorical column"
                )
        return self

    @model_validator(mode="after")
    def _individual_needs_units(self) -> Self:
        if self.individual:
            if self.privacy_unit is None:
                raise ValueError(
                    "accounting: individual accounting keeps one filter per privacy unit; declare "
                    "privacy_unit (a column identifying each person; max_rows 1 if a row is a person)"
                )
            if self.neighboring != "add_remove":
                raise ValueError(
                    "accounting: individual accounting protects each unit against being added or removed; "
                    "set neighboring to add_remove"
                )
        return self

    @property
    def individual(self) -> bool:
        """Whether every privacy unit keeps its own filter (``accounting: individual``)."""
        return self.accounting == "individual"

    @property
    def unit_rows(self) -> int:
        """How many rows one neighbour step may change: the unit's ``max_rows``, or 1 (a row is a unit)."""
        return 1 if self.privacy_unit is None else self.privacy_unit.max_rows

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def column(self, name: str) -> FloatColumn | IntColumn | CategoricalColumn | None:
        """The column called ``name``, or None."""
        return next((c for c in self.columns if c.name == name), None)
