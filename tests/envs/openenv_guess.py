"""Environments on OpenEnv's own classes (the `openenv` extra): its Environment base, Action /
Observation / State types, sync reset/step as OpenEnv servers write them. `GuessEnv` guesses a
number; `SumEnv` asks for a sum through the calculator call tiny:calculator learned (training)."""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from tandem.demo.tasks import calculator_schemas
from tandem.tools.calculator import CalculatorError, evaluate_expression


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    message: str = ""


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    """Guess the secret from 1 to 10: -0.1 per wrong guess with a hint, 1.0 when right."""

    def __init__(self, secret: int = 7) -> None:
        super().__init__()
        self.secret = secret
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message="Guess a number from 1 to 10.")

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:
        assert isinstance(action, GuessAction)
        self._state.step_count += 1
        if action.guess == self.secret:
            return GuessObservation(message="correct", done=True, reward=1.0)
        hint = "higher" if action.guess < self.secret else "lower"
        return GuessObservation(message=hint, reward=-0.1)

    @property
    def state(self) -> State:
        return self._state


class ExpressionAction(Action):
    expression: str


class SumObservation(Observation):
    result: str | None = None  # None at reset: the question is the row's own user message


class SumEnv(Environment[ExpressionAction, SumObservation, State]):
    """Half a point for a calculator call that runs, half for the sum of reset's a and b."""

    # the calculator tool exactly as tiny:calculator learned it (name, description, schema); the
    # call's arguments still become the ExpressionAction (from the generic parameters)
    action_name, action_description, action_schema = (
        calculator_schemas()[0]["function"][key] for key in ("name", "description", "parameters"))

    def __init__(self, max_steps: int = 2) -> None:
        super().__init__()
        self.max_steps, self.target = max_steps, 0
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, a: int = 2,
              b: int = 3, **kwargs: Any) -> SumObservation:
        self.target, self._state = a + b, State(episode_id=episode_id, step_count=0)
        return SumObservation()

    def step(self, action: ExpressionAction, timeout_s: float | None = None,
             **kwargs: Any) -> SumObservation:
        self._state.step_count += 1
        last = self._state.step_count >= self.max_steps
        try:
            result = evaluate_expression(action.expression)
        except CalculatorError as error:
            return SumObservation(result=f"error: {error}", done=last, reward=0.0)
        correct = result == self.target
        return SumObservation(result=str(result), done=correct or last, reward=0.5 + 0.5 * correct)

    @property
    def state(self) -> State:
        return self._state
