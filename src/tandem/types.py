"""Core records shared by every layer: what an engine returns and how sampling is asked for."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

STOP_REASONS = ("completed", "length", "aborted")


@dataclass
class TokenOutput:
    """Tokens one generate call produced, one logprob per token, and the weight version(s).

    extra_fields["global_steps"] is the weight version that produced the tokens; results that
    span a weight update (resumed requests) also carry "min_global_steps" / "max_global_steps".
    """

    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: str
    extra_fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason {self.stop_reason!r} not in {STOP_REASONS}")
        if self.log_probs is not None and len(self.log_probs) != len(self.token_ids):
            raise ValueError(f"{len(self.log_probs)} log_probs for {len(self.token_ids)} tokens; "
                             "a backend must return exactly one logprob per sampled token")

    @property
    def global_steps(self) -> int:
        """The weight version that produced these tokens (the last one, for resumed requests)."""
        return self.extra_fields["global_steps"]


@dataclass(frozen=True)
class SamplingParams:
    """The unified sampling dict, validated. Backends translate it into their own API.

    temperature 0 means greedy; top_k -1 and top_p 1 disable those filters; max_tokens is the
    token budget of this call; logprobs asks for one sampled-token logprob per token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    logprobs: bool = True
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> "SamplingParams":
        """Build from a sampling dict; unknown keys and out-of-range values raise ValueError."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling keys {unknown}; valid keys: {sorted(known)}")
        values = dict(params)
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(int(t) for t in values["stop_token_ids"] or ())
        if "logprobs" in values:
            values["logprobs"] = bool(values["logprobs"])
        return cls(**values)

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"sampling temperature={self.temperature}: must be a finite value >= 0 "
                             "(0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p={self.top_p}: must be in (0, 1]; 1 disables top-p")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling top_k={self.top_k}: use -1 to disable or a positive count")
        if not self.repetition_penalty > 0:
            raise ValueError(f"sampling repetition_penalty={self.repetition_penalty}: must be > 0 "
                             "(1.0 is off)")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"sampling max_tokens={self.max_tokens}: the token budget must be an "
                             "integer >= 1")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """The unified dict form (what crosses process boundaries)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}
