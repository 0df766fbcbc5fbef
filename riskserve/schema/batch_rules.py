"""The decision's CEL expressions evaluated over a whole batch at once, in numpy, where that is exact.

Per row, CEL costs a context of Python maps and a program run for the risk score and for each rule: about
40 µs a row, 40 ms for a ``DecideBatch`` of 1,000. Most pipelines' expressions are arithmetic and
comparisons over model scores and numeric features, which numpy computes for all rows in a few operations.

Only a subset of CEL is compiled here, typed statically so that CEL's own rules hold: double arithmetic
(``+ - * /``, unary ``-``), numeric comparisons (int and double mix, as in CEL), ``&& || !`` on bools,
``max``/``min`` of two doubles, the conditional ``c ? a : b`` (branches of one type), number, bool and
string literals (no escapes), a model's label compared with ``==``/``!=`` to a string or tested with ``in``
against a list of string literals, and the variables ``risk_score``, ``models.<name>.score``,
``models.<name>.fallback``, ``models.<name>.label`` and ``features.<numeric field>`` (one that always has
a value). Anything else (other strings, ``has``, string ordering, int arithmetic, ...) is not compiled
and the pipeline decides row by row, as before. Where CEL would raise for a row (an ordering
comparison with NaN, a NaN risk score) that row is marked and decided row by row too, so it gets the same
REVIEW and reason. At load the two ways are compared on sample rows; any difference keeps the row-by-row
way (see :class:`BatchRules`).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = [
    "STRING_LITERAL",
    "BatchInputs",
    "CompiledExpression",
    "NotCompilable",
    "RowInputs",
    "Unsure",
    "compile_expression",
]

_Array = np.ndarray[Any, np.dtype[Any]]
_Type = Literal["double", "int", "bool", "string"]


class NotCompilable(Exception):
    """The expression uses CEL beyond the subset compiled here (the caller decides row by row)."""


@dataclass(frozen=True)
class BatchInputs:
    """What the expressions read, one array per variable, one entry per row of the batch."""

    rows: int
    scores: Mapping[str, _Array]
    fallbacks: Mapping[str, _Array]
    features: Mapping[str, _Array]
    risk_score: _Array | None = None
    labels: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """Each model's labels, of the models whose label an expression reads."""


@dataclass(frozen=True)
class _Value:
    """An evaluated sub-expression: its values, and the rows where CEL would have raised (``unsure``)."""

    values: _Array
    unsure: _Array | None


_Evaluator = Callable[[BatchInputs], _Value]
_Scalar = Callable[["RowInputs"], Any]
"""One row's value; raises :class:`Unsure` where CEL would raise (the caller then asks CEL)."""


class Unsure(Exception):
    """CEL would raise on this row (NaN in an ordering comparison, ...): decide it with CEL."""


@dataclass(frozen=True)
class RowInputs:
    """What the expressions read for one row (the scalar twin of :class:`BatchInputs`)."""

    scores: Mapping[str, float]
    fallbacks: Mapping[str, bool]
    features: Mapping[str, float]
    risk_score: float = float("nan")
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CompiledExpression:
    """One CEL expression as a numpy function of a batch and a Python function of one row; ``type`` is its
    static CEL type."""

    source: str
    type: _Type
    evaluate: _Evaluator
    evaluate_row: _Scalar


STRING_LITERAL = re.compile(r"'[^'\\\n]*'|\"[^\"\\\n]*\"")
"""A CEL string literal without escapes (the only strings compiled here)."""
_TOKEN = re.compile(
    r"\s*(?:"
    r"(?P<number>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[uU]?)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    rf"|(?P<string>{STRING_LITERAL.pattern})"
    r"|(?P<op>&&|\|\||<=|>=|==|!=|[-+*/%<>!().,?:\[\]{}\"'])"
    r")"
)


def _tokens(source: str) -> list[str]:
    out: list[str] = []
    position = 0
    while position < len(source):
        if source[position:].strip() == "":
            break
        match = _TOKEN.match(source, position)
        if match is None or match.end() == position:
            raise NotCompilable(f"unexpected text at {position}: {source[position : position + 10]!r}")
        out.append(match.group(match.lastgroup or "op"))
        position = match.end()
    return out


def _or_unsure(*parts: _Array | None) -> _Array | None:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    out = present[0]
    for part in present[1:]:
        out = out | part
    return out


@dataclass(frozen=True)
class _Node:
    """A compiled sub-expression: its static type, its numpy form and its one-row form."""

    type: _Type
    vector: _Evaluator
    scalar: _Scalar


_COMPARE: dict[str, tuple[Callable[[_Array, _Array], _Array], Callable[[Any, Any], bool]]] = {
    "<": (np.less, operator.lt),
    "<=": (np.less_equal, operator.le),
    ">": (np.greater, operator.gt),
    ">=": (np.greater_equal, operator.ge),
    "==": (np.equal, operator.eq),
    "!=": (np.not_equal, operator.ne),
}
_ARITHMETIC: dict[str, tuple[Callable[[_Array, _Array], _Array], Callable[[float, float], float]]] = {
    "+": (np.add, operator.add),
    "-": (np.subtract, operator.sub),
    "*": (np.multiply, operator.mul),
    "/": (np.divide, lambda a, b: _divide(a, b)),
}


def _divide(a: float, b: float) -> float:
    """IEEE division, as CEL and numpy do it: ``x / 0.0`` is ±inf (NaN for 0 or NaN), not an error."""
    try:
        return a / b
    except ZeroDivisionError:
        if a != a or a == 0.0:
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)


@dataclass(frozen=True)
class _Variables:
    """The names an expression may read: model names and the numeric features that always have a value."""

    models: frozenset[str]
    features: frozenset[str]
    risk_score: bool


class _Parser:
    """Recursive descent over CEL's precedence (``||``, ``&&``, relations, ``+ -``, ``* /``, unary)."""

    def __init__(self, source: str, variables: _Variables) -> None:
        self._tokens = _tokens(source)
        self._at = 0
        self._variables = variables

    def parse(self) -> _Node:
        result = self._conditional()
        if self._at != len(self._tokens):
            raise NotCompilable(f"unsupported syntax at {self._peek()!r}")
        return result

    def _peek(self) -> str | None:
        return self._tokens[self._at] if self._at < len(self._tokens) else None

    def _take(self, expected: str | None = None) -> str:
        token = self._peek()
        if token is None or (expected is not None and token != expected):
            raise NotCompilable(f"expected {expected!r}, found {token!r}")
        self._at += 1
        return token

    def _conditional(self) -> _Node:
        condition = self._or()
        if self._peek() != "?":
            return condition
        self._take()
        when_true = self._conditional()
        self._take(":")
        when_false = self._conditional()
        return _choice(condition, when_true, when_false)

    def _or(self) -> _Node:
        left = self._and()
        while self._peek() == "||":
            self._take()
            left = _logical(left, self._and(), either=True)
        return left

    def _and(self) -> _Node:
        left = self._relation()
        while self._peek() == "&&":
            self._take()
            left = _logical(left, self._relation(), either=False)
        return left

    def _relation(self) -> _Node:
        left = self._additive()
        token = self._peek()
        if token == "in":
            self._take()
            left = _membership(left, self._strings())
            if self._peek() in _COMPARE or self._peek() == "in":
                raise NotCompilable("chained comparison")
            return left
        if token in _COMPARE:
            self._take()
            left = _comparison(token, left, self._additive())
            if self._peek() in _COMPARE:
                raise NotCompilable("chained comparison")
        return left

    def _additive(self) -> _Node:
        left = self._multiplicative()
        while self._peek() in ("+", "-"):
            left = _arithmetic(self._take(), left, self._multiplicative())
        return left

    def _multiplicative(self) -> _Node:
        left = self._unary()
        while self._peek() in ("*", "/"):
            left = _arithmetic(self._take(), left, self._unary())
        if self._peek() == "%":
            raise NotCompilable("'%' is not compiled")
        return left

    def _unary(self) -> _Node:
        token = self._peek()
        if token == "!":
            self._take()
            inner = self._unary()
            if inner.type != "bool":
                raise NotCompilable("'!' of a number")
            vector, scalar = inner.vector, inner.scalar
            return _Node(
                "bool",
                lambda batch: _Value(np.logical_not((v := vector(batch)).values), v.unsure),
                lambda row: not scalar(row),
            )
        if token == "-":
            self._take()
            inner = self._unary()
            if inner.type != "double":
                raise NotCompilable("'-' of a non-double")
            vector, scalar = inner.vector, inner.scalar
            return _Node(
                "double",
                lambda batch: _Value(np.negative((v := vector(batch)).values), v.unsure),
                lambda row: -scalar(row),
            )
        return self._primary()

    def _primary(self) -> _Node:
        token = self._take()
        if token == "(":
            inner = self._conditional()
            self._take(")")
            return inner
        if token[0].isdigit() or token[0] == ".":
            return _literal(token)
        if token[0] in "'\"":
            return _constant("string", token[1:-1])
        if token in ("true", "false"):
            return _constant("bool", token == "true")
        if token in ("max", "min") and self._peek() == "(":
            return self._extreme(token)
        if token == "risk_score" and self._variables.risk_score:
            return _Node("double", _risk_score, lambda row: row.risk_score)
        if token == "models":
            return self._model()
        if token == "features":
            self._take(".")
            name = self._take()
            if name not in self._variables.features:
                raise NotCompilable(f"feature '{name}' is not a numeric field that always has a value")
            return _Node(
                "double",
                lambda batch: _Value(batch.features[name], None),
                lambda row: row.features[name],
            )
        raise NotCompilable(f"'{token}' is not compiled")

    def _model(self) -> _Node:
        self._take(".")
        name = self._take()
        self._take(".")
        field = self._take()
        if name not in self._variables.models:
            raise NotCompilable(f"no model '{name}'")
        if field == "score":
            return _Node(
                "double", lambda batch: _Value(batch.scores[name], None), lambda row: row.scores[name]
            )
        if field == "fallback":
            return _Node(
                "bool", lambda batch: _Value(batch.fallbacks[name], None), lambda row: row.fallbacks[name]
            )
        if field == "label":
            return _Node(
                "string",
                lambda batch: _Value(np.asarray(batch.labels[name], dtype=object), None),
                lambda row: row.labels[name],
            )
        raise NotCompilable(f"models.{name}.{field} is not compiled")

    def _strings(self) -> frozenset[str]:
        """A list literal of strings, the right side of ``in`` (nothing else is compiled there)."""
        self._take("[")
        values: list[str] = []
        while True:
            token = self._take()
            if token[0] not in "'\"":
                raise NotCompilable("a list of anything but string literals")
            values.append(token[1:-1])
            separator = self._take()
            if separator == "]":
                break
            if separator != ",":
                raise NotCompilable(f"expected ',' or ']', found {separator!r}")
        return frozenset(values)

    def _extreme(self, function: str) -> _Node:
        self._take("(")
        first = self._conditional()
        self._take(",")
        second = self._conditional()
        self._take(")")
        if first.type != "double" or second.type != "double":
            raise NotCompilable(f"{function}() of a non-double")
        # riskserve's max(a, b) is ``a if a >= b else b`` (min: ``a <= b``): NaN picks b, here too.
        keep_first, keep = (
            (np.greater_equal, operator.ge) if function == "max" else (np.less_equal, operator.le)
        )
        left, right = first.vector, second.vector
        left_row, right_row = first.scalar, second.scalar

        def extreme(batch: BatchInputs) -> _Value:
            a, b = left(batch), right(batch)
            with np.errstate(invalid="ignore"):
                values = np.where(keep_first(a.values, b.values), a.values, b.values)
            return _Value(values, _or_unsure(a.unsure, b.unsure))

        def extreme_row(row: RowInputs) -> Any:
            a, b = left_row(row), right_row(row)
            return a if keep(a, b) else b

        return _Node("double", extreme, extreme_row)


def _risk_score(batch: BatchInputs) -> _Value:
    if batch.risk_score is None:
        raise RuntimeError("risk_score is not known yet")
    return _Value(batch.risk_score, None)


def _constant(kind: _Type, value: float | bool | str) -> _Node:
    dtype = object if kind == "string" else None
    return _Node(kind, lambda batch: _Value(np.full(batch.rows, value, dtype=dtype), None), lambda row: value)


def _membership(left: _Node, members: frozenset[str]) -> _Node:
    """``label in ['a', 'b']``: a string among string literals."""
    if left.type != "string":
        raise NotCompilable(f"'in' of a {left.type}")
    values = left.vector
    value_row = left.scalar

    def membership(batch: BatchInputs) -> _Value:
        strings = values(batch).values
        return _Value(np.fromiter((s in members for s in strings), dtype=bool, count=len(strings)), None)

    return _Node("bool", membership, lambda row: value_row(row) in members)


def _choice(condition: _Node, when_true: _Node, when_false: _Node) -> _Node:
    """``c ? a : b``. CEL evaluates only the branch taken, so a row is unsure when its condition is, or when
    the branch it takes is."""
    if condition.type != "bool":
        raise NotCompilable("a condition that is not a bool")
    if when_true.type != when_false.type:
        raise NotCompilable(f"branches of types {when_true.type} and {when_false.type}")
    test, first, second = condition.vector, when_true.vector, when_false.vector
    test_row, first_row, second_row = condition.scalar, when_true.scalar, when_false.scalar

    def choice(batch: BatchInputs) -> _Value:
        c, a, b = test(batch), first(batch), second(batch)
        taken = None
        if a.unsure is not None or b.unsure is not None:
            never = np.zeros(batch.rows, dtype=bool)
            a_unsure = never if a.unsure is None else a.unsure
            b_unsure = never if b.unsure is None else b.unsure
            taken = np.where(c.values, a_unsure, b_unsure)
        return _Value(np.where(c.values, a.values, b.values), _or_unsure(c.unsure, taken))

    def choice_row(row: RowInputs) -> Any:
        return first_row(row) if test_row(row) else second_row(row)

    return _Node(when_true.type, choice, choice_row)


def _literal(token: str) -> _Node:
    if token[-1] in "uU":
        raise NotCompilable("unsigned literal")
    if re.fullmatch(r"\d+", token):
        return _constant("int", float(int(token)))
    return _constant("double", float(token))


def _logical(left: _Node, right: _Node, *, either: bool) -> _Node:
    if left.type != "bool" or right.type != "bool":
        raise NotCompilable("'&&'/'||' of a number")
    first, second = left.vector, right.vector
    first_row, second_row = left.scalar, right.scalar
    operation = np.logical_or if either else np.logical_and

    def logical(batch: BatchInputs) -> _Value:
        a, b = first(batch), second(batch)
        return _Value(operation(a.values, b.values), _or_unsure(a.unsure, b.unsure))

    def logical_row(row: RowInputs) -> bool:
        a, b = bool(first_row(row)), bool(second_row(row))  # both sides, as the batch form (no short cut)
        return (a or b) if either else (a and b)

    return _Node("bool", logical, logical_row)


def _comparison(operator_: str, left: _Node, right: _Node) -> _Node:
    numbers = {left.type, right.type} <= {"double", "int"}
    same = left.type == right.type and left.type in ("bool", "string")
    if not numbers and not (same and operator_ in ("==", "!=")):
        raise NotCompilable(f"'{operator_}' between {left.type} and {right.type}")
    compare, compare_row = _COMPARE[operator_]
    ordering = numbers and operator_ not in ("==", "!=")
    first, second = left.vector, right.vector
    first_row, second_row = left.scalar, right.scalar

    def comparison(batch: BatchInputs) -> _Value:
        a, b = first(batch), second(batch)
        unsure = _or_unsure(a.unsure, b.unsure)
        if ordering:  # CEL raises on an ordering comparison with NaN: that row is decided by CEL
            nan = np.isnan(a.values) | np.isnan(b.values)
            if nan.any():
                unsure = _or_unsure(unsure, nan)
        with np.errstate(invalid="ignore"):
            return _Value(np.asarray(compare(a.values, b.values), dtype=bool), unsure)

    def comparison_row(row: RowInputs) -> bool:
        a, b = first_row(row), second_row(row)
        if ordering and (a != a or b != b):
            raise Unsure("NaN in an ordering comparison")
        return bool(compare_row(a, b))

    return _Node("bool", comparison, comparison_row)


def _arithmetic(operator_: str, left: _Node, right: _Node) -> _Node:
    if left.type != "double" or right.type != "double":
        raise NotCompilable(f"'{operator_}' between {left.type} and {right.type} (CEL does not mix them)")
    operation, operation_row = _ARITHMETIC[operator_]
    first, second = left.vector, right.vector
    first_row, second_row = left.scalar, right.scalar

    def arithmetic(batch: BatchInputs) -> _Value:
        a, b = first(batch), second(batch)
        with np.errstate(all="ignore"):
            return _Value(operation(a.values, b.values), _or_unsure(a.unsure, b.unsure))

    def arithmetic_row(row: RowInputs) -> float:
        try:
            return operation_row(first_row(row), second_row(row))
        except OverflowError as error:  # not raised by float arithmetic; CEL decides such a row
            raise Unsure(str(error)) from None

    return _Node("double", arithmetic, arithmetic_row)


def compile_expression(
    source: str, *, models: Sequence[str], features: Sequence[str], risk_score: bool
) -> CompiledExpression:
    """``source`` as a numpy function of a batch and a Python function of one row.

    Raises:
        NotCompilable: it uses CEL beyond the subset in this module's docstring.
    """
    variables = _Variables(frozenset(models), frozenset(features), risk_score)
    node = _Parser(source, variables).parse()
    return CompiledExpression(source, node.type, node.vector, node.scalar)
