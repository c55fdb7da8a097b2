"""algorithm.filter_groups, dynamic sampling (DAPO; docs/algorithms.md): a prompt group whose
metric has zero variance trains nothing, so it is dropped and more prompts are generated. The
sync mode draws whole extra prompt batches here (`fill_batch`); the async modes' producer drops
such a group before it reaches the rollout buffer (trainer/producer.py)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from tandem import algorithms
from tandem.agent.runner import AllSessionsFailed
from tandem.batch.trajectory import Trajectory
from tandem.rewards.scorer import FAILED, as_number

if TYPE_CHECKING:
    from tandem.trainer.rl_trainer import RLTrainer

logger = logging.getLogger(__name__)


class NoGroupKept(RuntimeError):
    """Every group a step generated had zero variance: nothing to train on."""


class GroupFilter:
    """Keeps the groups (trajectories sharing a uid) whose `metric` varies: reward (the scalar
    score) or a detail the reward function returns (e.g. acc)."""

    def __init__(self, metric: str) -> None:
        self.metric = metric

    def value(self, trajectory: Trajectory) -> float:
        """The trajectory's metric (a scored trajectory; a failed score counts as 0, as its reward)."""
        if self.metric == "reward":
            if trajectory.reward is None:
                raise RuntimeError(f"trajectory {trajectory.uid}/{trajectory.session_id} reached "
                                   "the group filter unscored")
            return float(trajectory.reward)
        extra = trajectory.reward_extra
        if self.metric in extra:
            number = as_number(extra[self.metric])
            if number is None or not math.isfinite(number):
                raise ValueError(f"algorithm.filter_groups.metric: is {self.metric!r}, but the "
                                 f"reward gave sample {trajectory.uid}/{trajectory.session_id} "
                                 f"{self.metric}={extra[self.metric]!r}, no finite number; set "
                                 "it to reward or to a numeric detail")
            return number
        if extra.get(FAILED):
            return 0.0
        raise ValueError(f"algorithm.filter_groups.metric: is {self.metric!r}, but the reward gave "
                         f"sample {trajectory.uid}/{trajectory.session_id} no such detail (it gave "
                         f"{sorted(extra)}); set it to reward or to one of those")

    def split(self, trajectories: list[Trajectory]) -> tuple[list[list[Trajectory]], int]:
        """(the groups kept, in order of first appearance; how many groups were dropped)."""
        groups: dict[str, list[Trajectory]] = {}
        for trajectory in trajectories:
            groups.setdefault(trajectory.uid, []).append(trajectory)
        keep = algorithms.groups_with_signal([self.value(t) for t in trajectories],
                                             [t.uid for t in trajectories])
        return [g for uid, g in groups.items() if uid in keep], len(groups) - len(keep)


def filter_metrics(kept: int, dropped: int, gen_batches: int) -> dict[str, float]:
    """A step's filter/* record: groups trained, groups dropped, prompt batches drawn."""
    return {"filter/groups_kept": float(kept), "filter/groups_dropped": float(dropped),
            "filter/gen_batches": float(gen_batches)}


async def fill_batch(trainer: "RLTrainer") -> tuple[list[Trajectory], dict[str, float]]:
    """trainer_mode=sync: generate and score prompt batches (trainer.next_prompt_batch()) until
    data.train_batch_size groups with signal are kept or max_gen_batches batches were drawn;
    returns (the trajectories of at most train_batch_size kept groups, filter metrics). Too few
    kept: a warning, and the step trains on those; none: NoGroupKept (the step is skipped), or
    AllSessionsFailed when every batch's sessions all failed."""
    config = trainer.config.algorithm.filter_groups
    size = trainer.config.data.train_batch_size
    group_filter = GroupFilter(config.metric)
    kept: list[list[Trajectory]] = []
    dropped = batches = 0
    failure: AllSessionsFailed | None = None
    while len(kept) < size and batches < config.max_gen_batches:
        index = trainer.next_prompt_batch()
        batches += 1
        try:
            trajectories = await trainer.generate(trainer.train_rows(index), index)
        except AllSessionsFailed as error:  # this batch adds nothing; the next may
            failure = error
            continue
        await trainer.compute_rewards(trajectories)
        groups, batch_dropped = group_filter.split(trajectories)
        kept += groups
        dropped += batch_dropped
    kept = kept[:size]  # a last batch's surplus is not trained (as in verl)
    if not kept:
        if failure is not None and not dropped:
            raise failure
        raise NoGroupKept(f"dynamic sampling kept no group: all {dropped} groups of {batches} "
                          f"prompt batch(es) had zero variance in {config.metric} "
                          "(algorithm.filter_groups)")
    if len(kept) < size:
        logger.warning("step %d: dynamic sampling kept %d of %d groups after %d prompt batches "
                       "(algorithm.filter_groups.max_gen_batches); training on those",
                       trainer.step + 1, len(kept), size, batches)
    return [t for group in kept for t in group], filter_metrics(len(kept), dropped, batches)
