"""Issue 17, micro-batches from a memory budget: the token budget actor.micro_batch_memory_gb
derives for a known shape (the documented formula, by hand), the estimate bounding the measured
peak of a real forward + backward, and the config checks."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tandem.batch.jagged import trajectories_to_batch
from tandem.batch.trajectory import Trajectory
from tandem.config.load import ConfigError, load_config
from tandem.training.engine import TrainingEngine
from tandem.training.forward import actor_forward
from tandem.training.lm_head import DEFAULT_CHUNK_BYTES
from tandem.training.memory_budget import (ModelShape, activation_bytes, micro_batch_token_budget,
                                           tokens_for_memory)

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152}


def test_smollm2_token_budget_is_the_documented_formula():
    """docs/training.md's formula written out for SmolLM2-135M in fp32 with the chunked head."""
    h, i, layers, heads, d, vocab, b = 576, 1536, 30, 9, 64, 49152, 4
    chunk = DEFAULT_CHUNK_BYTES // (3 * 4 * vocab)  # 113 tokens of logits per chunk

    def by_hand(tokens: int) -> int:
        norm = h * (4 + 2 * b) + 4
        layer = 2 * norm + (5 * heads * d + tokens) * b + heads * 4 + 4 * i * b
        per_token = (layers + 1) * layer + h * (4 + b) + 4 + 2 * d * b + h * b + 32 * 4
        head = min(tokens, chunk) * vocab * (2 * b + 3 * 4) + 3 * vocab * h * b
        return tokens * per_token + head

    shape = ModelShape.from_hf_config(SMOLLM2)
    for tokens in (1, 113, 114, 926, 4096):
        assert activation_bytes(shape, 4, tokens, False, DEFAULT_CHUNK_BYTES) == by_hand(tokens)
    fits = tokens_for_memory(2 * 10**9, shape, 4, False, DEFAULT_CHUNK_BYTES)
    assert by_hand(fits) <= 2 * 10**9 < by_hand(fits + 1)
    assert fits == 926
    config = load_config(overrides=["actor.micro_batch_memory_gb=2"])
    assert micro_batch_token_budget(config, SMOLLM2, full_logits=False) == 926
    # the token budget is a limit too: the smaller wins
    config = load_config(overrides=["actor.micro_batch_memory_gb=2", "actor.ppo_max_token_len_per_micro_batch=800"])
    assert micro_batch_token_budget(config, SMOLLM2, full_logits=False) == 800
    config = load_config(overrides=["actor.ppo_max_token_len_per_micro_batch=800"])  # memory budget off
    assert micro_batch_token_budget(config, SMOLLM2, full_logits=False) == 800
    # every response token's full logits (FSDP-sharded head): far fewer tokens
    assert tokens_for_memory(2 * 10**9, shape, 4, True, DEFAULT_CHUNK_BYTES) == 634


def peak_allocated_bytes(step) -> int:
    """Peak of the bytes torch's CPU allocator holds during step(), above what it held before,
    from the profiler's allocation and free events (exact sizes: no allocator or RSS noise)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("architecture,dtype,chunk_bytes", [
    ("llama", torch.float32, 100_000),  # tied head, 2 tokens per chunk: the head-gradient sums
    ("qwen2", torch.bfloat16, None),  # full logits, as under FSDP
])
def test_estimate_bounds_the_measured_peak(architecture, dtype, chunk_bytes):
    """measured <= estimate <= 2 x measured. The estimate over-counts by design (one more layer
    for the backward, every token as a response token for the head, o_proj's input apart from
    SDPA's output): measured ratios 1.2-1.8 on such shapes. One thread: SDPA's per-thread
    workspaces (not in the estimate) stay small."""
    model_class, config_class = {"llama": (LlamaForCausalLM, LlamaConfig),
                                 "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[architecture]
    torch.manual_seed(0)
    model = model_class(config_class(hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=8000,
                                     max_position_embeddings=512, tie_word_embeddings=True)).to(dtype)
    generator = torch.Generator().manual_seed(0)
    batch = trajectories_to_batch([
        Trajectory(prompts=torch.randint(3, 8000, (p,), generator=generator),
                   responses=torch.randint(3, 8000, (r,), generator=generator),
                   response_mask=torch.ones(r, dtype=torch.long), rollout_log_probs=torch.zeros(r),
                   min_global_steps=0, max_global_steps=0) for p, r in [(20, 30), (35, 12), (8, 60), (40, 45)]])

    def step() -> None:
        out = actor_forward(model, batch, True, 1.0, calculate_entropy=True, logits_chunk_bytes=chunk_bytes)
        (out.log_probs.sum() + out.entropy.sum()).backward()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step()
        model.zero_grad(set_to_none=False)  # the gradients exist: not the micro-batch's memory
        measured = peak_allocated_bytes(step)
    finally:
        torch.set_num_threads(threads)
    tokens = 20 + 30 + 35 + 12 + 8 + 60 + 40 + 45
    estimate = activation_bytes(ModelShape.from_hf_config(model.config.to_dict()),
                                torch.finfo(dtype).bits // 8, tokens, chunk_bytes is None,
                                chunk_bytes or DEFAULT_CHUNK_BYTES)
    assert measured <= estimate <= 2 * measured, (measured, estimate)


def test_a_budget_below_one_trajectory_is_a_config_error_naming_the_minimum():
    from tandem.preflight import check_model_fit

    lengths = ["rollout.prompt_length=256", "rollout.response_length=256"]
    with pytest.raises(ConfigError) as error:
        check_model_fit(load_config(overrides=["model.path=tiny:qwen2",
                                               "actor.micro_batch_memory_gb=0.001", *lengths]))
    message = str(error.value)
    assert message.startswith("actor.micro_batch_memory_gb: is 0.001, which holds the estimated activations of ")
    assert "tokens of tiny:qwen2 (float32), fewer than the longest trajectory rollout.prompt_length + " \
           "rollout.response_length = 512; raise it to at least " in message
    minimum = float(message.split("raise it to at least ")[1].split(" ")[0])
    check_model_fit(load_config(overrides=["model.path=tiny:qwen2",
                                           f"actor.micro_batch_memory_gb={minimum}", *lengths]))
    below = round(minimum - 0.001, 3)  # the minimum is given to the MB
    with pytest.raises(ConfigError, match="actor.micro_batch_memory_gb"):
        check_model_fit(load_config(overrides=["model.path=tiny:qwen2",
                                               f"actor.micro_batch_memory_gb={below}", *lengths]))
    with pytest.raises(ConfigError, match=r"actor.micro_batch_memory_gb: is -1.0; must be >= 0"):
        load_config(overrides=["actor.micro_batch_memory_gb=-1"])
    with pytest.raises(ConfigError, match=r"actor.micro_batch_memory_gb: sizes packed micro-batches, but "
                                          r"actor.use_remove_padding=false"):
        load_config(overrides=["actor.micro_batch_memory_gb=1", "actor.use_remove_padding=false"])
    with pytest.raises(ValueError, match="the model's config has no intermediate_size, so its activation "
                                         "memory cannot be estimated"):
        ModelShape.from_hf_config({**SMOLLM2, "intermediate_size": None})


def test_engine_cuts_micro_batches_by_the_memory_budget():
    lengths = ["rollout.prompt_length=32", "rollout.response_length=32"]
    config = load_config(overrides=["model.path=tiny:qwen2", "actor.micro_batch_memory_gb=0.02", *lengths])
    engine = TrainingEngine.from_config(config, "actor", total_steps=1)
    expected = tokens_for_memory(2 * 10**7, ModelShape.from_hf_config(engine.model.config.to_dict()), 4,
                                 False, DEFAULT_CHUNK_BYTES)
    assert 64 <= engine.max_token_len == expected < 4096
    plain = TrainingEngine.from_config(load_config(overrides=["model.path=tiny:qwen2", *lengths]), "actor")
    assert plain.max_token_len == 4096  # off by default: the token budget alone
