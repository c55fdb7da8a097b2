"""The `sglang` rollout backend (CUDA): SGLang's `Engine` inside the rollout server process.

Token ids in, token ids and sampled-token logprobs out; memory released and resumed by tag
("weights", "kv_cache", SGLang's own names); weights updated from tensors, then the radix cache
flushed. sglang is imported only in `create()`, so `import tandem` works without it.
Proven on a GPU by `bench/gpu_check.sh` (tests/conformance under the `gpu` marker).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from tandem.config.schema import LORA_TARGETS, RolloutConfig
from tandem.rollout.adapter_stream import peek_stream, read_adapter, write_peft_adapter
from tandem.rollout.base import MEMORY_TAGS, BaseRollout, check_tags, checked_version
from tandem.rollout.external import (built_shapes, checked_buckets, expansion_error,
                                    images_for_engine, safetensors_shapes, stop_reason)
from tandem.types import GenerateRequest, SamplingParams, TokenOutput

def sglang_sampling_params(params: SamplingParams, prompt_len: int, context_len: int) -> dict:
    """tandem's validated sampling dict as SGLang sampling_params; the budget is capped by the
    context left after the prompt."""
    out = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
           "repetition_penalty": params.repetition_penalty,
           "max_new_tokens": min(params.max_tokens, context_len - prompt_len),
           "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos}
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def sglang_stop_reason(finish_reason: Mapping[str, Any] | None) -> str:
    """SGLang's meta_info["finish_reason"] as tandem's stop_reason; None means aborted."""
    return stop_reason("SGLang", "abort" if finish_reason is None else finish_reason.get("type"))


class SGLangRollout(BaseRollout):
    """SGLang's Engine: token prompts, sampled-token logprobs, abort, memory by tag, tensor
    weight updates, cache flush; with rollout.lora_rank the actor's adapter through SGLang's
    LoRA API (load_lora_adapter, lora_path on every request: written, UNVERIFIED). A
    vision-language model (Qwen2-VL family) takes images as vLLM does: one pad per image beside
    the image (`image_data`), expanded again by SGLang, whose prompt length is checked (written,
    UNVERIFIED: SGLang has not run here)."""

    capabilities = {"logprobs_raw": "yes", "logprobs_processed": "no", "abort_partial": "yes",
                    "per_request_seed": "yes", "sleep_weights": "yes", "sleep_kv_cache": "yes",
                    "clear_kv_cache": "yes", "update_weights": "yes", "multi_modal_inputs": "yes",
                    "adapters": "no", "kept_sets": "no"}

    def __init__(self, engine: Any, context_len: int, vocab_size: int, shapes: dict[str, tuple],
                 tp_size: int, bucket_bytes: int = 512 << 20, model_path: str = "",
                 lora_rank: int = 0, image_token_id: int | None = None) -> None:
        self.model_path, self.lora_rank = model_path, lora_rank
        self.image_token_id = image_token_id  # a vision-language model's <|image_pad|>, else None
        self.lora_name: str | None = None  # the adapter every request is served with
        self._lora_dirs: list[str] = []
        self.engine, self.context_len, self.shapes = engine, context_len, shapes
        self.vocab_size = vocab_size
        self.bucket_bytes = bucket_bytes  # tensors per update_weights_from_tensor call
        self.tp_size = tp_size
        self.version = 0
        self.running: set[str] = set()
        self.asleep: set[str] = set()
        # a whole update since start and since weights were released (they come back as
        # undefined memory): BaseRollout.synced_in_full
        self.synced = False
        self.sizes: dict[str, int] | None = None
        self.counters = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0,
                         "prompt_tokens_cached": 0}

    @classmethod
    def create(cls, model_path: str | Path, config: RolloutConfig | None = None,
               dtype: str = "bfloat16", device: str = "cuda",
               engine_args: dict[str, Any] | None = None) -> "SGLangRollout":
        """The engine; `engine_args`: more ServerArgs (a prefill/decode replica's
        disaggregation mode, GPU and ports: sglang_disaggregated.py)."""
        import sglang

        from tandem.models import resolve_model_path

        config = config or RolloutConfig()
        if config.logprobs_mode != "raw":
            raise ValueError(f"rollout.logprobs_mode={config.logprobs_mode!r}: the sglang backend "
                             "returns only raw logprobs; use rollout.logprobs_mode=raw")
        if not device.startswith("cuda"):
            raise ValueError(f"the sglang backend runs on CUDA only, not {device!r}")
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"  # logprobs before temperature
        path = resolve_model_path(str(model_path))
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path)
        vision = hasattr(hf_config, "vision_config")
        engine = sglang.Engine(
            model_path=str(path), dtype=dtype, tp_size=config.tensor_model_parallel_size,
            # SGLang's multimodal processor needs the tokenizer; token prompts need none
            random_seed=config.seed, skip_tokenizer_init=not vision, enable_memory_saver=True,
            mem_fraction_static=config.gpu_memory_utilization,
            disable_radix_cache=not config.enable_prefix_caching,
            max_running_requests=config.max_num_seqs,
            chunked_prefill_size=config.max_num_batched_tokens,
            **({"enable_lora": True, "max_lora_rank": config.lora_rank, "max_loras_per_batch": 1,
                "lora_target_modules": list(LORA_TARGETS)} if config.lora_rank else {}),
            **(engine_args or {}))
        # a vision-language model's updates carry the names the actor exports
        shapes = (built_shapes(hf_config, tied_embeddings=True) if vision
                  else safetensors_shapes(path, tied_embeddings=True))
        context_len = engine.tokenizer_manager.model_config.context_len
        return cls(engine, context_len, hf_config.get_text_config().vocab_size, shapes,
                   config.tensor_model_parallel_size,
                   config.checkpoint_engine.update_weights_bucket_megabytes << 20, str(path),
                   config.lora_rank, getattr(hf_config, "image_token_id", None) if vision else None)

    async def generate(self, request: GenerateRequest,
                       bootstrap: dict[str, Any] | None = None) -> TokenOutput:
        """`bootstrap`: a prefill/decode pair's bootstrap_host, _port and _room (both engines
        get the same; SGLang's transfer backend meets there)."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        request_id = request.request_id
        params = SamplingParams.from_dict(request.sampling)
        prompt = request.checked_prompt(self.vocab_size, self.context_len)
        if request_id in self.running:
            raise ValueError(f"request_id {request_id!r} is already running; ids must be unique")
        ids, images = (images_for_engine(request, prompt, self.image_token_id)
                       if request.multi_modal_data else (prompt, []))
        request = GenerateReqInput(rid=request_id, input_ids=ids, return_logprob=params.logprobs,
                                   sampling_params=sglang_sampling_params(params, len(prompt),
                                                                          self.context_len),
                                   **({"image_data": images} if images else {}),
                                   **({"lora_path": self.lora_name} if self.lora_name else {}),
                                   **(bootstrap or {}))
        self.running.add(request_id)
        self.counters["requests"] += 1
        try:
            output = await self.engine.tokenizer_manager.generate_request(request, None).__anext__()
        finally:
            self.running.discard(request_id)
        meta = output["meta_info"]
        if images and meta.get("prompt_tokens", len(prompt)) != len(prompt):
            raise expansion_error(request_id, "SGLang", meta["prompt_tokens"], len(prompt))
        tokens = list(output["output_ids"])
        logprobs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
        self.counters["generated_tokens"] += len(tokens)
        self.counters["prompt_tokens"] += len(prompt)
        self.counters["prompt_tokens_cached"] += int(meta.get("cached_tokens", 0))
        if self.sizes is None:
            await self._measure()
        return TokenOutput(tokens, logprobs if params.logprobs else None,
                           sglang_stop_reason(meta.get("finish_reason")),
                           {"global_steps": self.version})  # every token: TokenOutput.version_runs

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self.engine.tokenizer_manager.abort_request(rid=request_id)
            while request_id in self.running:  # its generate call returns the partial output
                await asyncio.sleep(0.001)

    async def abort_all(self) -> None:
        if self.running:
            self.engine.tokenizer_manager.abort_request(abort_all=True)
            while self.running:
                await asyncio.sleep(0.001)

    async def _measure(self) -> None:
        # SGLang measures the weight and KV pool sizes at load (GB); they are what release frees
        state = (await self.engine.tokenizer_manager.get_internal_state())[0]
        usage = state["memory_usage"]
        self.sizes = {"weights": int(usage["weight"] * (1 << 30)),
                      "kv_cache": int(usage["kvcache"] * (1 << 30))}

    async def sleep(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        tags = [tag for tag in check_tags(tags) if tag not in self.asleep]
        if tags:
            await self.engine.tokenizer_manager.release_memory_occupation(
                ReleaseMemoryOccupationReqInput(tags=tags), None)
            self.asleep.update(tags)
            self.synced = self.synced and "weights" not in tags

    async def wake_up(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        tags = [tag for tag in check_tags(tags) if tag in self.asleep]
        if tags:
            await self.engine.tokenizer_manager.resume_memory_occupation(
                ResumeMemoryOccupationReqInput(tags=tags), None)
            self.asleep.difference_update(tags)

    async def clear_kv_cache(self) -> None:
        await self.engine.tokenizer_manager.flush_cache()

    def memory_bytes(self) -> dict[str, int]:
        """SGLang's measured pool sizes per tag; 0 for a released tag."""
        if self.sizes is None:
            raise RuntimeError("call generate once before memory_bytes() (sizes come from SGLang)")
        return {tag: 0 if tag in self.asleep else self.sizes[tag] for tag in MEMORY_TAGS}

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int, partial: bool = False) -> None:
        version = checked_version(version, self.version)
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        adapter, stream = peek_stream(named_tensors)
        if adapter:
            await self._load_adapter(list(stream), version)
            return
        # checked in full before the engine is touched: a bad tensor leaves the old version
        buckets = checked_buckets(stream or [], self.shapes, self.bucket_bytes)
        for bucket in buckets:
            serialized = MultiprocessingSerializer.serialize(bucket)
            request = UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=[serialized] * self.tp_size, flush_cache=False)
            await self.engine.tokenizer_manager.update_weights_from_tensor(request, None)
        await self.engine.tokenizer_manager.flush_cache()
        self.version = int(version)
        self.synced = self.synced or not partial

    def synced_in_full(self) -> bool:
        return self.synced

    async def _load_adapter(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        """An adapter-only update: checked in full, written as a peft folder, loaded under a new
        name; requests switch to it only once SGLang took it (the old one stays until then)."""
        from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput

        if not self.lora_rank:
            raise ValueError("update_weights: an adapter stream, but this SGLang engine was started "
                             "without LoRA (rollout.lora_rank=0; set actor.lora.rank)")
        adapter = read_adapter(named_tensors, self.shapes)
        directory = tempfile.mkdtemp(prefix=f"tandem-lora-v{version}-")
        name = f"policy-v{version}-{len(self._lora_dirs)}"
        try:
            write_peft_adapter(adapter, Path(directory), self.model_path, self.lora_rank)
            result = await self.engine.tokenizer_manager.load_lora_adapter(
                LoadLoRAAdapterReqInput(lora_name=name, lora_path=directory), None)
            if not getattr(result, "success", True):
                raise RuntimeError(f"SGLang refused the adapter of version {version}: "
                                   f"{getattr(result, 'error_message', result)}")
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        previous, self.lora_name = self.lora_name, name
        if previous is not None:
            await self.engine.tokenizer_manager.unload_lora_adapter(
                UnloadLoRAAdapterReqInput(lora_name=previous), None)
        self._lora_dirs.append(directory)
        while len(self._lora_dirs) > 2:
            shutil.rmtree(self._lora_dirs.pop(0), ignore_errors=True)
        await self.engine.tokenizer_manager.flush_cache()
        self.version = int(version)

    @property
    def weight_version(self) -> int:
        return self.version

    def stats(self) -> dict[str, int]:
        """Requests, generated tokens, prompt tokens and those served from the radix cache."""
        return {**self.counters, "running": len(self.running)}

    async def shutdown(self) -> None:
        await self.abort_all()
        self.engine.shutdown()
