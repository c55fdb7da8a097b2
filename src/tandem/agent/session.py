"""What one agent-loop session is given: its row, ids, phase, and the client it talks to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.agent.dataset import DatasetRow
from tandem.types import GenerateRequest, TokenOutput


class TokenClient(Protocol):
    """The only engine API a loop sees (the serving client, or a backend such as NativeRollout)."""

    async def generate(self, request: GenerateRequest) -> TokenOutput:
        """Continue request.prompt_ids; one logprob per token; extra_fields["global_steps"] set."""


@dataclass(frozen=True)
class Session:
    """One of the n sessions of a prompt. request_id is the same on every turn (sticky routing)."""

    row: DatasetRow
    session_id: int
    request_id: str
    validate: bool = False
    seed: int | None = None  # base sampling seed; turn t samples with seed + t (reproducible runs)

    def sampling_seed(self, turn: int) -> dict[str, int]:
        """{"seed": ...} for this session's turn, or {} when the session is unseeded."""
        return {} if self.seed is None else {"seed": (self.seed + turn) % (1 << 31)}
