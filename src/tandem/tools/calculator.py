"""A calculator tool: arithmetic expressions parsed with `ast` against a whitelist, never eval.

Integers stay exact; every intermediate integer is bounded (MAX_INT_BITS) and exponents and
round()'s digits are checked before they are computed, so `9**9**9` and `round(1, -10**9)` are
refused instead of hanging the host. Evaluation runs in a worker thread, off the event loop;
since every step is this small, the agent loop's per-call deadline holds. Whatever the
expression makes Python raise is an error result the model sees, never an exception.
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
from typing import Any, Callable

from tandem.tools.registry import ToolResult

MAX_EXPRESSION_CHARS = 500
MAX_DEPTH = 50
MAX_INT_BITS = 4096
MAX_EXPONENT = 10_000
MAX_ROUND_DIGITS = 1_300  # a MAX_INT_BITS integer has at most 1,234 decimal digits

BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message is for the model."""


def _round(value: Any, digits: Any = None) -> Any:
    # round(int, -N) builds 10**N first, holding the GIL for as long as that takes
    if isinstance(digits, int) and abs(digits) > MAX_ROUND_DIGITS:
        raise CalculatorError(f"ndigits {digits} is beyond +-{MAX_ROUND_DIGITS}")
    return round(value) if digits is None else round(value, digits)


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs, "round": _round, "min": min, "max": max, "sqrt": math.sqrt, "floor": math.floor,
    "ceil": math.ceil, "log": math.log, "log2": math.log2, "log10": math.log10, "exp": math.exp,
    "sin": math.sin, "cos": math.cos, "tan": math.tan}
CONSTANTS = {"pi": math.pi, "e": math.e}


def _check_size(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"intermediate result exceeds {MAX_INT_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number (overflow)")
    return value


def _power(base: Any, exponent: Any) -> Any:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is larger than {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if base.bit_length() * exponent > MAX_INT_BITS * 2:  # cheap upper bound before computing
            raise CalculatorError(f"intermediate result exceeds {MAX_INT_BITS} bits")
    try:
        result = base ** exponent
    except OverflowError:
        raise CalculatorError("result is too large (overflow)") from None
    except ZeroDivisionError:
        raise CalculatorError("zero cannot be raised to a negative power") from None
    if isinstance(result, complex):
        raise CalculatorError("result is a complex number")
    return result


def _evaluate(node: ast.AST, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"expression nests deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, depth + 1)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _check_size(node.value)
    if isinstance(node, ast.Name):
        if node.id not in CONSTANTS:
            raise CalculatorError(f"unknown name {node.id!r}; known constants: {sorted(CONSTANTS)}")
        return CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_evaluate(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and (type(node.op) in BINARY or isinstance(node.op, ast.Pow)):
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        try:
            return _check_size(BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result is too large (overflow)") from None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        if node.func.id not in FUNCTIONS:
            raise CalculatorError(f"unknown function {node.func.id!r}; "
                                  f"known functions: {sorted(FUNCTIONS)}")
        arguments = [_evaluate(argument, depth + 1) for argument in node.args]
        try:
            return _check_size(FUNCTIONS[node.func.id](*arguments))
        except (ValueError, TypeError, OverflowError, ZeroDivisionError) as error:
            raise CalculatorError(f"{node.func.id}: {error}") from None
    raise CalculatorError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % **, "
                          "parentheses, constants and the listed functions")


def evaluate_expression(expression: str) -> int | float:
    """Evaluate an arithmetic expression; CalculatorError for anything not allowed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        expression.encode("utf-8")
    except UnicodeEncodeError:
        raise CalculatorError("the expression is not valid text (it holds a lone UTF-16 "
                              "surrogate); write it with ASCII digits and operators") from None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"syntax error: {error.msg}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError(f"expression nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as error:  # e.g. a null byte, on Python versions that raise ValueError
        raise CalculatorError(f"syntax error: {error}") from None
    return _evaluate(tree)


def format_number(value: int | float) -> str:
    """Exact integers; floats with 12 significant digits (0.1 + 0.2 -> 0.3)."""
    if isinstance(value, int):
        return str(value)
    return format(value, ".12g")


class CalculatorTool:
    """The `calculator` tool: {"expression": "..."} -> the value as text."""

    name = "calculator"
    description = ("Evaluate an arithmetic expression with + - * / // % **, parentheses, pi, e "
                   "and the functions " + ", ".join(sorted(FUNCTIONS)) + ".")
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string",
                                                "description": "for example (3 + 4) * 2"}},
                  "required": ["expression"], "additionalProperties": False}

    async def execute(self, arguments: dict[str, Any], context: dict[str, Any]) -> ToolResult:
        """Evaluate arguments["expression"]; any failure of the evaluation is an error result."""
        try:
            value = await asyncio.to_thread(evaluate_expression, arguments["expression"])
            return ToolResult(format_number(value))
        except CalculatorError as error:
            return ToolResult(f"Error: {error}", ok=False)
        except Exception as error:  # a case the checks above missed is still the model's input
            return ToolResult(f"Error: the expression could not be evaluated "
                              f"({type(error).__name__}: {error})", ok=False)
