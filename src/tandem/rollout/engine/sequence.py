"""One request inside the engine: its tokens, how many have KV in the cache, its block table."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from tandem.types import KeptSets, SamplingParams, append_version_run


PREFILLED = "prefilled"  # stop reason of a prefill-only sequence after its first token (kv_handoff.py)


class SequenceStatus(Enum):
    WAITING = "waiting"  # no KV blocks (new, or preempted for recompute)
    RUNNING = "running"  # holds KV blocks; scheduled every step until it finishes
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request's state. `token_ids` is prompt + generated; KV exists for the first
    `num_computed_tokens` of them in the blocks of `block_table`."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # the context limit: prompt + generated never exceeds it
    future: asyncio.Future | None = None
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    last_block_hash: int | None = None  # chain hash of block num_hashed_blocks - 1
    num_tokens_at_admission: int = 0  # tokens below this index count as prompt work
    status: SequenceStatus = SequenceStatus.WAITING
    log_probs: list[float] = field(default_factory=list)
    version_runs: list[list[int]] = field(default_factory=list)  # [[version, count]] per generated token
    kept_ids: list[torch.Tensor | None] = field(default_factory=list)  # per token, with return_kept_sets
    kept_tokens: int = 0  # with return_kept_sets: tokens, and the sums of their kept sets
    kept_log_mass_sum: float = 0.0  # log mass and mass under the tempered full distribution
    kept_mass_sum: float = 0.0
    generator: torch.Generator | None = None  # per-request seed
    prefill_only: bool = False  # stop after the first token, its blocks held (kv_handoff.py)
    images: Any = None  # vision.SequenceImages of a prompt with images
    aborted: bool = False
    stop_reason: str | None = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def block_key(self, index: int, size: int) -> tuple:
        """The prefix-cache key of block `index`: its tokens, an image token as its image's
        content digest and place (vision.py)."""
        tokens = self.token_ids[index * size:(index + 1) * size]
        return tuple(tokens) if self.images is None else self.images.key_tokens(tokens,
                                                                                index * size)

    def append(self, token_id: int, log_prob: float, version: int,
               kept_ids: torch.Tensor | None = None, log_mass: float | None = None) -> None:
        """Record a sampled token (and its kept set with its log mass, None: nothing removed)
        and decide whether the sequence stops here."""
        self.token_ids.append(token_id)
        self.log_probs.append(log_prob)
        if self.params.return_kept_sets:
            self.kept_ids.append(kept_ids)
            self.kept_tokens += 1
            self.kept_log_mass_sum += log_mass or 0.0
            self.kept_mass_sum += math.exp(log_mass or 0.0)
        append_version_run(self.version_runs, version)
        if token_id in self.params.stop_token_ids or (
                not self.params.ignore_eos and token_id in self.eos_token_ids):
            self.stop_reason = "completed"
        elif (self.num_generated >= self.params.max_tokens
              or self.num_tokens >= self.max_total_tokens):
            self.stop_reason = "length"
        elif self.prefill_only:
            self.stop_reason = PREFILLED

    def kept_sets(self) -> KeptSets | None:
        """The kept set of every generated token, when the request asked for them."""
        if not self.params.return_kept_sets:
            return None
        empty = torch.zeros(0, dtype=torch.int32)
        sets = [empty if ids is None else ids for ids in self.kept_ids]
        return KeptSets(torch.tensor([len(ids) for ids in sets], dtype=torch.int32),
                        torch.cat([empty, *sets]))
