"""Prefill/decode disaggregation inside the native engine (docs/engine.md, "Prefill/decode
disaggregation"): a prefill engine computes a prompt's KV and samples its first token, then holds
the prompt's blocks (`prefill`); a decode engine takes the sequence on with the blocks its own
prefix cache lacks copied into its cache by a KV transfer (`generate_prefilled`), and continues
exactly as a plain engine does after the prompt. The KV is used only where both engines hold the
same weight version (invariant 3: no KV computed with old weights is decoded with new ones);
otherwise, and when the decode engine has no room or the prefill side no longer holds the blocks,
the decode engine recomputes the prompt itself (the sequence waits like a preempted one); so
it does when the prefill engine stopped meanwhile (its KV is not to be read any more).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from tandem.rollout.engine.sequence import Sequence
from tandem.types import GenerateRequest, TokenOutput

logger = logging.getLogger(__name__)


@dataclass
class Prefilled:
    """A prompt the prefill engine computed: the output if its first token ended the request
    (else None: its blocks are held), the sampled token's details, the weight version of its
    KV, and the seed generator's state after the first draw."""

    output: TokenOutput | None
    token: int
    log_prob: float
    kept_ids: torch.Tensor | None
    log_mass: float | None
    version: int
    num_tokens: int  # prompt tokens whose KV the held blocks hold
    generator_state: torch.Tensor | None

    @property
    def finished(self) -> bool:
        """Whether the first token ended the request (nothing to decode)."""
        return self.output is not None


class KVHandoff:
    """AsyncEngine's side of a prefill/decode handoff (uses the engine's scheduler, blocks,
    runner, lock, version and held sequences); the copy itself is the transfer's
    (rollout/engine/kv_transfer.py)."""

    async def prefill(self, request: GenerateRequest) -> Prefilled:
        """Compute the prompt's KV (prefix cache as usual) and sample the first token; the
        prompt's blocks stay held until release_prefilled."""
        self.release_prefilled(request.request_id)
        seq = self._new_sequence(request)
        seq.prefill_only = True
        self.scheduler.add(seq)
        output = await self._result(seq)
        if output is not None:  # the first token ended it (or it was aborted): nothing held
            return Prefilled(output, -1, 0.0, None, None, self.version, 0, None)
        return Prefilled(output, seq.token_ids[-1], seq.log_probs[-1],
                         seq.kept_ids[-1] if seq.kept_ids else None,
                         seq.kept_log_mass_sum if seq.params.return_kept_sets else None,
                         seq.version_runs[-1][0], seq.num_computed_tokens,
                         seq.generator.get_state() if seq.generator is not None else None)

    def publish_kv(self) -> None:
        """After each KV allocation: where every rank's cache lies when it is in shared memory
        (`kv_shares`, rank order; a shm transfer reads it, never the ranks), else None."""
        cache = self.runner.shared_cache
        self.kv_shares = None if cache is None else [
            cache.share, *(self.ranks.kv_shares() if self.ranks is not None else [])]

    def held_blocks(self, request_id: str, num_tokens: int) -> list[int] | None:
        """The held blocks of a prefilled prompt of `num_tokens` tokens, None if not held."""
        seq = self.held.get(request_id)
        if seq is None or seq.num_computed_tokens != num_tokens:
            return None
        return seq.block_table[:-(-num_tokens // self.block_size)]

    def release_prefilled(self, request_id: str) -> None:
        """Free the blocks a prefill held for `request_id` (nothing if none are held)."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.blocks.release(seq)

    async def generate_prefilled(self, request: GenerateRequest, prefilled: Prefilled,
                                 source: Any, transfer: Any) -> TokenOutput:
        """Decode `request` on from a prefill engine's result: the prompt's blocks this engine's
        prefix cache lacks are copied from `source` (a KVHandoff engine) by `transfer`, the first
        token is appended as sampled there, and generation continues here; the KV is recomputed
        here instead when the versions differ, the blocks are gone or there is no room."""
        self._ensure_loop()
        async with self._lock:  # registered and placed at once: no step sees it half-made
            seq = self._new_sequence(request)
            if seq.num_tokens != prefilled.num_tokens:
                self.requests.pop(seq.request_id, None)
                raise ValueError(f"generate_prefilled: request {request.request_id!r} has "
                                 f"{seq.num_tokens} prompt tokens, its prefill "
                                 f"{prefilled.num_tokens}")
            moved = self._take_over(seq, prefilled, source, transfer)
            seq.append(prefilled.token, prefilled.log_prob, prefilled.version, prefilled.kept_ids,
                       prefilled.log_mass)
            if prefilled.generator_state is not None:
                seq.generator = torch.Generator(device=self.device)
                seq.generator.set_state(prefilled.generator_state)
            source.release_prefilled(seq.request_id)  # copied (or not usable): free it there
            if moved is None:  # recomputed here like a preempted sequence: prompt + first token
                self.counters["handoffs_recomputed"] += 1
                self.scheduler.add(seq)
            else:
                self.counters["handoff_blocks"] += moved
        return await self._result(seq)

    def _take_over(self, seq: Sequence, prefilled: Prefilled, source: Any, transfer: Any
                   ) -> int | None:
        """Under the step lock: give seq blocks (sharing this engine's cached prefix), copy the
        rest of the prompt's KV from the source's held blocks and run seq from here; returns
        the blocks copied, or None (nothing changed) when the KV cannot be used."""
        tokens = prefilled.num_tokens
        source_blocks = None if source.closed else source.held_blocks(seq.request_id, tokens)
        if source_blocks is None or prefilled.version != self.version or self.kv_released:
            return None
        first = self.scheduler.reserve_computed(seq, tokens)
        if first is None:
            return None
        try:
            transfer.move(source, source_blocks[first:], self, seq.block_table[first:])
        except Exception:  # this request's transfer fails, never the engine: recompute it
            logger.exception("KV transfer of request %r failed; it is recomputed on the decode "
                             "side", seq.request_id)
            self.blocks.release(seq)
            return None
        self.scheduler.run_computed(seq, tokens, first)
        return len(seq.block_table) - first
