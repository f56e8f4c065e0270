"""The public schema of a dataset: its columns, their declared bounds, and the neighbour relation.

Everything here is **public**: mechanisms derive sensitivities from the declared bounds and categories and
never from the data (docs/privacy.md §6, rule 1). The data is clipped to the declared bounds on load
(``mechanisms.data.table``), so a bound is a promise the data cannot break.

JSON shape::

    {"columns": [{"name": "age", "type": "float", "min": 0, "max": 100},
                 {"name": "n", "type": "int", "min": 0, "max": 10},
                 {"name": "group", "type": "categorical", "values": ["a", "b"]}],
     "neighboring": "replace_one"}

``neighboring`` is ``replace_one`` (neighbours differ in one row's content; the row count is public) or
``add_remove`` (neighbours differ by one row's presence; the row count is private).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class DatasetSchema(_Frozen):
    """The public description of a dataset (at least one column, unique names)."""

    columns: tuple[Column, ...] = Field(min_length=1)
    neighboring: Literal["replace_one", "add_remove"]

    @model_validator(mode="after")
    def _names_unique(self) -> Self:
        names = [c.name for c in self.columns]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate column names: {', '.join(map(repr, duplicates))}")
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def column(self, name: str) -> FloatColumn | IntColumn | CategoricalColumn | None:
        """The column called ``name``, or None."""
        return next((c for c in self.columns if c.name == name), None)
