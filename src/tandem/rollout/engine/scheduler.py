"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step first continues the running sequences (oldest first: one decode token each, or the
next chunk of an unfinished prompt), then admits waiting ones while the token budget
(`max_num_batched_tokens`), the sequence budget (`max_num_seqs`) and free KV blocks allow. When
a running sequence needs a block and none is free, the newest running sequence is preempted:
its blocks are released and it waits to be recomputed (its full blocks usually stay cached).

With `batch_invariant` (trainer.deterministic) a sequence's work never depends on its neighbours:
prompts are cut into chunks of `max_num_batched_tokens` counted from token 0 (a chunk that does
not fit this step waits for the next), and admission reserves the blocks for the whole
sequence (prompt + max_tokens), so nothing is ever preempted and recomputed in other shapes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tandem.rollout.engine.block_manager import BlockManager
from tandem.rollout.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: tokens [start, start + num_new) are computed; the step
    samples its next token when those reach the end of the sequence."""

    seq: Sequence
    start: int
    num_new: int

    @property
    def samples(self) -> bool:
        return self.start + self.num_new == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, batch_invariant: bool = False) -> None:
        self.block_manager = block_manager
        self.batch_invariant = batch_invariant
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prompt_tokens_cached = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledSequence]:
        blocks = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        queue = deque(self.running)
        kept: list[Sequence] = []
        preempted = False
        while queue and budget > 0:
            seq = queue.popleft()
            num_new = self._chunk(seq, seq.num_computed_tokens, budget)
            if num_new == 0:  # batch-invariant: its whole chunk waits for a step with room
                kept.append(seq)
                continue
            while not blocks.allocate(seq, seq.num_computed_tokens + num_new):
                preempted = True
                if queue:
                    self.preempt(queue.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                kept.append(seq)
                scheduled.append(self._take(seq, num_new))
                budget -= num_new
        kept.extend(queue)  # running sequences left without budget this step
        self.running = kept
        while (self.waiting and not preempted and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            prefix = blocks.find_prefix(seq)
            cached = len(prefix) * blocks.block_size
            num_new = self._chunk(seq, cached, budget)
            reserve = self._full_length(seq) if self.batch_invariant else cached + num_new
            if num_new == 0 or not blocks.can_admit(seq, prefix, reserve):
                break
            self.waiting.popleft()
            blocks.share_prefix(seq, prefix)
            blocks.allocate(seq, reserve)
            seq.status = SequenceStatus.RUNNING
            seq.num_tokens_at_admission = seq.num_tokens
            self.prompt_tokens_cached += cached
            self.running.append(seq)
            scheduled.append(self._take(seq, num_new))
            budget -= num_new
        return scheduled

    def _chunk(self, seq: Sequence, computed: int, budget: int) -> int:
        """Tokens of seq to compute this step from `computed` on; batch-invariant: the whole
        fixed-boundary chunk or 0 (wait), else as many as the budget allows."""
        left = seq.num_tokens - computed
        if not self.batch_invariant:
            return min(left, budget)
        chunk = min(left, self.max_num_batched_tokens - computed % self.max_num_batched_tokens)
        return chunk if chunk <= budget else 0

    @staticmethod
    def _full_length(seq: Sequence) -> int:
        """The most tokens seq can reach: prompt + max_tokens within the context limit."""
        return min(seq.num_prompt_tokens + seq.params.max_tokens, seq.max_total_tokens)

    def _take(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        item = ScheduledSequence(seq, seq.num_computed_tokens, num_new)
        self.block_manager.register_full_blocks(seq, seq.num_computed_tokens + num_new)
        return item

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and put it first in line; it is recomputed from its tokens."""
        self.block_manager.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def preempt_all(self) -> None:
        for seq in reversed(self.running):
            self.preempt(seq)
        self.running = []

    def finish(self, seq: Sequence) -> None:
        """Remove seq from the queues and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
