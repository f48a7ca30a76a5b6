"""The ``calculator`` tool: arithmetic over Python's ``ast``, never ``eval``.

Accepted: int and float literals, ``+ - * / // % **``, unary ``-`` / ``+`` and parentheses.
Anything else -- names, attribute access, calls, subscripts, comparisons, strings -- is
refused with a message naming it.  Work is bounded before it is done: the expression's
length, every exponent (|e| <= ``MAX_EXPONENT``) and the size of each power's result are
checked ahead of computing, and every intermediate result must stay below ``MAX_ABS``.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from core.environments.tools.base import Tool, ToolError

__all__ = ["CALCULATOR", "MAX_ABS", "MAX_EXPONENT", "MAX_EXPRESSION_CHARS", "calculate"]

MAX_EXPRESSION_CHARS = 256
MAX_EXPONENT = 64
#: Largest magnitude of any intermediate result (ints and floats alike).
MAX_ABS = 10**100
_MAX_BITS = MAX_ABS.bit_length()

Number = int | float

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> Number:
    """The value of ``expression``, or a :class:`ToolError` saying why there is none."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"invalid expression: {err.msg}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ToolError(f"only numbers are allowed, got {value!r}")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError(f"result larger than {MAX_ABS:.0e}") from None
    raise ToolError(f"{_describe(node)} is not allowed (numbers, + - * / // % ** and parentheses only)")


def _check_power(base: Number, exponent: Number) -> None:
    """Refuse a power before computing it when it would be huge (or complex)."""
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"exponent {exponent!r} is larger than {MAX_EXPONENT} in magnitude")
    if abs(base) > 1 and exponent > 0 and exponent * math.log2(abs(base)) > _MAX_BITS:
        raise ToolError(f"{base!r} ** {exponent!r} would be larger than {MAX_ABS:.0e}")
    if base < 0 and not float(exponent).is_integer():
        raise ToolError("a negative number to a fractional power is not a real number")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero (0 to a negative power)")


def _bounded(value: Any) -> Number:
    if isinstance(value, complex):  # unreachable after _check_power; a last guard
        raise ToolError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError(f"the result is {value!r}")
    if abs(value) >= MAX_ABS:
        raise ToolError(f"result larger than {MAX_ABS:.0e}")
    return value


def _describe(node: ast.AST) -> str:
    """``'a name (x)'`` -- what a refused node is, in words."""
    if isinstance(node, ast.Name):
        return f"a name ({node.id})"
    if isinstance(node, ast.Attribute):
        return f"attribute access (.{node.attr})"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"the operator {type(node.op).__name__}"
    return f"{type(node).__name__}"


def format_number(value: Number) -> str:
    """An int as is; a float with 12 significant digits (``0.1 + 0.2`` -> ``0.3``)."""
    return str(value) if isinstance(value, int) else format(value, ".12g")


def _calculator(arguments: dict[str, Any], state: dict[str, Any]) -> str:
    return format_number(calculate(arguments["expression"]))


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    fn=_calculator,
    required={"expression": str},
)
