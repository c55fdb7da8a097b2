"""The native engine against HF transformers on tiny fp32 models: greedy tokens and logprobs."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.config.schema import RolloutConfig
from tandem.models import TinyModelSpec, build_tiny_model
from tandem.rollout.native import NativeRollout

from float_bounds import assert_within, token_logprob_bounds
from tandem.types import GenerateRequest

SMALL_KV = 8 << 20


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_path(request):
    return build_tiny_model(TinyModelSpec(architecture=request.param))


@pytest.fixture(scope="module")
def hf_model(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def random_prompts(count: int, vocab: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


async def test_greedy_matches_hf_batch_1(model_path, hf_model):
    rollout = NativeRollout.create(model_path, RolloutConfig(kv_cache_memory_bytes=SMALL_KV))
    prompt = random_prompts(1, hf_model.config.vocab_size, 12, 12, seed=1)[0]
    out = await rollout.generate(GenerateRequest("one", prompt, {"temperature": 0, "max_tokens": 24}))
    assert out.token_ids == hf_greedy(hf_model, prompt, 24)
    assert len(out.log_probs) == len(out.token_ids)
    assert out.extra_fields["global_steps"] == 0


async def test_greedy_matches_hf_16_staggered_prompts(model_path, hf_model):
    # small step budget and block size: chunked prefill, mixed prefill/decode steps, many blocks
    config = RolloutConfig(kv_cache_memory_bytes=SMALL_KV, block_size=4, max_num_batched_tokens=40,
                           max_num_seqs=6)
    rollout = NativeRollout.create(model_path, config)
    prompts = random_prompts(16, hf_model.config.vocab_size, 3, 70, seed=2)
    budgets = [random.Random(i).randint(4, 20) for i in range(16)]

    async def one(i):
        await asyncio.sleep(0.01 * i)
        return await rollout.generate(GenerateRequest(f"r{i}", prompts[i], {"temperature": 0,
                                                            "max_tokens": budgets[i]}))

    outs = await asyncio.gather(*(one(i) for i in range(16)))
    for prompt, budget, out in zip(prompts, budgets, outs):
        assert out.token_ids == hf_greedy(hf_model, prompt, budget)
    assert rollout.stats()["running"] == 0


async def test_logprobs_match_hf_forward(model_path, hf_model):
    rollout = NativeRollout.create(model_path, RolloutConfig(kv_cache_memory_bytes=SMALL_KV,
                                                             block_size=8))
    prompts = random_prompts(6, hf_model.config.vocab_size, 5, 40, seed=3)
    params = {"temperature": 1.0, "max_tokens": 30, "ignore_eos": True}
    outs = await asyncio.gather(*(rollout.generate(GenerateRequest(f"s{i}", p, params))
                                  for i, p in enumerate(prompts)))
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == len(out.log_probs) == 30
        # the exact (float64) HF log-probs, within the float32 forward's error bound
        assert_within(torch.tensor(out.log_probs), *token_logprob_bounds(hf_model, prompt, out.token_ids),
                      "engine log-probs vs HF")


def test_the_logprob_bound_rejects_an_off_by_one(hf_model):
    """The bound holds any float32 forward, yet a context one token short or a top-k one too
    wide moves the log-probs far past it."""
    prompt = random_prompts(1, hf_model.config.vocab_size, 12, 12, seed=6)[0]
    response = hf_greedy(hf_model, prompt, 20)  # in every top-k
    exact, bound = token_logprob_bounds(hf_model, prompt, response)
    shorter, _ = token_logprob_bounds(hf_model, prompt[1:], response)
    assert float(((shorter - exact).abs() / bound).max()) > 10
    top5, bound5 = token_logprob_bounds(hf_model, prompt, response, temperature=0.7, top_k=5)
    top6, _ = token_logprob_bounds(hf_model, prompt, response, temperature=0.7, top_k=6)
    assert float(((top6 - top5).abs() / bound5).min()) > 10


async def test_processed_logprobs_follow_the_sampled_distribution(model_path, hf_model):
    config = RolloutConfig(kv_cache_memory_bytes=SMALL_KV, logprobs_mode="processed")
    rollout = NativeRollout.create(model_path, config)
    prompt = random_prompts(1, hf_model.config.vocab_size, 10, 10, seed=4)[0]
    params = {"temperature": 0.7, "top_k": 5, "max_tokens": 12, "ignore_eos": True}
    out = await rollout.generate(GenerateRequest("p", prompt, params))
    # log_softmax over the top 5 of logits / 0.7, exact, within the float32 error bound
    assert_within(torch.tensor(out.log_probs),
                  *token_logprob_bounds(hf_model, prompt, out.token_ids, temperature=0.7, top_k=5),
                  "processed log-probs")


async def test_seeded_requests_reproduce_whatever_the_batch(model_path):
    rollout = NativeRollout.create(model_path, RolloutConfig(kv_cache_memory_bytes=SMALL_KV))
    prompt = [5, 6, 7, 8, 9]
    params = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 16, "seed": 123, "ignore_eos": True}
    alone = await rollout.generate(GenerateRequest("a", prompt, params))
    crowd = await asyncio.gather(
        rollout.generate(GenerateRequest("b", prompt, params)),
        *(rollout.generate(GenerateRequest(f"x{i}", [9, 8, 7, i + 10], {"temperature": 1.0, "max_tokens": 10}))
          for i in range(5)))
    assert crowd[0].token_ids == alone.token_ids
    other = await rollout.generate(GenerateRequest("c", prompt, {**params, "seed": 124}))
    assert other.token_ids != alone.token_ids


async def test_stops_eos_stop_tokens_max_tokens_and_context(model_path, hf_model):
    spec_len = hf_model.config.max_position_embeddings
    rollout = NativeRollout.create(model_path, RolloutConfig(kv_cache_memory_bytes=SMALL_KV))
    prompt = [5, 6, 7, 8]
    free = await rollout.generate(GenerateRequest("f", prompt, {"temperature": 0, "max_tokens": 6}))
    assert free.stop_reason == "length" and len(free.token_ids) == 6
    stop = free.token_ids[2]
    first = free.token_ids.index(stop)
    stopped = await rollout.generate(GenerateRequest("s", prompt, {"temperature": 0, "max_tokens": 6,
                                                   "stop_token_ids": [stop]}))
    assert stopped.token_ids == free.token_ids[:first + 1]
    assert stopped.stop_reason == "completed"
    near_limit = [5] * (spec_len - 3)
    out = await rollout.generate(GenerateRequest("ctx", near_limit, {"temperature": 0, "max_tokens": 50,
                                                     "ignore_eos": True}))
    assert out.stop_reason == "length" and len(out.token_ids) == 3


async def test_eos_completes(model_path, hf_model):
    # force eos as the first token: a stop through eos, not through stop ids. The (tied) eos
    # row becomes the final hidden state after the prompt, scaled: its logit is then 10 |h|^2
    # while every other token's is at most |w| |h|, whatever the random weights are
    rollout = NativeRollout.create(model_path, RolloutConfig(kv_cache_memory_bytes=SMALL_KV))
    eos = hf_model.config.eos_token_id
    with torch.no_grad():
        hidden = hf_model.model(input_ids=torch.tensor([[5, 6, 7]])).last_hidden_state[0, -1]
    embed = rollout.runner.model.get_input_embeddings().weight
    assert float(embed.norm(dim=1).max()) < 10 * float(hidden.norm())
    with torch.no_grad():
        embed[eos] = 10.0 * hidden
    out = await rollout.generate(GenerateRequest("e", [5, 6, 7], {"temperature": 0, "max_tokens": 10}))
    assert out.token_ids[-1] == eos and out.stop_reason == "completed"
    ignored = await rollout.generate(GenerateRequest("i", [5, 6, 7], {"temperature": 0, "max_tokens": 4,
                                                      "ignore_eos": True}))
    assert len(ignored.token_ids) == 4 and ignored.stop_reason == "length"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_greedy_and_logprobs_match_hf(model_path, hf_model):
    rollout = NativeRollout.create(model_path, RolloutConfig(kv_cache_memory_bytes=SMALL_KV),
                                   device="cuda")
    prompts = random_prompts(8, hf_model.config.vocab_size, 5, 40, seed=5)
    outs = await asyncio.gather(*(rollout.generate(GenerateRequest(f"c{i}", p, {"temperature": 0, "max_tokens": 16}))
                                  for i, p in enumerate(prompts)))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_model, prompt, 16)
        assert_within(torch.tensor(out.log_probs),
                      *token_logprob_bounds(hf_model, prompt, out.token_ids), "CUDA log-probs")
    await rollout.sleep()
    assert rollout.memory_bytes() == {"weights": 0, "kv_cache": 0}
    await rollout.wake_up()
    again = await rollout.generate(GenerateRequest("again", prompts[0], {"temperature": 0, "max_tokens": 16}))
    assert again.token_ids == outs[0].token_ids



async def test_qwen3_style_qk_norm_matches_hf(tmp_path):
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    rollout = NativeRollout.create(tmp_path, RolloutConfig(kv_cache_memory_bytes=SMALL_KV))
    prompt = [5, 6, 7, 8, 9, 10]
    out = await rollout.generate(GenerateRequest("q3", prompt, {"temperature": 0, "max_tokens": 10,
                                                "ignore_eos": True}))
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                  eos_token_id=None)[0, len(prompt):].tolist()
    assert out.token_ids == expected
    assert_within(torch.tensor(out.log_probs), *token_logprob_bounds(model, prompt, out.token_ids),
                  "Qwen3 log-probs")
