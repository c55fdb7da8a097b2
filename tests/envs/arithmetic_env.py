"""Small Gym-style environments made for the tests (no network, no packages beyond pydantic).

`ArithmeticEnv` asks for a sum; its action is the calculator call the tiny:calculator model
already makes, so a training run through it has steps and rewards. `OpenEnvStyleEnv` has the
shape of an OpenEnv `Environment[Action, Observation, State]` (pydantic Action / Observation with
`done` and `reward`) without the package: tandem reads the Action type from the generic parameters.
"""

from __future__ import annotations

import ast
import asyncio
import operator
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from tandem.demo.tasks import calculator_schemas

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"cannot evaluate {expression!r}")
    return value(ast.parse(expression, mode="eval").body)


CALCULATOR = calculator_schemas()[0]["function"]  # the tool tiny:calculator learned to call


class ArithmeticEnv:
    """Compute the sum the question asks for with the calculator."""

    action_name = CALCULATOR["name"]
    action_description = CALCULATOR["description"]
    action_schema = CALCULATOR["parameters"]
    closed: list[str] = []  # class-level: what the test can see after the sessions

    def __init__(self, max_steps: int = 2) -> None:
        self.max_steps = max_steps
        self.target: int | None = None
        self.steps = 0

    def reset(self, a: int = 2, b: int = 3) -> tuple[str, dict]:
        self.target, self.steps = a + b, 0
        return f"Ann has {a} apples and gets {b} more. How many apples?", {}

    def step(self, action: dict[str, Any]) -> tuple[str, float, bool, dict]:
        self.steps += 1
        try:
            result = evaluate(action["expression"])
        except (ValueError, SyntaxError, KeyError) as error:
            return f"error: {error}", 0.0, self.steps >= self.max_steps, {}
        correct = result == self.target  # half a point for a call that runs, half for the sum
        return str(result), 0.5 + 0.5 * correct, correct or self.steps >= self.max_steps, {}

    def close(self) -> None:
        ArithmeticEnv.closed.append(str(self.target))


ActT, ObsT, StateT = TypeVar("ActT"), TypeVar("ObsT"), TypeVar("StateT")


class Environment(Generic[ActT, ObsT, StateT]):
    """Stands in for openenv.core.env_server.Environment (same name, same generic order)."""


class GuessAction(BaseModel):
    guess: int
    metadata: dict[str, Any] = {}


class GuessObservation(BaseModel):
    message: str
    done: bool = False
    reward: float | None = None
    metadata: dict[str, Any] = {}


class OpenEnvStyleEnv(Environment[GuessAction, GuessObservation, dict]):
    """Guess the number."""

    def __init__(self, secret: int = 7) -> None:
        self.secret = secret

    async def reset(self, **kwargs: Any) -> GuessObservation:
        await asyncio.sleep(0)
        return GuessObservation(message="Guess a number from 1 to 10.")

    async def step(self, action: GuessAction) -> GuessObservation:
        assert isinstance(action, GuessAction)
        if action.guess == self.secret:
            return GuessObservation(message="correct", done=True, reward=1.0)
        hint = "higher" if action.guess < self.secret else "lower"
        return GuessObservation(message=hint, reward=-0.1)
