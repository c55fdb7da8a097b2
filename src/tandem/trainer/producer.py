"""The async modes' producer: submits prompt groups fire-and-forget, in dataset order, as the
rollout buffer frees slots and (on_stale=wait) the staleness bound admits them; regenerated rows
go first. A group that fails is counted and its
slot freed: one bad prompt never stops the run. At most as many groups generate at once as
rollout.agent_concurrency has room for, so a large buffer never turns into a pile of waiting
tasks (nor a loop that spins creating them). With algorithm.filter_groups a finished group is
scored here and, when its metric has zero variance, dropped: its slot and its place in the
staleness schedule are freed, it is never taken nor counted as trained, and more prompts follow."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections import deque
from typing import TYPE_CHECKING

from tandem.agent.dataset import DatasetRow
from tandem.trainer.dynamic_sampling import GroupFilter, NoGroupKept, filter_metrics
from tandem.trainer.rollout_buffer import RolloutBuffer, RolloutGroup

if TYPE_CHECKING:
    from tandem.trainer.rl_trainer import RLTrainer

logger = logging.getLogger(__name__)


class RolloutProducer:
    """Feeds `buffer` from trainer.train_rows(k), k = trainer.next_prompt_batch(), ...: the
    prompt-batch cursor is the trainer's, checkpointed with each step, so a resumed run draws on
    after the last batch drawn (groups generating or buffered at the checkpoint are not redone,
    as a dataloader's prefetched rows are not)."""

    def __init__(self, trainer: "RLTrainer", buffer: RolloutBuffer) -> None:
        self.trainer = trainer
        self.buffer = buffer
        self._regenerate: deque[tuple[DatasetRow, int]] = deque()
        self._regenerations = 0
        self._loop_task: asyncio.Task | None = None
        self._groups: set[asyncio.Task] = set()
        rollout = trainer.config.rollout
        # groups that can have a session running; more would only wait on the runner's semaphore
        self.max_generating = max(1, -(-rollout.agent_concurrency // max(rollout.n, 1)))
        self._generating = asyncio.Semaphore(self.max_generating)
        groups = trainer.config.algorithm.filter_groups
        self.group_filter = GroupFilter(groups.metric) if groups.enable else None
        # zero-variance groups in a row past which no step could fill within max_gen_batches
        self.max_filtered_in_a_row = groups.max_gen_batches * trainer.config.data.train_batch_size
        self._filtered_in_a_row = 0
        self._reported = (0, trainer.prompt_batch)  # (filtered, drawn) at the last filter_metrics

    def filter_metrics(self, groups_kept: int) -> dict[str, float]:
        """filter/* for the step that trained `groups_kept` groups: groups dropped and prompt
        batches drawn since the last call; {} without algorithm.filter_groups."""
        if self.group_filter is None:
            return {}
        filtered, drawn = self.buffer.counts["filtered"], self.trainer.prompt_batch
        metrics = filter_metrics(groups_kept, filtered - self._reported[0], drawn - self._reported[1])
        self._reported = (filtered, drawn)
        return metrics

    def start(self) -> None:
        """Begin submitting in the background."""
        self._loop_task = asyncio.create_task(self._submit_forever(), name="rollout-producer")

    def resubmit(self, group: RolloutGroup) -> None:
        """Generate a stale group's prompt again (fresh uid, so it never merges with the old one)."""
        self._regenerations += 1
        row = dataclasses.replace(group.row, uid=f"{group.row.uid}-regen{self._regenerations}")
        self._regenerate.append((row, self.trainer.config.trainer.seed + self._regenerations))

    async def stop(self) -> None:
        """Cancel submission and every group still generating (their slots are freed)."""
        tasks = [t for t in (self._loop_task, *self._groups) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _submit_forever(self) -> None:
        pending: deque[tuple[DatasetRow, int]] = deque()
        while True:
            if not pending:
                index = self.trainer.next_prompt_batch()
                rows = self.trainer.train_rows(index)
                pending.extend(zip(rows, self.trainer.seeds(index, len(rows), validate=False)))
            await self._generating.acquire()
            try:
                head = await self.buffer.reserve()  # waits for room and for the staleness bound
            except asyncio.CancelledError:
                self._generating.release()
                raise
            row, seed = self._regenerate.popleft() if self._regenerate else pending.popleft()
            task = asyncio.create_task(self._run_group(row, seed, head))
            self._groups.add(task)
            task.add_done_callback(functools.partial(self._group_done, head))

    def _group_done(self, head: int, task: asyncio.Task) -> None:
        # here, not in _run_group: a task cancelled before it ever ran holds its slots too
        self._groups.discard(task)
        self._generating.release()
        if task.cancelled():
            self.buffer.cancel(head)

    async def _run_group(self, row: DatasetRow, seed: int, head: int) -> None:
        try:
            trajectories = await self.trainer.runner.run_prompt(row, seed=seed)
        except Exception:  # one prompt's failure is that prompt's, never the run's
            logger.exception("prompt %s failed; its group is skipped", row.uid)
            self.buffer.cancel(head, outcome="failed")
            return
        if self.group_filter is not None and not await self._has_signal(trajectories, head):
            return
        self._filtered_in_a_row = 0
        self.buffer.put(RolloutGroup(row, trajectories, head))

    async def _has_signal(self, trajectories: list, head: int) -> bool:
        """Score the group and keep it when its metric varies; a dropped group frees its slot. A
        scoring error, or a budget spent on zero-variance groups, stops the run (buffer.fail)."""
        try:
            await self.trainer.compute_rewards(trajectories)
            kept, _ = self.group_filter.split(trajectories)
        except Exception as error:
            self.buffer.cancel(head, outcome="failed")
            self.buffer.fail(error)
            return False
        if kept:
            return True
        self.buffer.cancel(head, outcome="filtered")
        self._filtered_in_a_row += 1
        if self._filtered_in_a_row == self.max_filtered_in_a_row:
            self.buffer.fail(NoGroupKept(
                f"dynamic sampling dropped {self._filtered_in_a_row} groups in a row (zero variance "
                f"in {self.group_filter.metric}), the budget of algorithm.filter_groups."
                "max_gen_batches x data.train_batch_size; the async modes train whole batches "
                "only, so the run stops: raise max_gen_batches, or train on prompts the policy "
                "neither always nor never solves"))
        return False
