"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step first continues the running sequences (oldest first: one decode token each, or the
next chunk of an unfinished prompt), then admits waiting ones while the token budget
(`max_num_batched_tokens`), the sequence budget (`max_num_seqs`) and free KV blocks allow. When
a running sequence needs a block and none is free, the newest running sequence is preempted:
its blocks are released and it waits to be recomputed (its full blocks usually stay cached).

Admission follows the KV cache (`Admission`, rollout.admission=kv, the native default): a waiting
sequence is admitted only while the running ones and it, each growing a token a step up to its
prompt + max_tokens and freeing its blocks when it ends there, never hold more blocks at once
than the engine's (the projected peak; times an overcommit that learns how much of that worst
case finished sequences used, since early stops leave room, and halves on a preemption). So the
engine stops admitting before preemption would start instead of preempting and recomputing.

With `batch_invariant` (trainer.deterministic) a sequence's work never depends on its neighbours:
prompts are cut into chunks of `max_num_batched_tokens` counted from token 0 (a chunk that does
not fit this step waits for the next), and admission reserves the blocks for the whole
sequence (prompt + max_tokens), so nothing is ever preempted and recomputed in other shapes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

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


class Admission:
    """How far admission may overcommit the KV cache against every running sequence's worst
    case: 1 / (the share of its worst case a finished sequence used, averaged), within
    [1, MAX_OVERCOMMIT], scaled down by half at each preemption and recovering per step."""

    MAX_OVERCOMMIT = 4.0
    USED_AVERAGE = 0.1  # weight of each finished sequence in the running average of its use
    RECOVERY = 0.05  # per step without a preemption, back towards no damping

    def __init__(self) -> None:
        self.used = 1.0  # finished sequences' blocks / their worst case (1: assume all)
        self.damping = 1.0

    @property
    def overcommit(self) -> float:
        return min(self.MAX_OVERCOMMIT, max(1.0, self.damping / max(self.used, 1e-3)))

    def finished(self, tokens: int, worst_tokens: int) -> None:
        """A sequence ended at `tokens` of its worst case's `worst_tokens`."""
        share = min(1.0, tokens / max(1, worst_tokens))
        self.used += self.USED_AVERAGE * (share - self.used)

    def stepped(self, preempted: bool) -> None:
        self.damping = 0.5 * self.damping if preempted else min(1.0,
                                                                 self.damping + self.RECOVERY)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, batch_invariant: bool = False,
                 follow_kv: bool = False) -> None:
        self.block_manager = block_manager
        self.batch_invariant = batch_invariant
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_admitted = 0
        self.num_held_back = 0  # steps that admitted less because of the KV reserve
        self.prompt_tokens_cached = 0
        self.admission = Admission() if follow_kv else None

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
        if self.admission is not None:
            self.admission.stepped(preempted)
        while (self.waiting and not preempted and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            prefix = blocks.find_prefix(seq)
            cached = len(prefix) * blocks.block_size
            num_new = self._chunk(seq, cached, budget)
            reserve = self._full_length(seq) if self.batch_invariant else cached + num_new
            if num_new == 0 or not blocks.can_admit(seq, prefix, reserve):
                break
            if self.admission is not None and self.running and not self._fits(seq):
                self.num_held_back += 1
                break
            self.waiting.popleft()
            self.num_admitted += 1
            blocks.share_prefix(seq, prefix)
            blocks.allocate(seq, reserve)
            seq.status = SequenceStatus.RUNNING
            seq.num_tokens_at_admission = seq.num_tokens
            self.prompt_tokens_cached += cached
            self.running.append(seq)
            scheduled.append(self._take(seq, num_new))
            budget -= num_new
        return scheduled

    def reserve_computed(self, seq: Sequence, tokens: int) -> int | None:
        """Blocks for a sequence whose first `tokens` tokens have KV computed elsewhere (a
        prefill/decode handoff): its cached prefix shared, the rest allocated to be filled;
        returns how many leading blocks came from the prefix cache, None (nothing changed)
        when it does not fit now, its blocks or (admission by free KV) its worst case beside
        the running sequences'. run_computed admits it once the blocks are filled."""
        blocks = self.block_manager
        if len(self.running) >= self.max_num_seqs:
            return None
        prefix = blocks.find_prefix(seq)
        if not blocks.can_admit(seq, prefix, tokens):
            return None
        if self.admission is not None and self.running and not self._fits(seq):
            self.num_held_back += 1  # its worst case would not fit beside the running ones
            return None
        blocks.share_prefix(seq, prefix)
        blocks.allocate(seq, tokens)
        return len(prefix)

    def run_computed(self, seq: Sequence, tokens: int, cached_blocks: int) -> None:
        """Admit a sequence reserve_computed placed, its first `tokens` tokens' KV now in its
        blocks: it runs from the next step on, like one whose prompt was just computed here."""
        seq.num_computed_tokens = seq.num_tokens_at_admission = tokens
        self.block_manager.register_full_blocks(seq, tokens)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.num_admitted += 1
        self.prompt_tokens_cached += cached_blocks * self.block_manager.block_size

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
        """The most tokens seq can reach: prompt + max_tokens within the context limit (a
        prefill-only sequence stops at its first token)."""
        budget = 1 if seq.prefill_only else seq.params.max_tokens
        return min(seq.num_prompt_tokens + budget, seq.max_total_tokens)

    def _fits(self, seq: Sequence) -> bool:
        """Whether the running sequences and seq, each growing to its worst case, never hold
        more blocks at once than the engine has (times the overcommit). The peak falls on the
        last step of one of them: at step t_j = r_j - 1 (r: tokens still to come) sequence i
        holds the blocks of its c_i + t_j + 1 tokens while r_i > t_j."""
        group = [*self.running, seq]
        tokens = torch.tensor([s.num_tokens for s in group])
        remaining = torch.tensor([max(1, self._full_length(s) - s.num_tokens) for s in group])
        last = remaining - 1
        held = (tokens[:, None] + last[None, :] + self.block_manager.block_size) \
            // self.block_manager.block_size
        peak = int((held * (remaining[:, None] > last[None, :])).sum(0).max())
        capacity = self.block_manager.num_free_blocks + sum(len(s.block_table)
                                                            for s in self.running)
        return peak <= capacity * self.admission.overcommit

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

    def finish(self, seq: Sequence, hold: bool = False) -> None:
        """Remove seq from the queues and free its blocks (`hold`: keep them, for a KV handoff;
        the holder releases them)."""
        if seq.status is SequenceStatus.RUNNING:
            if self.admission is not None and seq.stop_reason in ("completed", "length"):
                self.admission.finished(seq.num_tokens, self._full_length(seq))
            self.running.remove(seq)
            if not hold:
                self.block_manager.release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
