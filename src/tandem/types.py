"""Core records shared by every layer: what an engine returns, how sampling is asked for, and
the patch a delta weight sync hands an engine to apply in place."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    import torch

STOP_REASONS = ("completed", "length", "aborted")
# Below this a temperature is greedy: logits / 1e-39 overflow to inf and sampling degenerates.
TEMPERATURE_FLOOR = 1e-5
MAX_TOP_K = (1 << 31) - 1  # no vocabulary is larger; the engine also checks its own vocab


@dataclass
class TokenOutput:
    """Tokens one generate call produced, one logprob per token, and extra_fields: "global_steps"
    (the weight version that produced them), "min_global_steps" / "max_global_steps" for results
    spanning a weight update, and "version_runs" (`version_runs`: every token's version)."""

    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: str
    extra_fields: dict[str, Any] = field(default_factory=dict)
    kept_sets: KeptSets | None = None  # with sampling return_kept_sets: each token's kept set

    def __post_init__(self) -> None:
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason {self.stop_reason!r} not in {STOP_REASONS}")
        if self.log_probs is not None and len(self.log_probs) != len(self.token_ids):
            raise ValueError(f"{len(self.log_probs)} log_probs for {len(self.token_ids)} tokens; "
                             "a backend must return exactly one logprob per sampled token")
        if self.kept_sets is not None and len(self.kept_sets) != len(self.token_ids):
            raise ValueError(f"{len(self.kept_sets)} kept sets for {len(self.token_ids)} tokens; "
                             "a backend must return exactly one kept set per sampled token")

    @property
    def global_steps(self) -> int:
        """The weight version that produced these tokens (the last one, for resumed requests)."""
        return self.extra_fields["global_steps"]

    @property
    def version_runs(self) -> list[list[int]]:
        """The weight version of every token, run-length encoded: [[version, count], ...] in token
        order, counts summing to len(token_ids); one run of global_steps when the backend gave none."""
        runs = self.extra_fields.get("version_runs")
        if runs is None:
            return [[int(self.global_steps), len(self.token_ids)]] if self.token_ids else []
        runs = [[int(version), int(count)] for version, count in runs]
        if sum(count for _, count in runs) != len(self.token_ids) or any(c <= 0 for _, c in runs):
            raise ValueError(f"version_runs {runs} do not cover the {len(self.token_ids)} tokens "
                             "exactly once; a backend must stamp every token with one version")
        return runs


# extra_fields of an output with kept sets (native engine): its sampled tokens, and the sums of
# their kept sets' log mass and mass under the tempered full distribution (summed across calls)
KEPT_MASS_FIELDS = ("kept_tokens", "kept_log_mass_sum", "kept_mass_sum")


@dataclass(frozen=True)
class KeptSets:
    """The token ids each sampled token was drawn from (what top-k / top-p kept), flat: `counts`
    [R] int32 and `ids` [sum counts] int32, each token's ids ascending. Count 0 means no set: the
    full distribution (a context token, a greedy token, or a filter that removed nothing). Costs 4
    bytes per kept id: top_k=20 is 84 bytes a token; a top_p-only set may reach the vocabulary."""

    counts: torch.Tensor
    ids: torch.Tensor

    def __post_init__(self) -> None:
        if self.counts.ndim != 1 or self.ids.ndim != 1 or int(self.counts.sum()) != self.ids.numel():
            raise ValueError(f"KeptSets: counts {tuple(self.counts.shape)} summing to "
                             f"{int(self.counts.sum())} for ids {tuple(self.ids.shape)}; the counts "
                             "must sum to the number of ids")

    def __len__(self) -> int:
        return self.counts.numel()

    @classmethod
    def none(cls, num_tokens: int) -> "KeptSets":
        """`num_tokens` tokens without a set (full distribution)."""
        import torch

        return cls(torch.zeros(num_tokens, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))

    @classmethod
    def join(cls, parts: "Sequence[KeptSets]") -> "KeptSets":
        """The sets of consecutive token runs, in order."""
        import torch

        return cls(torch.cat([torch.zeros(0, dtype=torch.int32), *(p.counts for p in parts)]),
                   torch.cat([torch.zeros(0, dtype=torch.int32), *(p.ids for p in parts)]))

    def head(self, num_tokens: int) -> "KeptSets":
        """The sets of the first `num_tokens` tokens."""
        counts = self.counts[:num_tokens]
        return KeptSets(counts.clone(), self.ids[:int(counts.sum())].clone())


def append_version_run(runs: list[list[int]], version: int, count: int = 1) -> None:
    """Add `count` tokens of `version` to run-length encoded versions, merging with the last run."""
    if count <= 0:
        return
    if runs and runs[-1][0] == version:
        runs[-1][1] += count
    else:
        runs.append([version, count])


def expand_version_runs(runs: list[list[int]]) -> list[int]:
    """[[version, count], ...] -> one version per token."""
    return [version for version, count in runs for _ in range(count)]


def cut_version_runs(runs: list[list[int]], num_tokens: int) -> list[list[int]]:
    """The runs of the first `num_tokens` tokens."""
    kept: list[list[int]] = []
    for version, count in runs:
        append_version_run(kept, version, min(count, num_tokens - sum(c for _, c in kept)))
    return kept


@dataclass(frozen=True)
class WeightPatch:
    """New values of one weight at some flat positions (weight_sync/delta.py, checked against the
    receiver's values there); `index` [k] int64, `values` [k] at the weight's dtype."""

    index: torch.Tensor
    values: torch.Tensor

    def apply_to(self, weight: torch.Tensor) -> None:
        """Write the values into `weight` in place (contiguous: view(-1) raises otherwise)."""
        weight.view(-1).index_copy_(0, self.index.to(weight.device), self.values.to(weight.device))


@dataclass(frozen=True)
class GenerateRequest:
    """One generate call, the record every layer passes on (client -> server -> backend): the
    caller's `request_id` (sticky routing), prompt ids and the unified `sampling` dict;
    `multi_modal_data` and `adapter` go to backends that take them, and one that does not refuses
    them (BaseRollout.check_request)."""

    request_id: str
    prompt_ids: list[int]
    sampling: Mapping[str, Any]
    multi_modal_data: Mapping[str, Any] | None = None
    adapter: str | None = None

    def replace(self, **changes: Any) -> "GenerateRequest":
        """A copy with some fields changed (a fresh backend id, a resumed prompt and budget)."""
        return dataclasses.replace(self, **changes)

    def checked_prompt(self, vocab_size: int, max_model_len: int) -> list[int]:
        """prompt_ids as a list of ints inside [0, vocab_size), shorter than the context; a
        ValueError naming the problem otherwise."""
        prompt = self.prompt_ids.tolist() if hasattr(self.prompt_ids, "tolist") else self.prompt_ids
        prompt = list(prompt)
        if not prompt:
            raise ValueError("prompt_ids is empty; a prompt needs at least one token")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt_ids must be a list of ints")
        prompt = [int(t) for t in prompt]
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt_ids must lie in [0, {vocab_size}); got min {min(prompt)}, "
                             f"max {max(prompt)}")
        if len(prompt) >= max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in the model's "
                             f"context of {max_model_len} tokens")
        return prompt


@dataclass(frozen=True)
class SamplingParams:
    """The unified sampling dict, validated (wrong types are rejected, never coerced); backends
    translate it into their own API. temperature 0 (or below TEMPERATURE_FLOOR) is greedy; top_k -1
    and top_p 1 disable those filters; max_tokens is this call's token budget."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    logprobs: bool = True
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_kept_sets: bool = False  # record each token's top-k / top-p kept set (native only)

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> "SamplingParams":
        """Build from a sampling dict; unknown keys, wrong types and out-of-range values raise
        ValueError naming the field."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling keys {unknown}; valid keys: {sorted(known)}")
        values = dict(params)
        if "stop_token_ids" in values:
            stop = values["stop_token_ids"] or ()
            if isinstance(stop, (str, bytes)) or not hasattr(stop, "__iter__"):
                raise ValueError(f"sampling stop_token_ids={stop!r}: must be a list of token ids")
            values["stop_token_ids"] = tuple(stop)
        return cls(**values)

    def __post_init__(self) -> None:
        # a wrong type is never coerced: "false" would be truthy, 2.5 would be cut to 2
        for name in ("temperature", "top_p", "repetition_penalty"):
            _set(self, name, _real(name, getattr(self, name)))
        for name in ("top_k", "max_tokens"):
            _set(self, name, _integer(name, getattr(self, name)))
        for name in ("logprobs", "ignore_eos", "return_kept_sets"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sampling {name}={getattr(self, name)!r}: must be true or false "
                                 f"(a boolean, not {type(getattr(self, name)).__name__})")
        if self.seed is not None:
            _set(self, "seed", _integer("seed", self.seed))
            if not 0 <= self.seed < 1 << 64:
                raise ValueError(f"sampling seed={self.seed}: must be in [0, 2**64)")
        _set(self, "stop_token_ids", tuple(_integer("stop_token_ids", t)
                                           for t in self.stop_token_ids))
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"sampling stop_token_ids={list(self.stop_token_ids)}: token ids are >= 0")
        if self.temperature < 0:
            raise ValueError(f"sampling temperature={self.temperature}: must be a finite value >= 0 "
                             "(0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p={self.top_p}: must be in (0, 1]; 1 disables top-p")
        if self.top_k == 0 or self.top_k < -1 or self.top_k > MAX_TOP_K:
            raise ValueError(f"sampling top_k={self.top_k}: use -1 to disable or a positive count "
                             "no larger than the vocabulary")
        if not self.repetition_penalty > 0:
            raise ValueError(f"sampling repetition_penalty={self.repetition_penalty}: must be > 0 "
                             "(1.0 is off)")
        if self.max_tokens < 1:
            raise ValueError(f"sampling max_tokens={self.max_tokens}: the token budget must be an "
                             "integer >= 1")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature 0, or below TEMPERATURE_FLOOR."""
        return self.temperature < TEMPERATURE_FLOOR

    def to_dict(self) -> dict[str, Any]:
        """The unified dict form (what crosses process boundaries)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def _set(params: SamplingParams, name: str, value: Any) -> None:
    object.__setattr__(params, name, value)  # the dataclass is frozen; normalise once, here


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"sampling {name}={value!r}: must be a number, not "
                         f"{type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"sampling {name}={value}: must be finite")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"sampling {name}={value!r}: must be an integer, not "
                         f"{type(value).__name__}")
    return int(value)
