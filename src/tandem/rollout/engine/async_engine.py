"""The engine loop: requests in, TokenOutputs out; the backend contract (BaseRollout).

A background asyncio task repeats schedule -> forward + sample -> record tokens, yielding to the
event loop between steps and, within a long step, between decoder layers, so the loop keeps serving
calls. Steps run on the event loop's own thread, never in a helper thread (docs/engine.md, "One
OpenMP team per process"). Control calls take the same lock as a step, so they never run in the
middle of one: sleep/wake live in memory.py, weight updates in weight_staging.py, the
double-buffered slots in slot_weights.py, prefill/decode handoffs in kv_handoff.py. With
rollout.tensor_model_parallel_size > 1 this engine is rank 0 of a tensor-parallel replica: it
schedules and samples once and sends each step's plan to the worker ranks (rank_worker.py),
which run the same forward on their slices in lockstep.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tandem.config.choices import ADMISSION, IN_FLIGHT_KV, LOGPROBS_MODES
from tandem.config.schema import RolloutConfig
from tandem.rollout.base import BaseRollout, ReplicaFailedError
from tandem.rollout.engine.block_manager import BlockManager
from tandem.rollout.engine.kv_handoff import KVHandoff
from tandem.rollout.engine.lora_merge import LoraState
from tandem.rollout.engine.memory import MemoryControl, plan_num_blocks
from tandem.rollout.engine.model_runner import ModelRunner, torch_dtype
from tandem.rollout.engine.rank_worker import RankWorkers, Rendezvous
from tandem.rollout.engine.sampler import sample
from tandem.rollout.engine.scheduler import ScheduledSequence, Scheduler
from tandem.rollout.engine.sequence import PREFILLED, Sequence, SequenceStatus
from tandem.rollout.engine.slot_weights import SlotServing
from tandem.rollout.engine.weight_staging import WeightUpdates
from tandem.types import GenerateRequest, SamplingParams, TokenOutput

logger = logging.getLogger(__name__)

# Within a step, the engine yields to the event loop after a decoder layer once this long has
# passed since it last did (a long prompt chunk on a large model takes seconds).
YIELD_EVERY_S = 0.02


class AsyncEngine(MemoryControl, WeightUpdates, SlotServing, KVHandoff, BaseRollout):
    """The native engine; `rollout/native.py`'s NativeRollout adds create() and capabilities."""

    def __init__(self, model_path: str | Path, config: RolloutConfig, dtype: str = "float32",
                 device: str = "cpu", rendezvous: Rendezvous | None = None,
                 kv_shm_dir: str | None = None) -> None:
        _check_config(config)
        self.config = config
        self.device = torch.device(device)
        # the other ranks of a tensor-parallel replica (None: this engine is the whole model)
        self.ranks, tensor_parallel = (
            RankWorkers.start(config.tensor_model_parallel_size, str(model_path), dtype,
                              self.device, rendezvous)
            if config.tensor_model_parallel_size > 1 else (None, None))
        try:
            self.runner = ModelRunner(model_path, torch_dtype(dtype), self.device, tensor_parallel)
            self.block_size = config.block_size
            self.num_blocks = plan_num_blocks(config, self.runner, self.device)
            self.runner.kv_shm_dir = kv_shm_dir  # set: every rank's KV cache in shared memory
            self.runner.allocate_kv_cache(self.num_blocks, self.block_size)
            if self.ranks is not None:
                self.ranks.wait_ready()
                self.ranks.allocate_kv(self.num_blocks, self.block_size, kv_shm_dir)
            self.publish_kv()
        except BaseException:
            if self.ranks is not None:
                self.ranks.stop(gracefully=False)
            raise
        self.blocks = BlockManager(self.num_blocks, self.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.batch_invariant,
                                   # batch-invariant steps reserve every sequence's worst case
                                   follow_kv=(config.admission in ("auto", "kv")
                                              and not config.batch_invariant))
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.eos_token_ids = self.runner.eos_token_ids
        self.max_model_len = self.runner.max_model_len
        self.version = 0
        self.requests: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # prefilled sequences whose blocks a handoff reads
        self.aborted: set[str] = set()  # request ids to finish at the next step boundary
        self.closed = False
        self.kv_released = False
        self.weights_state = "loaded"  # loaded | offloaded (GPU: on CPU) | dropped (CPU)
        self.unfilled_weights: set[str] = set()  # names still to refill after a CPU drop
        self.whole_update = False  # a whole (not partial, not adapter) update committed
        self.weight_shapes: dict[str, torch.Size] = {}
        self.lora = LoraState()  # the adapter merged into the served weights, if any
        self.counters = {"steps": 0, "prompt_tokens_computed": 0, "generated_tokens": 0,
                         "failed_steps": 0, "handoff_blocks": 0, "handoffs_recomputed": 0}
        self.first_token_time: float | None = None  # time.time() of the first sampled token
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._in_step = False  # a step is between its schedule() and its _record()
        self._built_in = threading.current_thread()  # see _warn_if_stepping_off_thread

    # ---- the loop -------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        """Start the background task in the running loop (again, if the caller's loop changed)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        if self._loop is not loop:
            for seq in list(self.requests.values()):  # futures of a dead loop can never resolve
                self._finish(seq, error=RuntimeError("the event loop that submitted this request "
                                                     "is gone"))
            if self._in_step:  # the old loop stopped inside a step: its keyed blocks are unwritten
                self.blocks.clear_prefix_cache()
                self._in_step = False
            self._lock = asyncio.Lock()
            self._work = asyncio.Event()
            self._loop = loop
        self._task = loop.create_task(self._run(), name="tandem-native-engine")
        self._warn_if_stepping_off_thread()

    def _warn_if_stepping_off_thread(self) -> None:
        """Building the engine ran torch parallel work in the building thread, which keeps an
        OpenMP team while it lives; steps on another thread then run throttled (module doc)."""
        built_in, here = self._built_in, threading.current_thread()
        if built_in is not here and built_in.is_alive() and self.device.type == "cpu":
            logger.warning("native engine built in thread %r but stepping in thread %r: while "
                           "both threads live, the process has two OpenMP teams and steps can "
                           "be ~1.6x slower; build the engine in its event loop's thread "
                           "(docs/engine.md, 'One OpenMP team per process')", built_in.name,
                           here.name)
            self._built_in = here  # once
        self._work.set()

    def _ready(self) -> bool:
        return (self.scheduler.has_work() and not self.kv_released
                and self.weights_state == "loaded" and not self.unfilled_weights)

    async def _run(self) -> None:
        while True:
            await self._work.wait()
            async with self._lock:
                try:
                    await self._iteration()
                except Exception as error:  # a bug outside the model step: fail all, keep serving
                    logger.exception("native engine iteration failed")
                    self._fail_everything(error)
            await asyncio.sleep(0)  # let waiting control calls take the lock

    async def _iteration(self) -> None:
        self._finish_aborted()
        if not self._ready():
            self._work.clear()
            return
        batch = self.scheduler.schedule()
        if not batch:
            self._work.clear()
            return
        self._in_step = True  # stays set only if the loop abandons the step (_ensure_loop)
        try:
            tokens, log_probs, kept, log_masses = await self._step_batch(batch)
        except asyncio.CancelledError:
            # the loop is going away between two layers of this step: blocks it keyed hold
            # K/V for some layers only, so nothing may match them later
            self.blocks.clear_prefix_cache()
            raise
        except Exception as error:
            self.counters["failed_steps"] += 1
            logger.exception("native engine step failed")
            self.blocks.clear_prefix_cache()  # blocks keyed for this step were never written
            if self.ranks is not None and self.ranks.failure is None:  # out of lockstep now
                error = self.ranks.fail(error)
            kind = ReplicaFailedError if isinstance(error, ReplicaFailedError) else RuntimeError
            failure = kind(f"native engine step failed: {type(error).__name__}: {error}")
            failure.__cause__ = error
            for item in batch:
                self._finish(item.seq, error=failure)
            return
        finally:
            self._in_step = False
        self._record(batch, tokens, log_probs, kept, log_masses)

    async def _step_batch(self, batch: list[ScheduledSequence]) -> tuple[list, ...]:
        """One forward for the whole batch, or with rollout.batch_invariant one per sequence,
        so a sequence's logits never depend on which others share its step (their shapes)."""
        if not self.config.batch_invariant:
            return await self._step(batch)
        outputs: tuple[list, ...] = ([], [], [], [])
        for item in batch:
            for whole, part in zip(outputs, await self._step([item])):
                whole += part
        return outputs

    async def _step(self, batch: list[ScheduledSequence]) -> tuple[list, ...]:
        """Forward + sample (sampler.sample's four lists), yielding to the loop between layers
        when the step runs long."""
        plan = self.runner.plan_step(batch)
        if self.ranks is not None:
            self.ranks.step(plan)  # the other ranks run the same step, joining its collectives
        layers = self.runner.forward_layers(plan)
        deadline = time.perf_counter() + YIELD_EVERY_S
        try:
            while True:
                try:
                    next(layers)
                except StopIteration as done:
                    logits = done.value
                    break
                if time.perf_counter() > deadline:
                    await asyncio.sleep(0)
                    deadline = time.perf_counter() + YIELD_EVERY_S
        except asyncio.CancelledError:
            if self.ranks is not None:  # the other ranks are inside this step: finish it
                for _ in layers:
                    pass
            raise
        sampling = [item.seq for item in batch if item.samples]
        if not sampling:
            return [], [], [], []
        with torch.inference_mode():
            return sample(logits, sampling, self.config.logprobs_mode, self.generator)

    def _record(self, batch: list[ScheduledSequence], tokens: list[int],
                log_probs: list[float], kept: list[torch.Tensor | None],
                log_masses: list[float | None]) -> None:
        self.counters["steps"] += 1
        sampled = iter(zip(tokens, log_probs, kept, log_masses))
        for item in batch:
            seq = item.seq
            end = item.start + item.num_new
            seq.num_computed_tokens = end
            self.counters["prompt_tokens_computed"] += max(
                0, min(end, seq.num_tokens_at_admission) - item.start)
            if not item.samples:
                continue
            token, log_prob, kept_ids, log_mass = next(sampled)
            if seq.aborted or seq.status is not SequenceStatus.RUNNING:
                continue
            seq.append(token, log_prob, self.version, kept_ids, log_mass)
            self.counters["generated_tokens"] += 1
            if self.first_token_time is None:  # the trainer's start-up report reads it
                self.first_token_time = time.time()
            if seq.stop_reason is not None:
                self._finish(seq)
        self._finish_aborted()

    def _finish_aborted(self) -> None:
        for request_id in self.aborted:
            seq = self.requests.get(request_id)
            if seq is not None and seq.aborted:
                seq.stop_reason = "aborted"
                self._finish(seq)
        self.aborted.clear()

    def _finish(self, seq: Sequence, error: BaseException | None = None) -> None:
        hold = error is None and seq.stop_reason == PREFILLED  # its blocks await a handoff
        self.scheduler.finish(seq, hold=hold)
        if hold:
            self.held[seq.request_id] = seq
        self.requests.pop(seq.request_id, None)
        future = seq.future
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error)
            return
        if hold:  # prefill() reads the held sequence itself
            future.set_result(None)
            return
        runs = [list(run) for run in seq.version_runs]
        versions = [version for version, _ in runs] or [self.version]
        extra: dict[str, Any] = {"global_steps": max(versions), "version_runs": runs}
        if min(versions) != max(versions):
            extra.update(min_global_steps=min(versions), max_global_steps=max(versions))
        if seq.params.return_kept_sets:  # sums over the tokens: the kept mass per step's metric
            extra.update(kept_tokens=seq.kept_tokens, kept_log_mass_sum=seq.kept_log_mass_sum,
                         kept_mass_sum=seq.kept_mass_sum)
        log_probs = list(seq.log_probs) if seq.params.logprobs else None
        try:
            output = TokenOutput(token_ids=seq.generated_ids, log_probs=log_probs,
                                 stop_reason=seq.stop_reason, extra_fields=extra,
                                 kept_sets=seq.kept_sets())
        except Exception as failure:  # the caller gets the error, never waits forever
            future.set_exception(failure)
            return
        future.set_result(output)

    def _reset_blocks(self, num_blocks: int) -> None:
        """Forget every block, the ones held for KV handoffs included."""
        self.blocks.reset(num_blocks)
        self.held.clear()

    def _fail_everything(self, error: BaseException) -> None:
        failure = RuntimeError(f"native engine failed: {type(error).__name__}: {error}")
        for seq in list(self.requests.values()):
            self._finish(seq, error=failure)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self._reset_blocks(self.blocks.num_blocks)

    # ---- requests -------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> TokenOutput:
        """Queue one request and await its result (stop, budget, or abort with partial tokens)."""
        seq = self._new_sequence(request)
        self.scheduler.add(seq)
        return await self._result(seq)

    def _new_sequence(self, request: GenerateRequest) -> Sequence:
        """The checked request as a sequence registered under its id, not yet scheduled."""
        if self.closed:
            raise RuntimeError("the native engine is shut down")
        self.raise_if_failed()
        self._ensure_loop()
        request_id = request.request_id
        params = SamplingParams.from_dict(request.sampling)
        prompt = request.checked_prompt(self.runner.vocab_size, self.max_model_len)
        self._check_params(params)
        if self.weights_state != "loaded" or self.unfilled_weights:
            raise RuntimeError(self._weights_missing_message())
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running; ids must be unique")
        total = min(len(prompt) + params.max_tokens, self.max_model_len)
        if -(-total // self.block_size) > self.num_blocks:
            raise ValueError(f"request {request_id!r} needs up to {total} tokens of KV but the "
                             f"cache holds {self.num_blocks * self.block_size}; lower max_tokens "
                             "or raise rollout.kv_cache_memory_bytes")
        images = None
        if request.multi_modal_data:
            if self.runner.vision is None:
                raise ValueError(f"request {request_id!r}: multi_modal_data, but this model has "
                                 "no vision tower; serve a vision-language model (Qwen2-VL "
                                 "family) or send token ids only")
            images = self.runner.vision.prepare(request_id, prompt, request.multi_modal_data)
        seq = Sequence(request_id, prompt, params, self.eos_token_ids, self.max_model_len,
                       future=asyncio.get_running_loop().create_future(), images=images)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.requests[request_id] = seq
        return seq

    async def _result(self, seq: Sequence) -> TokenOutput:
        """Await a registered sequence's output; a caller that goes away aborts it."""
        self._work.set()
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:  # the caller went away: stop computing for it
            self._mark_aborted(seq)
            raise

    def _mark_aborted(self, seq: Sequence) -> None:
        seq.aborted = True
        self.aborted.add(seq.request_id)
        self._work.set()

    def _check_params(self, params: SamplingParams) -> None:
        # checked here, at submission: a value the step cannot take would fail its neighbours
        vocab = self.runner.vocab_size
        if params.top_k > vocab:
            raise ValueError(f"sampling top_k={params.top_k}: larger than the vocabulary ({vocab} "
                             "tokens); use -1 to disable top-k")

    async def abort(self, request_id: str) -> None:
        self._ensure_loop()
        seq = self.requests.get(request_id)
        if seq is None:
            return
        self._mark_aborted(seq)
        await asyncio.wait([seq.future])

    async def abort_all(self) -> None:
        self._ensure_loop()
        futures = []
        for seq in list(self.requests.values()):
            self._mark_aborted(seq)
            futures.append(seq.future)
        if futures:
            await asyncio.wait(futures)

    @property
    def weight_version(self) -> int:
        return self.version

    def raise_if_failed(self) -> None:
        """ReplicaFailedError once a rank of this tensor-parallel replica failed."""
        if self.ranks is not None and self.ranks.failure is not None:
            raise ReplicaFailedError(self.ranks.failure)

    def stats(self) -> dict[str, int | float | None]:
        """Engine counters: steps, prompt tokens computed / served from the prefix cache, ..."""
        return {**self.counters, "first_token_time": self.first_token_time,
                "prompt_tokens_cached": self.scheduler.prompt_tokens_cached,
                "preemptions": self.scheduler.num_preemptions,
                "admitted": self.scheduler.num_admitted,
                "admission_held_back": self.scheduler.num_held_back,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "num_blocks": self.blocks.num_blocks, "free_blocks": self.blocks.num_free_blocks,
                "cached_blocks": self.blocks.num_cached_blocks,
                "tensor_parallel_ranks": self.ranks.size if self.ranks else 1,
                "tensor_parallel_failure": self.ranks.failure if self.ranks else None}

    async def shutdown(self) -> None:
        """Abort everything and stop the loop (and the other ranks' processes)."""
        self.closed = True
        if self._task is not None:
            await self.abort_all()
            task, self._task = self._task, None
            task.cancel()
            if self.ranks is not None:  # a step in flight finishes before the ranks are told
                await asyncio.gather(task, return_exceptions=True)
        if self.ranks is not None:
            self.ranks.stop()
        if self.runner.shared_cache is not None:  # its file goes (mappings live with their views)
            self.runner.shared_cache.close()


def _check_config(config: RolloutConfig) -> None:
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                 "tensor_model_parallel_size"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"rollout.{name}={value!r}: must be a positive integer")
    if not isinstance(config.kv_cache_memory_bytes, int) or config.kv_cache_memory_bytes < 0:
        raise ValueError(f"rollout.kv_cache_memory_bytes={config.kv_cache_memory_bytes!r}: must be "
                         ">= 0 (0: derive from gpu_memory_utilization on CUDA)")
    if config.logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"rollout.logprobs_mode={config.logprobs_mode!r}: use one of "
                         f"{LOGPROBS_MODES}")
    if config.batch_invariant and config.enable_prefix_caching:
        raise ValueError("rollout.batch_invariant=true needs rollout.enable_prefix_caching=false: "
                         "a prefix-cache hit computes the rest of a prompt in other shapes")
    if config.admission not in ADMISSION:
        raise ValueError(f"rollout.admission={config.admission!r}: use one of {ADMISSION}")
    if config.in_flight_kv not in IN_FLIGHT_KV:
        raise ValueError(f"rollout.in_flight_kv={config.in_flight_kv!r}: use one of {IN_FLIGHT_KV}")
