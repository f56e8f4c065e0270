"""HAVING, ORDER BY and LIMIT of the SQL front: free post-processing of a released table.

A statement's aggregates are released by the mechanism (``measures.*``) for every cell; the SQL response then
shows them as rows in the statement's column order, keeps the rows whose released values pass ``HAVING``,
sorts them by ``ORDER BY`` and cuts them to ``LIMIT``/``OFFSET``. Everything here reads the release only
(public), so it costs nothing and changes no charge; the stored release keeps every cell (``GET
/v1/requests/{id}``). A condition on a noisy value is a condition on the noise too: a group with a true
count of 2 may pass ``HAVING COUNT(*) > 3``; the release's intervals say how far a value may be off.

Each row comes with its intervals (``intervals``, parallel to ``rows``: ``{column: [lower, upper]}`` for
every released measure of the row, at the release's ``interval.level``; docs/mechanisms/analytics.md
"Intervals"), and a count or distinct count released below 0 is named in a warning: it is noise around a
small true count, which its interval shows.
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
        return self.table(release)[0]

    def table(self, release: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, list[float]]]]:
        """The rows (filtered, sorted and cut) and, parallel to them, each row's intervals: ``{column:
        [lower, upper]}`` for the released measures whose interval the release carries."""
        cells = release.get("groups")
        if cells is None:
            cells = [{"key": {}, **release.get("values", {}), "interval": release.get("interval")}]
        table = [[self._value(o, cell) for o in self.outputs] + [index] for index, cell in enumerate(cells)]
        kept = [row for row in table if all(self._passes(row, h) for h in self.having)]
        for order in reversed(self.order):  # stable sorts, last key first
            kept.sort(key=_sort_key(order), reverse=order.descending)
        end = None if self.limit is None else self.offset + self.limit
        chosen = kept[self.offset : end]
        rows = [dict(zip(self.columns, row[:-1], strict=True)) for row in chosen]
        return rows, [self._intervals(cells[row[-1]]) for row in chosen]

    def _intervals(self, cell: dict[str, Any]) -> dict[str, list[float]]:
        interval = cell.get("interval")
        if not isinstance(interval, dict) or not isinstance(interval.get("lower"), dict):
            return {}
        lower, upper = interval["lower"], interval.get("upper", {})
        return {
            o.name: [lower[o.field], upper[o.field]]
            for o in self.outputs
            if o.source == "value" and o.field in lower and o.field in upper
        }

    def warnings(self, release: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
        """A note per count column with a value below 0 among the rows: it is noise, not data."""
        notes = []
        for o in self.outputs:
            if o.source != "value" or not (o.field == "count" or o.field.startswith("count_distinct(")):
                continue
            negative = sum(1 for row in rows if isinstance(row[o.name], float | int) and row[o.name] < 0)
            if negative:
                notes.append(
                    f"{o.name} is negative in {negative} row(s): released values carry noise, and a count "
                    "below 0 is noise around a small true count (see the row's interval; the true count "
                    "is ≥ 0)"
                )
        level = (
            release.get("interval", {}).get("level") if isinstance(release.get("interval"), dict) else None
        )
        if level is not None and notes:
            notes.append(f"intervals are at level {level} (each covers its true value with that probability)")
        return notes

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
