"""Whether copies of one shape are a derivation: arithmetic that holds, step after step.

Worked arithmetic repeats a shape for thousands of tokens while its numbers change without
counting (running sums, long multiplication, recurrences, tables of values, amortization
schedules); so does a loop whose numbers wander (``a(138) = 139 + 140 = 555, a(139) = ...``). What
tells them apart is that a derivation's numbers follow from each other: each copy states a sum, a
product or a remainder that holds, or one of its numbers is one of its own or the copy before's
numbers combined (a balance less the principal). A loop's numbers hold by chance only.

A copy is judged once (the result is remembered by its numbers): the cost is per copy, not per check.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable

#: Numbers longer than this are not compared (an int of thousands of digits is slow to build).
_MAX_DIGITS = 80
#: Arithmetic as written: numbers, operators and brackets (``x`` and ``mod`` among the operators).
_TOKEN = r"\d+(?:\.\d+)?|mod|[-+*/×x÷^%()]"
_TOKENS = re.compile(rf"\s*({_TOKEN})")
_HEAD = re.compile(rf"(?:\s*(?:{_TOKEN}))+")
_TAIL = re.compile(rf"(?:\s*(?:{_TOKEN}))+\s*$")
_BINARY: dict[str, Callable[[float, float], float]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "×": operator.mul, "x": operator.mul,
    "/": operator.truediv, "÷": operator.truediv, "mod": operator.mod,
}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "×": 2, "x": 2, "/": 2, "÷": 2, "mod": 2}
#: How a number of a table's row may follow from two others that change from row to row (a
#: balance less the principal): ``a + b``, ``a - b``, ``a × b``.
_RELATIONS: tuple[Callable[[float, float], float], ...] = (operator.add, operator.sub, operator.mul)


def derived_copies(copies: list[str], numbers: list[str], per_copy: int) -> int:
    """How many of the copies (the span's text each, its numbers ``per_copy`` at a time in
    ``numbers``, the first copy's before the others) hold arithmetic with the copy before."""
    return sum(
        _holds(copies[i - 1] + copies[i], tuple(numbers[(i - 1) * per_copy : (i + 1) * per_copy]), per_copy)
        for i in range(1, len(copies))
    )


@functools.lru_cache(maxsize=4096)
def _holds(text: str, numbers: tuple[str, ...], per_copy: int) -> bool:
    """Whether ``text`` (two copies: a copy begins anywhere in a line) states an equation that
    holds, or a number of the second copy that changed follows from two that changed (of the two
    copies' ``numbers``)."""
    if states_arithmetic(text):
        return True
    if any(len(x) > _MAX_DIGITS for x in numbers):
        return False
    values = [_number(x) for x in numbers]
    before, now = values[:per_copy], values[per_copy:]
    changed = [j for j in range(per_copy) if now[j] != before[j]]
    operands = [v for j in changed for v in (before[j], now[j]) if v not in (0, 1)]
    results = [(now[j], _unit(numbers[per_copy + j])) for j in changed]
    for a in operands:
        for b in operands:
            for relate in _RELATIONS:
                got = relate(a, b)
                if any(c != a and c != b and abs(got - c) <= unit for c, unit in results):
                    return True
    return False


def states_arithmetic(text: str) -> bool:
    """Whether ``text`` states an equation that holds: ``2 × 3 = 6``, ``a = 7 mod 4 = 3``, ``17 ÷ 5 = 3``."""
    sides = text.split("=")
    for left, right in zip(sides, sides[1:]):
        head, tail = _HEAD.match(right), _TAIL.search(left)
        if head is None or tail is None:
            continue
        computed, said = _evaluate(tail.group()), _evaluate(head.group())
        if computed is None or said is None or (computed[1] < 2 and said[1] < 2):
            continue  # a number said again is no arithmetic
        if any(abs(c - said[0]) <= _unit(head.group().strip()) for c in (computed[0], computed[0] // 1)):
            return True  # ``17 ÷ 5 = 3`` is a quotient, its remainder said next
    return False


def _evaluate(written: str) -> tuple[float, int] | None:
    """The value of the arithmetic ``written`` (from its first token that starts an expression
    to its end) and how many numbers it holds, or None."""
    tokens = _TOKENS.findall(written)
    for start in range(min(len(tokens), 3)):
        try:
            value, at = _expression(tokens, start)
        except (ArithmeticError, IndexError, ValueError, OverflowError):
            continue
        if at == len(tokens):
            return value, sum(t[0].isdigit() for t in tokens[start:])
    return None


def _number(written: str) -> int | float:
    """An int where exact arithmetic is cheap (a quotient of 60 digits), a float for decimals."""
    return float(written) if "." in written else int(written)


def _unit(number: str) -> float:
    """Half the last written place of ``number``: how far a rounded result may lie from it (and
    a float's error)."""
    try:
        return 0.5 / 10 ** len(number.partition(".")[2]) + abs(float(number)) * 1e-12
    except (ValueError, OverflowError):
        return 0.5


def _expression(tokens: list[str], at: int, least: int = 1) -> tuple[float, int]:
    """The value of the expression at ``tokens[at:]`` whose operators bind at least ``least``
    (precedence climbing), and where it ends."""
    value, at = _power(tokens, at)
    while at < len(tokens) and _PRECEDENCE.get(tokens[at], 0) >= least:
        op = tokens[at]
        right, at = _expression(tokens, at + 1, _PRECEDENCE[op] + 1)
        value = _BINARY[op](value, right)
    return value, at


def _power(tokens: list[str], at: int) -> tuple[float, int]:
    """A number, a bracket, a negation or a percentage, raised to a small power."""
    token = tokens[at]
    if token == "(":
        value, at = _expression(tokens, at + 1)
        if tokens[at] != ")":
            raise ValueError("unclosed bracket")
        at += 1
    elif token == "-":
        value, at = _power(tokens, at + 1)
        return -value, at
    else:
        value, at = _number(token), at + 1
    if at < len(tokens) and tokens[at] == "%":
        value, at = value / 100, at + 1
    if at < len(tokens) and tokens[at] == "^":
        exponent, at = _power(tokens, at + 1)
        if exponent != int(exponent) or abs(exponent) > 64:
            raise ValueError("no such power computed")
        value = value ** int(exponent)
    return value, at
