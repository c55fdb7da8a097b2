"""The growing response of one session: tokens, mask, logprobs, weight versions and kept sets ->
Trajectory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from tandem.batch.trajectory import CONTEXT_VERSION, Trajectory
from tandem.types import KEPT_MASS_FIELDS, KeptSets, TokenOutput, expand_version_runs


@dataclass
class ResponseBuilder:
    """Appends policy tokens (mask 1, sampled logprob, the weight version that sampled it) and
    context tokens (mask 0, logprob 0.0, version -1, no kept set). With expect_log_probs a missing
    logprob is an error; without, policy tokens get 0.0 too (nothing may read rollout_log_probs
    then). Kept sets go to the trajectory when any generate call returned them."""

    prompt_ids: list[int]
    expect_log_probs: bool = True
    token_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token; -1 on context tokens
    min_version: int | None = None
    max_version: int | None = None
    kept_sets: list[KeptSets] = field(default_factory=list)  # per call / context run, in order
    has_kept_sets: bool = False
    kept_mass: dict[str, float] = field(default_factory=dict)  # KEPT_MASS_FIELDS, summed

    def __len__(self) -> int:
        return len(self.token_ids)

    def add_model_output(self, output: TokenOutput, max_tokens: int) -> None:
        """Append the tokens of one generate call and record its weight versions."""
        if len(output.token_ids) > max_tokens:
            raise ValueError(f"the client returned {len(output.token_ids)} tokens for max_tokens="
                             f"{max_tokens}; a backend must respect the token budget")
        if "global_steps" not in output.extra_fields:
            raise ValueError("TokenOutput.extra_fields has no 'global_steps'; every backend must "
                             "stamp the weight version that produced the tokens")
        if output.log_probs is None and self.expect_log_probs:
            raise ValueError("the client returned no log_probs although the sampling dict asked "
                             "for them (rollout.calculate_log_probs=true)")
        steps = int(output.extra_fields["global_steps"])
        low = int(output.extra_fields.get("min_global_steps", steps))
        high = int(output.extra_fields.get("max_global_steps", steps))
        self.min_version = low if self.min_version is None else min(self.min_version, low)
        self.max_version = high if self.max_version is None else max(self.max_version, high)
        self.versions.extend(expand_version_runs(output.version_runs))
        self.token_ids.extend(int(token) for token in output.token_ids)
        self.response_mask.extend([1] * len(output.token_ids))
        self.has_kept_sets |= output.kept_sets is not None
        if KEPT_MASS_FIELDS[0] in output.extra_fields:
            for key in KEPT_MASS_FIELDS:
                self.kept_mass[key] = self.kept_mass.get(key, 0.0) + output.extra_fields[key]
        self.kept_sets.append(output.kept_sets or KeptSets.none(len(output.token_ids)))
        if output.log_probs is None or not self.expect_log_probs:
            self.log_probs.extend([0.0] * len(output.token_ids))
        else:
            self.log_probs.extend(float(value) for value in output.log_probs)

    def add_context_tokens(self, token_ids: Sequence[int]) -> None:
        """Append tokens the policy did not sample (tool output, template boundaries)."""
        self.token_ids.extend(int(token) for token in token_ids)
        self.response_mask.extend([0] * len(token_ids))
        self.log_probs.extend([0.0] * len(token_ids))
        self.versions.extend([CONTEXT_VERSION] * len(token_ids))
        self.kept_sets.append(KeptSets.none(len(token_ids)))

    def to_trajectory(self, uid: str, session_id: int, num_turns: int, stop_reason: str,
                      data_source: str = "", ground_truth: Any = None,
                      metadata: dict[str, Any] | None = None, images: Any = None
                      ) -> Trajectory:
        """The finished session as unpadded tensors (ids/mask/versions int64, logprobs float32)."""
        if self.min_version is None or self.max_version is None:
            raise ValueError("a trajectory needs at least one generate call to know its weight "
                             "version")
        return Trajectory(
            prompts=torch.tensor(self.prompt_ids, dtype=torch.long),
            responses=torch.tensor(self.token_ids, dtype=torch.long),
            response_mask=torch.tensor(self.response_mask, dtype=torch.long),
            rollout_log_probs=torch.tensor(self.log_probs, dtype=torch.float32),
            min_global_steps=self.min_version, max_global_steps=self.max_version,
            response_versions=torch.tensor(self.versions, dtype=torch.long), uid=uid,
            session_id=session_id, num_turns=num_turns, stop_reason=stop_reason,
            data_source=data_source, ground_truth=ground_truth,
            metadata={**(metadata or {}), **self.kept_mass},
            kept_sets=KeptSets.join(self.kept_sets) if self.has_kept_sets else None,
            images=images)
