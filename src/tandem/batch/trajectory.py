"""One finished agent-loop session as unpadded per-trajectory tensors (DESIGN §1, seed §7.1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.multimodal import ImageInputs
from tandem.types import KeptSets

CONTEXT_VERSION = -1  # response_versions of tokens the policy did not sample (response_mask 0)


@dataclass
class Trajectory:
    """prompts [P], responses [R], input_ids [P+R], position_ids [P+R], response_mask [R],
    loss_mask [R], rollout_log_probs [R] (0.0 where response_mask is 0), and bookkeeping.

    response_mask is 1 exactly where the policy sampled the token; tool observations and chat
    template boundary tokens are 0. response_versions [R] int64 is the weight version that
    sampled each token (CONTEXT_VERSION = -1 where response_mask is 0); min/max_global_steps
    bound the versions of every generate call and contain every policy token's version. Built
    without response_versions, every policy token gets min_global_steps (the oldest bound).
    kept_sets (optional, with sampling-mask replay): the top-k / top-p set each response token was
    sampled from; none where response_mask is 0.
    """

    prompts: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    min_global_steps: int
    max_global_steps: int
    response_versions: torch.Tensor | None = None
    uid: str = ""  # the prompt's uid: GRPO groups trajectories by it
    session_id: int = 0
    num_turns: int = 0
    stop_reason: str = "completed"
    reward: float | None = None  # scalar outcome reward, set by the reward function
    reward_extra: dict[str, Any] = field(default_factory=dict)
    data_source: str = ""
    ground_truth: Any = None
    is_padding: bool = False
    # Per-session details from the agent loop (response_text, messages, extra_info, turn and
    # tool-call counts); see docs/agent_loops.md. Not batched as tensors.
    metadata: dict[str, Any] = field(default_factory=dict)
    kept_sets: KeptSets | None = None
    # a vision-language prompt's images as the model takes them (pixel values, grids): the
    # training forward runs the vision tower on them (training/vision_inputs.py)
    images: ImageInputs | None = None

    def __post_init__(self) -> None:
        length = self.responses.shape[0]
        if not (self.response_mask.shape[0] == self.rollout_log_probs.shape[0] == length):
            raise ValueError(f"trajectory {self.uid}/{self.session_id}: responses {length}, "
                             f"response_mask {self.response_mask.shape[0]}, rollout_log_probs "
                             f"{self.rollout_log_probs.shape[0]} must all have the same length")
        self.response_versions = self._checked_versions()
        if self.kept_sets is not None and (
                len(self.kept_sets) != length
                or bool((self.kept_sets.counts[~self.response_mask.bool()] != 0).any())):
            raise ValueError(f"trajectory {self.uid}/{self.session_id}: kept_sets must have one "
                             f"entry per response token ({length}) and none where response_mask "
                             "is 0")
        if self.prompts.ndim != 1 or self.prompts.shape[0] == 0:
            raise ValueError("trajectory prompts must be a non-empty 1-D tensor")

    def _checked_versions(self) -> torch.Tensor:
        policy = self.response_mask.bool()
        if self.response_versions is None:
            return torch.where(policy, self.min_global_steps, CONTEXT_VERSION).long()
        versions = self.response_versions.long()
        name = f"trajectory {self.uid}/{self.session_id}"
        if versions.shape != self.responses.shape:
            raise ValueError(f"{name}: response_versions {tuple(versions.shape)} must match "
                             f"responses {tuple(self.responses.shape)}")
        if bool((versions[~policy] != CONTEXT_VERSION).any()):
            raise ValueError(f"{name}: response_versions must be {CONTEXT_VERSION} where "
                             "response_mask is 0 (no policy version produced those tokens)")
        inside = (versions[policy] >= self.min_global_steps) & (versions[policy] <= self.max_global_steps)
        if not bool(inside.all()):
            raise ValueError(f"{name}: response_versions {sorted(set(versions[policy].tolist()))} "
                             f"fall outside min/max_global_steps [{self.min_global_steps}, "
                             f"{self.max_global_steps}]")
        return versions

    @property
    def input_ids(self) -> torch.Tensor:
        """prompts followed by responses: [P+R]."""
        return torch.cat([self.prompts, self.responses])

    @property
    def position_ids(self) -> torch.Tensor:
        """0..P+R-1 (text-only models)."""
        return torch.arange(self.prompts.shape[0] + self.responses.shape[0])

    @property
    def loss_mask(self) -> torch.Tensor:
        """The tokens the policy loss sees: a copy of response_mask."""
        return self.response_mask.clone()


def continued_later(trajectory: Trajectory) -> bool:
    """Whether a later sample of the same session continues this one (an openai_agent session
    that split): such a sample is not scored alone, it takes its session's reward."""
    return trajectory.metadata.get("continued_by") is not None


def share_split_rewards(trajectories: list[Trajectory]) -> None:
    """Give every sample a split session left behind the reward (and details) of the sample
    that ends its conversation, found through metadata["continued_by"] (docs/agent_loops.md)."""
    by_id = {t.metadata["sample_id"]: t for t in trajectories if "sample_id" in t.metadata}
    for trajectory in trajectories:
        last, seen = trajectory, set()
        while continued_later(last) and last.metadata["continued_by"] in by_id:
            if last.metadata["continued_by"] in seen:
                break
            seen.add(last.metadata["continued_by"])
            last = by_id[last.metadata["continued_by"]]
        if last is not trajectory:
            trajectory.reward, trajectory.reward_extra = last.reward, dict(last.reward_extra)
