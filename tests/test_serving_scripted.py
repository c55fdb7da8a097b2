"""A scripted BaseRollout test double for the serving tests, and tests of the double itself.

It makes tokens with a small asyncio sleep each, so load-balancing, pausing and abort behave as
with a real engine while costing no compute. The next token is a function of the context and
the weight version, so a resumed request continues exactly where an uninterrupted one would.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Iterable, Mapping

import pytest

from tandem.rollout.base import MEMORY_TAGS, BaseRollout, check_tags
from tandem.serving.remote import call
from tandem.types import GenerateRequest, SamplingParams, TokenOutput


def next_token(context: list[int], version: int) -> int:
    """The scripted 'model': deterministic in the context and the weight version."""
    return (sum(context[-3:]) * 7 + len(context) * 13 + version * 101) % 997 + 3


def token_log_prob(token: int) -> float:
    """A fixed logprob per token id, so tests can check the alignment of logprobs."""
    return -(token % 17) / 10.0


class ScriptedRollout(BaseRollout):
    """Deterministic fake engine. model_path "scripted:delay=S" sets the seconds per token."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._version = 0
        self._aborts: dict[str, asyncio.Event] = {}
        self._asleep: set[str] = set()
        self.request_ids: list[str] = []  # every id generate() was called with, in order
        self.counters = {"tokens_generated": 0, "requests": 0, "aborted": 0,
                         "weight_tensors_loaded": 0, "kv_clears": 0}

    @classmethod
    def create(cls, model_path: Any, config: Any, dtype: str = "float32",
               device: str = "cpu") -> "ScriptedRollout":
        match = re.fullmatch(r"scripted(?::delay=([0-9.]+))?", str(model_path))
        if match is None:
            raise ValueError(f"ScriptedRollout model_path must be 'scripted[:delay=S]', "
                             f"not {model_path!r}")
        return cls(float(match.group(1) or 0.002))

    async def generate(self, request) -> TokenOutput:
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        params = SamplingParams.from_dict(sampling_params)
        if not prompt_ids or min(prompt_ids) < 0:
            raise ValueError(f"request {request_id}: prompt must be non-empty token ids >= 0")
        if self._asleep:
            raise RuntimeError(f"generate() while {sorted(self._asleep)} asleep")
        if request_id in self._aborts:
            raise ValueError(f"request id {request_id!r} is already running")
        abort = self._aborts[request_id] = asyncio.Event()
        self.request_ids.append(request_id)
        self.counters["requests"] += 1
        context, tokens = list(prompt_ids), []
        stop_reason = "length"
        try:
            while len(tokens) < params.max_tokens:
                try:
                    await asyncio.wait_for(abort.wait(), self.delay_s)
                except asyncio.TimeoutError:
                    pass
                if abort.is_set():
                    stop_reason = "aborted"
                    self.counters["aborted"] += 1
                    break
                token = next_token(context, self._version)
                tokens.append(token)
                context.append(token)
                self.counters["tokens_generated"] += 1
                if token in params.stop_token_ids and not params.ignore_eos:
                    stop_reason = "completed"
                    break
        finally:
            del self._aborts[request_id]
        log_probs = [token_log_prob(t) for t in tokens] if params.logprobs else None
        return TokenOutput(tokens, log_probs, stop_reason, {"global_steps": self._version})

    async def abort(self, request_id: str) -> None:
        if request_id in self._aborts:
            self._aborts[request_id].set()

    async def abort_all(self) -> None:
        for event in self._aborts.values():
            event.set()

    async def sleep(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        self._asleep.update(check_tags(tags))

    async def wake_up(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        self._asleep.difference_update(check_tags(tags))

    async def clear_kv_cache(self) -> None:
        self.counters["kv_clears"] += 1

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int,
                             partial: bool = False) -> None:
        self.counters["weight_tensors_loaded"] += len(list(named_tensors))
        self._version = version

    @property
    def weight_version(self) -> int:
        return self._version

    def memory_bytes(self) -> dict[str, int]:
        return {tag: 0 if tag in self._asleep else 1 for tag in MEMORY_TAGS}

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "running": len(self._aborts),
                "request_ids": list(self.request_ids)}


async def load_weights(manager: Any, named_tensors: Iterable[tuple[str, Any]],
                       version: int) -> None:
    """(name, tensor) pairs straight into every server of the manager's replicas as `version`
    (RolloutServer.update_weights, the seam's in-process end; no verb moves weights): serving
    tests change versions without a training actor."""
    tensors = list(named_tensors)
    await asyncio.gather(*(call(server, "update_weights", tensors, version)
                           for replica in manager.replicas.values() for server in replica.servers))


def scripted_sequence(prompt: list[int], count: int, version: int = 0) -> list[int]:
    """What the scripted model generates for prompt without interruption."""
    context = list(prompt)
    for _ in range(count):
        context.append(next_token(context, version))
    return context[len(prompt):]


async def test_scripted_backend_matches_reference_and_aborts_with_partial_tokens() -> None:
    backend = ScriptedRollout.create("scripted:delay=0.001", None)
    out = await backend.generate(GenerateRequest("a", [5, 6, 7], {"max_tokens": 12}))
    assert out.token_ids == scripted_sequence([5, 6, 7], 12)
    assert out.stop_reason == "length" and len(out.log_probs) == 12

    task = asyncio.ensure_future(backend.generate(GenerateRequest("b", [1], {"max_tokens": 10_000})))
    await asyncio.sleep(0.05)
    await backend.abort_all()
    partial = await task
    assert partial.stop_reason == "aborted"
    assert 0 < len(partial.token_ids) < 10_000
    assert partial.token_ids == scripted_sequence([1], len(partial.token_ids))
    assert backend.stats()["tokens_generated"] == 12 + len(partial.token_ids)


async def test_scripted_backend_rejects_bad_prompts_and_bad_model_paths() -> None:
    backend = ScriptedRollout.create("scripted", None)
    with pytest.raises(ValueError, match="non-empty"):
        await backend.generate(GenerateRequest("x", [], {"max_tokens": 2}))
    with pytest.raises(ValueError, match="scripted"):
        ScriptedRollout.create("/some/model", None)
