"""Rewards from served models: a reward model's scalar of the whole trajectory and an LLM
judge's parsed verdict. Each is a batched reward function `await fn(trajectories) ->
[RewardResult]`; a sample that cannot be scored gets reward_extra["reward_failed"] = 1 (and a
judge's bad verdict "judge_bad_verdict" = 1) while the others keep their scores.

The clients are duck-typed (serving/ sits above rewards/): a reward-model client has `await
score(request_id, sequences) -> [float | None]`, a judge client `await generate(GenerateRequest)
-> TokenOutput`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Sequence

from tandem.rewards.registry import RewardResult
from tandem.rewards.verdict import judge_prompt, last_user_text, parse_verdict
from tandem.types import GenerateRequest

if TYPE_CHECKING:
    from tandem.batch.trajectory import Trajectory

logger = logging.getLogger(__name__)
FAILED = "reward_failed"  # the scorer's marker (scorer.FAILED)
BAD_VERDICT = "judge_bad_verdict"


def failed(**extra: float) -> RewardResult:
    """The result of a sample that could not be scored."""
    return RewardResult(0.0, {FAILED: 1.0, **extra})


def same_tokenizer(policy: Any, other: Any) -> bool:
    """Whether two HF tokenizers map text to the same ids (same vocabulary and specials)."""
    return (policy.get_vocab() == other.get_vocab()
            and policy.all_special_tokens == other.all_special_tokens)


def chat_ids(tokenizer: Any, messages: list[Any], add_generation_prompt: bool = False) -> list[int]:
    """A chat rendered with the tokenizer's chat template, then tokenized (specials as written)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


class RewardModelReward:
    """Scores each whole trajectory with the served reward model: its own token ids (prompt,
    replies and tool turns) when the tokenizers match, else the chat re-rendered with the reward
    model's chat template."""

    name = "reward_model"

    def __init__(self, client: Any, reward_tokenizer: Any | None = None) -> None:
        """reward_tokenizer: None when it matches the policy's (token ids go in as they are)."""
        self.client = client
        self.reward_tokenizer = reward_tokenizer

    def sequence(self, trajectory: "Trajectory") -> list[int]:
        """The token ids the reward model scores for one trajectory."""
        if self.reward_tokenizer is None:
            return [int(t) for t in trajectory.input_ids.tolist()]
        return chat_ids(self.reward_tokenizer, trajectory.metadata.get("messages") or [])

    async def __call__(self, trajectories: Sequence["Trajectory"]) -> list[RewardResult]:
        try:
            sequences = [self.sequence(t) for t in trajectories]
            scores = await self.client.score(trajectories[0].uid, sequences)
        except Exception as error:  # no server left, or a broken call: these samples fail
            logger.warning("reward model failed for %d samples: %s: %s", len(trajectories),
                           type(error).__name__, error)
            return [failed() for _ in trajectories]
        return [failed() if score is None else RewardResult(float(score))
                for score in scores]


class JudgeReward:
    """Asks the served judge about each reply (greedy, max_new_tokens) and parses its verdict."""

    name = "judge"

    def __init__(self, client: Any, tokenizer: Any, template: str, pattern: str,
                 scale: float = 1.0, max_new_tokens: int = 16, prompt_length: int = 1024) -> None:
        self.client, self.tokenizer = client, tokenizer
        self.template, self.pattern, self.scale = template, pattern, scale
        self.max_new_tokens, self.prompt_length = max_new_tokens, prompt_length

    def prompt_ids(self, trajectory: "Trajectory") -> list[int]:
        """The judge's prompt for one trajectory, rendered with the judge's chat template."""
        row = trajectory.metadata.get("row")
        question = last_user_text(list(row.messages) if row is not None else
                                  trajectory.metadata.get("messages") or [])
        text = judge_prompt(self.template, question, trajectory.metadata.get("response_text", ""))
        return chat_ids(self.tokenizer, [{"role": "user", "content": text}], True)

    async def judge_one(self, trajectory: "Trajectory") -> RewardResult:
        """The score of one trajectory, or a failed result (bad verdict, too long, no server)."""
        try:
            ids = self.prompt_ids(trajectory)
            if len(ids) > self.prompt_length:
                return failed(judge_prompt_too_long=1.0)
            output = await self.client.generate(GenerateRequest(
                f"judge-{trajectory.uid}-{trajectory.session_id}", ids,
                {"temperature": 0.0, "max_tokens": self.max_new_tokens, "logprobs": False,
                 "stop_token_ids": [self.tokenizer.eos_token_id]}))
        except Exception as error:
            logger.warning("judge failed for %s/%s: %s: %s", trajectory.uid,
                           trajectory.session_id, type(error).__name__, error)
            return failed()
        verdict = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        score = parse_verdict(verdict, self.pattern, self.scale)
        if score is None:
            logger.warning("judge verdict for %s/%s matches no %r: %r", trajectory.uid,
                           trajectory.session_id, self.pattern, verdict[:200])
            return failed(**{BAD_VERDICT: 1.0})
        return RewardResult(score)

    async def __call__(self, trajectories: Sequence["Trajectory"]) -> list[RewardResult]:
        return list(await asyncio.gather(*(self.judge_one(t) for t in trajectories)))
