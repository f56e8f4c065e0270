"""HAVING, ORDER BY and LIMIT of the SQL front: free post-processing of a released table.

A statement's aggregates are released by the mechanism (``measures.*``) for every cell; the SQL response then
shows them as rows in the statement's column order, keeps the rows whose released values pass ``HAVING``,
sorts them by ``ORDER BY`` and cuts them to ``LIMIT``/``OFFSET``. Everything here reads the release only
(public), so it costs nothing and changes no charge; the stored release keeps every cell (``GET
/v1/requests/{id}``). A condition on a noisy value is a condition on the noise too: a group with a true
count of 2 may pass ``HAVING COUNT(*) > 3``; the release's intervals say how far a value may be off.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Source = Literal["key", "value"]

_OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
}


@dataclass(frozen=True)
class Output:
    """One selected column: its name in the rows, and where its value comes from (a group key, or a
    released measure by its label)."""

    name: str
    source: Source
    field: str
    sql: str
    """The expression as sqlglot prints it (how HAVING and ORDER BY refer to an aggregate)."""


@dataclass(frozen=True)
class Having:
    output: int
    op: str
    value: float | str


@dataclass(frozen=True)
class Order:
    output: int
    descending: bool


@dataclass(frozen=True)
class SqlView:
    outputs: tuple[Output, ...]
    having: tuple[Having, ...] = ()
    order: tuple[Order, ...] = ()
    limit: int | None = None
    offset: int = 0

    @property
    def columns(self) -> list[str]:
        return [o.name for o in self.outputs]

    def rows(self, release: dict[str, Any]) -> list[dict[str, Any]]:
        """The release as the statement's rows: filtered, sorted and cut."""
        cells = release.get("groups")
        if cells is None:
            cells = [{"key": {}, **release.get("values", {})}]
        table = [[self._value(o, cell) for o in self.outputs] for cell in cells]
        kept = [row for row in table if all(self._passes(row, h) for h in self.having)]
        for order in reversed(self.order):  # stable sorts, last key first
            kept.sort(key=_sort_key(order), reverse=order.descending)
        end = None if self.limit is None else self.offset + self.limit
        return [dict(zip(self.columns, row, strict=True)) for row in kept[self.offset : end]]

    @staticmethod
    def _value(output: Output, cell: dict[str, Any]) -> Any:
        return cell["key"].get(output.field) if output.source == "key" else cell.get(output.field)

    @staticmethod
    def _passes(row: list[Any], having: Having) -> bool:
        value = row[having.output]
        if value is None:
            return False
        return _OPERATORS[having.op](value, having.value)


def _sort_key(order: Order) -> Callable[[list[Any]], tuple[bool, Any]]:
    """Nulls last in either direction; otherwise the value (one column holds one type: keys are strings,
    measures floats)."""

    def key(row: list[Any]) -> tuple[bool, Any]:
        value = row[order.output]
        missing = value is None
        return (missing != order.descending, 0 if missing else value)

    return key
