"""The SQL front: ``POST /v1/datasets/{id}/sql`` maps one ``SELECT`` onto the query model and submits it.

Accepted (parsed with sqlglot; docs/mechanisms/analytics.md)::

    SELECT agg, … FROM <dataset id | dataset> [WHERE cond AND …] [GROUP BY col, …]
        [HAVING ref op literal AND …] [ORDER BY ref [ASC|DESC], …] [LIMIT n [OFFSET m]]

* aggregates: ``COUNT(*)``, ``COUNT(DISTINCT unit)`` (the number of privacy units, on a dataset that
  declares one; docs/privacy/units_learners.md#count-distinct-unit), ``SUM(col)``, ``AVG(col)``,
  ``VARIANCE(col)``/``VAR_SAMP``/``VAR_POP``,
  ``STDDEV(col)``/``STDDEV_SAMP``/``STDDEV_POP`` → ``measures.laplace`` (or ``measures.gaussian`` with
  ``"noise": "gaussian"``); ``MEDIAN(col)``, ``QUANTILE(col, q)``, ``PERCENTILE_CONT(q) WITHIN GROUP
  (ORDER BY col)`` → ``quantile`` (one column, no GROUP BY). A bare column in the SELECT list must be a
  GROUP BY column (it names the cells' keys). Aliases are ignored.
* conditions: ``col op literal`` (=, <>, !=, <, <=, >, >=), ``col IN (literal, …)``, ``col BETWEEN a AND b``,
  joined by AND.

* ``HAVING``, ``ORDER BY``, ``LIMIT``/``OFFSET`` post-process the released cells (``service.api.sql_view``):
  a ``ref`` is a selected column or aggregate (by its expression, its alias or, in ORDER BY, its position).
  They are free and change no charge; the response's ``rows`` shows their result, the stored release keeps
  every cell.

Anything else (joins, OR, NOT, DISTINCT, subqueries, expressions over columns, other functions) cannot be
bounded from the public schema and is refused with a 422 problem naming the clause (``sql.select``,
``sql.where``, …). The translated request goes through the same path as
``POST /v1/datasets/{id}/requests`` (validation, admission by the filter, run, settlement): the charge is
the mechanism's, nothing is charged for a refused statement.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import sqlglot
from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictFloat, StrictInt, StrictStr
from sqlglot import exp
from sqlglot.errors import SqlglotError
from starlette.concurrency import run_in_threadpool

from mechanisms.queries.language import MAX_CONDITIONS
from service.api.deps import AdminOrAnalyst, Analyst, RuntimeDep, SessionDep
from service.api.routers import requests as requests_router
from service.api.routers.requests import IdempotencyKey, Prefer
from service.api.schemas import RequestIn, RequestOut, problem_doc
from service.api.sql_view import Having, Order, Output, SqlView
from service.errors import InvalidInput
from service.runs import requests as lifecycle

router = APIRouter(tags=["sql"])

MAX_SQL_CHARS = 10_000
MAX_LITERAL_CHARS = 400


class SqlIn(BaseModel):
    """A SQL statement and the noise to answer it with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sql: StrictStr = Field(
        min_length=1, max_length=MAX_SQL_CHARS, examples=["SELECT COUNT(*), AVG(age) FROM demo"]
    )
    noise: Literal["laplace", "gaussian"] = Field("laplace", description="quantiles always use ε (pure)")
    epsilon: StrictFloat | StrictInt | None = Field(
        None, description="pure-DP ε of the whole statement (laplace, quantiles)"
    )
    noise_multiplier: StrictFloat | StrictInt | None = Field(
        None, description="gaussian: σ/ℓ2-sensitivity per block"
    )
    candidates: StrictInt | None = Field(None, description="quantiles: size of the public candidate grid")
    confidence: StrictFloat | None = Field(
        None, description="level of the measures' intervals (default 0.95; post-processing, free)"
    )


class SqlTranslation(BaseModel):
    mechanism: str
    params: dict[str, Any]
    columns: list[str] = Field(description="the statement's output columns, in order (the rows' keys)")
    _view: SqlView | None = PrivateAttr(default=None)

    @property
    def view(self) -> SqlView | None:
        """The release as the statement's rows (HAVING, ORDER BY and LIMIT applied)."""
        return self._view


class SqlRequestOut(RequestOut):
    """The request, plus the release as the statement's rows (HAVING, ORDER BY and LIMIT applied)."""

    columns: list[str]
    rows: list[dict[str, Any]] | None = Field(
        description="the released cells as rows after HAVING, ORDER BY and LIMIT (free post-processing); "
        "null until the release exists"
    )
    intervals: list[dict[str, list[float]]] | None = Field(
        None,
        description="parallel to rows: {column: [lower, upper]} for each released measure of the row, at "
        "level interval_level (covers the true value on the clipped data with probability ≥ that level; "
        "means, variances and std: a conservative union bound)",
    )
    interval_level: float | None = Field(None, description="the level of every interval in intervals")
    warnings: list[str] = Field(
        default_factory=list, description="e.g. a count released below 0 (noise around a small count)"
    )


_MEASURES: dict[type[exp.Expression], str] = {
    exp.Sum: "sum",
    exp.Avg: "mean",
    exp.Variance: "variance",
    exp.VariancePop: "variance",
    exp.Stddev: "std",
    exp.StddevSamp: "std",
    exp.StddevPop: "std",
}
_COMPARISONS: dict[type[exp.Expression], str] = {
    exp.EQ: "eq",
    exp.NEQ: "ne",
    exp.LT: "lt",
    exp.LTE: "le",
    exp.GT: "gt",
    exp.GTE: "ge",
}
_CLAUSES = {
    "joins": "join",
    "distinct": "select",
    "with_": "with",
    "with": "with",
    "qualify": "qualify",
    "windows": "window",
    "laterals": "from",
    "pivots": "from",
    "kind": "select",
}
_INTEGER = re.compile(r"^[0-9]+$")
_SELECT_ARGS = frozenset(
    {"expressions", "from", "from_", "where", "group", "having", "order", "limit", "offset"}
)
"""The only arguments a translated SELECT may carry: every other clause sqlglot parses (INTO, FOR UPDATE,
CLUSTER/DISTRIBUTE/SORT BY, CONNECT BY, a future one, …) is refused rather than silently ignored."""
_TABLE_ARGS = frozenset({"this", "alias"})


def _refuse(clause: str, reason: str) -> InvalidInput:
    return InvalidInput(f"sql.{clause}", reason)


def _column(node: exp.Expression | None, clause: str) -> str:
    if not isinstance(node, exp.Column) or node.table:
        shown = node.sql() if isinstance(node, exp.Expression) else "nothing"
        raise _refuse(clause, f"expected a plain column name, got {shown[:60]!r}")
    return str(node.name)


def _literal(node: exp.Expression | None, clause: str) -> int | float | str:
    negative = False
    if isinstance(node, exp.Neg):
        negative, node = True, node.this
    if isinstance(node, exp.Paren):
        return _literal(node.this, clause)
    if not isinstance(node, exp.Literal):
        shown = node.sql() if isinstance(node, exp.Expression) else "nothing"
        raise _refuse(clause, f"expected a literal, got {shown[:60]!r}")
    text = str(node.this)
    if len(text) > MAX_LITERAL_CHARS:
        raise _refuse(clause, f"a literal longer than {MAX_LITERAL_CHARS} characters")
    if node.is_string:
        if negative:
            raise _refuse(clause, "a string cannot be negated")
        return text
    value: int | float = int(text) if _INTEGER.match(text) else float(text)
    if isinstance(value, float) and not (value == value and abs(value) != float("inf")):
        raise _refuse(clause, f"{text[:30]!r} is not a finite number")
    if value == 0 and re.search(r"[1-9]", text.lower().split("e")[0]):
        raise _refuse(clause, f"{text[:30]!r} underflows to 0 as a float")
    return -value if negative else value


def _and_terms(root: exp.Expression, clause: str) -> list[exp.Expression]:
    """The AND-joined terms of a WHERE or HAVING, in the statement's order, flattened without recursion (a
    long AND chain is a deep tree); at most ``MAX_CONDITIONS``."""
    out: list[exp.Expression] = []
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, exp.Paren):
            stack.append(node.this)
        elif isinstance(node, exp.And):
            stack.extend((node.expression, node.this))  # popped left first: the statement's order
        else:
            out.append(node)
        if len(out) > MAX_CONDITIONS:
            raise _refuse(clause, f"at most {MAX_CONDITIONS} conditions")
    return out


def _conditions(root: exp.Expression) -> list[dict[str, Any]]:
    """The WHERE's conditions (a BETWEEN is two)."""
    out = [condition for node in _and_terms(root, "where") for condition in _condition(node)]
    if len(out) > MAX_CONDITIONS:
        raise _refuse("where", f"at most {MAX_CONDITIONS} conditions")
    return out


def _condition(node: exp.Expression) -> list[dict[str, Any]]:
    if isinstance(node, exp.Between):
        if node.args.get("symmetric"):
            raise _refuse("where", "BETWEEN SYMMETRIC is not supported: give low AND high")
        column = _column(node.this, "where")
        low, high = _literal(node.args.get("low"), "where"), _literal(node.args.get("high"), "where")
        return [{"column": column, "op": "ge", "value": low}, {"column": column, "op": "le", "value": high}]
    if isinstance(node, exp.In):
        if node.args.get("query") is not None:
            raise _refuse("where", "IN takes a list of literals, not a subquery")
        values = [_literal(v, "where") for v in node.expressions]
        return [{"column": _column(node.this, "where"), "op": "in", "value": values}]
    op = _COMPARISONS.get(type(node))
    if op is None:
        kind = "OR" if isinstance(node, exp.Or) else "NOT" if isinstance(node, exp.Not) else node.key.upper()
        raise _refuse("where", f"{kind} cannot be bounded: use col op literal, IN, BETWEEN joined by AND")
    return [{"column": _column(node.this, "where"), "op": op, "value": _literal(node.expression, "where")}]


def _level(node: exp.Expression | None) -> float:
    """A quantile level: a numeric literal (its range is checked by the mechanism's params)."""
    value = _literal(node, "select")
    if isinstance(value, str):
        raise _refuse("select", f"a quantile level is a number in [0, 1], not the string {value[:30]!r}")
    return float(value)


def _quantile(node: exp.Expression) -> tuple[str, float] | None:
    """(column, level) of a quantile aggregate, or None when ``node`` is not one."""
    if isinstance(node, exp.Median):
        return _column(node.this, "select"), 0.5
    if isinstance(node, exp.Quantile):
        return _column(node.this, "select"), _level(node.args.get("quantile"))
    if isinstance(node, exp.WithinGroup) and isinstance(node.this, exp.PercentileCont):
        order = node.expression
        if not isinstance(order, exp.Order) or len(order.expressions) != 1:
            raise _refuse("select", "PERCENTILE_CONT needs WITHIN GROUP (ORDER BY one column)")
        ordered = order.expressions[0]
        if ordered.args.get("desc"):
            raise _refuse("select", "PERCENTILE_CONT: ORDER BY … DESC is not supported")
        return _column(ordered.this, "select"), _level(node.this.this)
    return None


def _measure(node: exp.Expression) -> dict[str, Any] | None:
    if isinstance(node, exp.Count):
        if isinstance(node.this, exp.Distinct):  # the number of privacy units (checked by the mechanism)
            if len(node.this.expressions) != 1:
                raise _refuse("select", "COUNT(DISTINCT …) takes one column: the privacy unit's")
            return {"kind": "count_distinct", "column": _column(node.this.expressions[0], "select")}
        if not isinstance(node.this, exp.Star) or node.args.get("distinct"):
            raise _refuse("select", "only COUNT(*) and COUNT(DISTINCT <privacy unit column>) are supported")
        return {"kind": "count"}
    kind = _MEASURES.get(type(node))
    if kind is None:
        return None
    if node.args.get("distinct") or isinstance(node.this, exp.Distinct):
        raise _refuse("select", "DISTINCT aggregates cannot be bounded")
    return {"kind": kind, "column": _column(node.this, "select")}


def translate(sql: str, dataset_id: str, body: SqlIn) -> SqlTranslation:
    """The mechanism and params of one statement, or ``InvalidInput`` naming the clause it cannot bound."""
    try:
        statements = sqlglot.parse(sql)
    except SqlglotError as exc:  # ParseError, TokenError (e.g. an unterminated comment), …
        raise _refuse("syntax", f"not valid SQL: {(str(exc).splitlines() or [''])[0][:200]}") from None
    except RecursionError:
        raise _refuse("syntax", "the statement is nested too deeply") from None
    except AttributeError:  # sqlglot's parser on a statement cut inside a subquery predicate ("x > ALL (")
        raise _refuse("syntax", "not valid SQL: the statement ends inside an expression") from None
    try:
        return _translate(statements, dataset_id, body)
    except RecursionError:
        raise _refuse("syntax", "the statement is nested too deeply") from None


def _translate(statements: Sequence[object], dataset_id: str, body: SqlIn) -> SqlTranslation:
    if len(statements) != 1 or statements[0] is None:
        raise _refuse("syntax", "exactly one statement is allowed")
    tree = statements[0]
    if not isinstance(tree, exp.Select):
        raise _refuse("select", f"only SELECT is supported, not {str(getattr(tree, 'key', '?')).upper()}")
    for arg, clause in _CLAUSES.items():
        if tree.args.get(arg):
            raise _refuse(
                clause, f"{clause.replace('_', ' ').upper()} cannot be bounded from the public schema"
            )
    for arg, value in tree.args.items():
        if value and arg not in _SELECT_ARGS:
            raise _refuse(arg, f"{arg.replace('_', ' ').upper()} is not supported")
    source = tree.args.get("from_") or tree.args.get("from")
    if (
        source is None
        or not isinstance(source.this, exp.Table)
        or any(value and arg not in _TABLE_ARGS for arg, value in source.this.args.items())
    ):
        raise _refuse("from", "FROM must name the dataset (its id, or `dataset`), with no sample or hint")
    if source.this.name not in (dataset_id, "dataset"):
        raise _refuse("from", f"FROM must name this dataset ({dataset_id!r} or `dataset`)")
    where_node = tree.args.get("where")
    where = _conditions(where_node.this) if where_node is not None else []
    group_node = tree.args.get("group")
    if group_node is not None and any(
        value and arg != "expressions" for arg, value in group_node.args.items()
    ):
        raise _refuse("group_by", "only GROUP BY plain columns (no ROLLUP, CUBE, GROUPING SETS or ALL)")
    group_by = [_column(g, "group_by") for g in group_node.expressions] if group_node is not None else []
    measures: list[dict[str, Any]] = []
    quantiles: list[tuple[str, float]] = []
    outputs: list[Output] = []
    for item in tree.expressions:
        node = item.this if isinstance(item, exp.Alias) else item
        name = item.alias if isinstance(item, exp.Alias) else node.sql()
        if isinstance(node, exp.Column):
            if _column(node, "select") not in group_by:
                raise _refuse("select", f"column {node.name!r} outside an aggregate must be in GROUP BY")
            outputs.append(Output(name, "key", node.name, node.sql()))
            continue
        quantile = _quantile(node)
        if quantile is not None:
            quantiles.append(quantile)
            outputs.append(Output(name, "value", repr(quantile[1]), node.sql()))
            continue
        measure = _measure(node)
        if measure is None:
            raise _refuse("select", f"{node.sql()[:60]!r} is not a supported aggregate")
        if measure not in measures:
            measures.append(measure)
        label = "count" if "column" not in measure else f"{measure['kind']}({measure['column']})"
        outputs.append(Output(name, "value", label, node.sql()))
    if quantiles and measures:
        raise _refuse("select", "quantiles and other aggregates need two statements")
    columns = [o.name for o in outputs]
    if quantiles:
        if any(tree.args.get(arg) for arg in ("having", "order", "limit", "offset")):
            raise _refuse(
                "select", "a quantile statement is one row: HAVING, ORDER BY and LIMIT do not apply"
            )
        translated, view = _quantile_params(quantiles, where, group_by, body), SqlView(tuple(outputs))
    elif not measures:
        raise _refuse("select", "no aggregate to release")
    else:
        translated, view = _measures_params(measures, where, group_by, body), _view(tree, tuple(outputs))
    translation = SqlTranslation(mechanism=translated.mechanism, params=translated.params, columns=columns)
    translation._view = view
    return translation


def _view(tree: exp.Select, outputs: tuple[Output, ...]) -> SqlView:
    """HAVING, ORDER BY and LIMIT/OFFSET of ``tree`` over the statement's ``outputs`` (free
    post-processing of the release: ``service.api.sql_view``)."""
    having_node = tree.args.get("having")
    having = _having(having_node.this, outputs) if having_node is not None else ()
    order_node = tree.args.get("order")
    order: tuple[Order, ...] = ()
    if order_node is not None:
        if any(value and arg != "expressions" for arg, value in order_node.args.items()):
            raise _refuse("order_by", "only ORDER BY selected columns, ASC or DESC")
        order = tuple(_order(item, outputs) for item in order_node.expressions)
    return SqlView(
        outputs,
        having,
        order,
        _count(tree.args.get("limit"), "limit"),
        _count(tree.args.get("offset"), "offset") or 0,
    )


def _reference(node: exp.Expression, outputs: tuple[Output, ...], clause: str) -> int:
    """The selected column ``node`` names: by its alias or expression (or, in ORDER BY, its position)."""
    if clause == "order_by" and isinstance(node, exp.Literal) and not node.is_string:
        position = int(node.this) if _INTEGER.match(str(node.this)) else 0
        if not 1 <= position <= len(outputs):
            raise _refuse(clause, f"position {node.this} is not a selected column (1 … {len(outputs)})")
        return position - 1
    text = node.sql()
    for index, output in enumerate(outputs):
        if text in (output.sql, output.name) or (isinstance(node, exp.Column) and node.name == output.name):
            return index
    raise _refuse(clause, f"{text[:60]!r} is not a selected column or aggregate of this statement")


def _having(root: exp.Expression, outputs: tuple[Output, ...]) -> tuple[Having, ...]:
    """The HAVING's conditions: a selected column or aggregate compared with a literal of its type."""
    out: list[Having] = []
    for node in _and_terms(root, "having"):
        op = _COMPARISONS.get(type(node))
        if op is None:
            raise _refuse("having", "HAVING takes selected-value op literal, joined by AND")
        index = _reference(node.this, outputs, "having")
        value = _literal(node.expression, "having")
        if (outputs[index].source == "key") != isinstance(value, str):
            kind = "a string" if outputs[index].source == "key" else "a number"
            raise _refuse("having", f"{outputs[index].name!r} is compared with {kind}")
        out.append(Having(index, op, value if isinstance(value, str) else float(value)))
    return tuple(out)


def _order(item: exp.Expression, outputs: tuple[Output, ...]) -> Order:
    if not isinstance(item, exp.Ordered) or item.args.get("with_fill"):
        raise _refuse("order_by", "ORDER BY takes selected columns with ASC or DESC")
    return Order(_reference(item.this, outputs, "order_by"), bool(item.args.get("desc")))


def _count(node: exp.Expression | None, clause: str) -> int | None:
    """A LIMIT or OFFSET: a non-negative integer literal."""
    if node is None:
        return None
    value = _literal(node.expression if isinstance(node, exp.Limit | exp.Offset) else node, clause)
    if not isinstance(value, int) or value < 0:
        raise _refuse(clause, f"{clause.upper()} takes a non-negative integer")
    return value


def _quantile_params(
    quantiles: list[tuple[str, float]], where: list[dict[str, Any]], group_by: list[str], body: SqlIn
) -> _Translated:
    if group_by:
        raise _refuse("group_by", "quantiles per group are not supported")
    columns = {c for c, _ in quantiles}
    if len(columns) != 1:
        raise _refuse("select", "all quantiles of one statement must be of the same column")
    if body.noise != "laplace":
        raise InvalidInput("noise", "quantiles use report-noisy-max (pure ε): give epsilon")
    if body.confidence is not None:
        raise InvalidInput(
            "confidence", "only for COUNT, SUM, AVG, VARIANCE and STDDEV (quantiles have no interval)"
        )
    if body.epsilon is None:
        raise InvalidInput("epsilon", "required")
    levels = list(dict.fromkeys(q for _, q in quantiles))
    params: dict[str, Any] = {"column": columns.pop(), "quantiles": levels, "epsilon": float(body.epsilon)}
    params["where"] = where
    if body.candidates is not None:
        params["candidates"] = body.candidates
    return _Translated("quantile", params)


def _measures_params(
    measures: list[dict[str, Any]], where: list[dict[str, Any]], group_by: list[str], body: SqlIn
) -> _Translated:
    params: dict[str, Any] = {"measures": measures, "group_by": group_by, "where": where}
    if body.confidence is not None:
        params["confidence"] = body.confidence
    if body.candidates is not None:
        raise InvalidInput("candidates", "only for quantiles")
    if body.noise == "gaussian":
        if body.noise_multiplier is None:
            raise InvalidInput("noise_multiplier", "required with noise gaussian")
        return _Translated("measures.gaussian", {**params, "noise_multiplier": float(body.noise_multiplier)})
    if body.epsilon is None:
        raise InvalidInput("epsilon", "required")
    return _Translated("measures.laplace", {**params, "epsilon": float(body.epsilon)})


@dataclass(frozen=True)
class _Translated:
    mechanism: str
    params: dict[str, Any]


@router.post(
    "/v1/datasets/{dataset_id}/sql:translate",
    operation_id="translateSql",
    summary="The mechanism and params a SQL statement maps to (no charge, nothing is read)",
)
def translate_sql(
    dataset_id: str, body: SqlIn, session: SessionDep, who: AdminOrAnalyst, runtime: RuntimeDep
) -> SqlTranslation:
    translation = translate(body.sql, dataset_id, body)
    lifecycle.dry_run(session, who, dataset_id, translation.mechanism, translation.params, runtime.tables)
    return translation


@router.post(
    "/v1/datasets/{dataset_id}/sql",
    operation_id="submitSql",
    summary="Answer one SQL SELECT with a DP release (same path and charge as /requests)",
    responses={
        202: {"description": "queued or still running; poll the Location after Retry-After seconds"},
        409: problem_doc("refused"),
        422: problem_doc("a clause that cannot be bounded (the field names it, e.g. sql.where)"),
    },
)
async def submit_sql(
    dataset_id: str,
    body: SqlIn,
    runtime: RuntimeDep,
    analyst: Analyst,
    response: Response,
    idempotency_key: IdempotencyKey = None,
    prefer: Prefer = None,
) -> SqlRequestOut:
    translation = await run_in_threadpool(translate, body.sql, dataset_id, body)  # parsing: off the loop
    request = RequestIn(mechanism=translation.mechanism, params=translation.params)
    out = await requests_router.submit_request(
        runtime, analyst, dataset_id, request, response, idempotency_key, prefer
    )
    view, release = translation.view, out.release
    rows, intervals, level, warnings = None, None, None, []
    if view is not None and release is not None:
        rows, intervals = view.table(release)
        warnings = view.warnings(release, rows)
        interval = release.get("interval")
        level = interval.get("level") if isinstance(interval, dict) else None
        if level is None:
            intervals = None
    if rows is None and release is not None and "values" in release:  # a quantile statement: one row
        rows = [
            {
                o: release["values"].get(v)
                for o, v in zip(translation.columns, release["values"], strict=False)
            }
        ]
    extra = {"intervals": intervals, "interval_level": level, "warnings": warnings}
    return SqlRequestOut(**out.model_dump(), columns=translation.columns, rows=rows, **extra)
