"""CPU fp32: the native engine's linear layers run through oneDNN with packed weights, give the
plain path's log-probs, and follow update_weights and sleep/wake."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import tandem.rollout.engine.model_runner as model_runner
from tandem.config.schema import RolloutConfig
from tandem.models import TinyModelSpec, build_tiny_model
from tandem.rollout.engine.model_runner import PackedLinear
from tandem.rollout.native import NativeRollout

from float_bounds import assert_within, token_logprob_bounds
from tandem.types import GenerateRequest

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
PROMPTS = [[5 + i, 6, 7 + 2 * i, 8, 9, 10 + i, 11, 12, 13] * (1 + i % 3) for i in range(6)]

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="torch built without oneDNN")


@pytest.fixture(scope="module", params=["qwen2-tied", "llama-untied"])
def model_path(request):
    architecture, tying = request.param.split("-")
    return build_tiny_model(TinyModelSpec(architecture=architecture, hidden_size=128,
                                          intermediate_size=256,
                                          tie_word_embeddings=tying == "tied"))


def make(model_path, dtype: str = "float32") -> NativeRollout:
    config = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=4)
    return NativeRollout.create(model_path, config, dtype=dtype)


async def greedy_all(rollout: NativeRollout, prefix: str = "g") -> list[list[int]]:
    outs = await asyncio.gather(*(rollout.generate(GenerateRequest(f"{prefix}{i}", p, GREEDY))
                                  for i, p in enumerate(PROMPTS)))
    return [out.token_ids for out in outs]


def perturbed_state(model_path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    return {name: tensor.detach() + 0.05 * torch.randn(tensor.shape, generator=generator)
            for name, tensor in model.named_parameters()}  # a tied embedding once


def assert_packed_equal(rollout: NativeRollout, state: dict[str, torch.Tensor]) -> None:
    runner = rollout.runner
    for name, linear in runner.packed_linears.items():
        torch.testing.assert_close(linear.packed.to_dense(), state[name], atol=0, rtol=0)
    if runner.tied_lm_head:
        torch.testing.assert_close(runner.lm_head.packed.to_dense(),
                                   state["model.embed_tokens.weight"], atol=0, rtol=0)


async def test_cpu_fp32_runs_linears_through_onednn(model_path):
    rollout = make(model_path)
    runner = rollout.runner
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    linear_names = {f"{name}.weight" for name, module in hf.named_modules()
                    if isinstance(module, nn.Linear)}
    tied = hf.config.tie_word_embeddings
    assert set(runner.packed_linears) == linear_names - ({"lm_head.weight"} if tied else set())
    assert isinstance(runner.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(runner.lm_head, PackedLinear) and runner.tied_lm_head == tied
    # one copy: no dense weight is kept for a packed linear; biases stay HF parameters
    dense = runner.named_parameters()
    assert not set(runner.packed_linears) & set(dense)
    if hf.config.model_type == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in dense
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        await greedy_all(rollout)
    ops = {event.key for event in profile.key_averages()}
    assert "mkldnn::_linear_pointwise" in ops
    assert not ops & {"aten::linear", "aten::addmm", "aten::mm"}


async def test_log_probs_match_the_plain_path(model_path, monkeypatch):
    async def generate_all(rollout):
        return await asyncio.gather(*(rollout.generate(GenerateRequest(f"g{i}", p, GREEDY)) for i, p in enumerate(PROMPTS)))

    onednn = make(model_path)
    assert onednn.runner.packed_linears
    onednn_outs = await generate_all(onednn)
    monkeypatch.setattr(model_runner, "uses_onednn", lambda device, dtype: False)
    plain = make(model_path)
    assert not plain.runner.packed_linears
    plain_outs = await generate_all(plain)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for prompt, ours, theirs in zip(PROMPTS, onednn_outs, plain_outs):
        assert ours.token_ids == theirs.token_ids
        # each path within the float32 bound of the exact log-probs, so within twice it of the other
        exact, bound = token_logprob_bounds(hf, prompt, ours.token_ids)
        assert_within(torch.tensor(ours.log_probs), exact, bound, "oneDNN path")
        assert_within(torch.tensor(ours.log_probs), torch.tensor(theirs.log_probs), 2 * bound,
                      "oneDNN vs plain path")


async def test_update_weights_repacks(model_path, tmp_path):
    rollout = make(model_path)
    before = await greedy_all(rollout)
    state = perturbed_state(model_path)
    await rollout.update_weights(state.items(), version=1)
    updated = await greedy_all(rollout, prefix="u")
    assert_packed_equal(rollout, state)
    assert updated != before
    fresh_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    fresh_model.load_state_dict(state, strict=False)  # strict=False: a tied lm_head is implied
    fresh_model.save_pretrained(tmp_path)
    assert await greedy_all(make(tmp_path), prefix="f") == updated


async def test_tied_lm_head_follows_in_place_edits_of_the_embedding():
    rollout = make(build_tiny_model(TinyModelSpec(hidden_size=128, intermediate_size=256)))
    runner = rollout.runner
    assert runner.tied_lm_head
    await greedy_all(rollout)
    embedding = runner.embed_tokens.weight
    with torch.no_grad():
        embedding.mul_(2.0)
    await greedy_all(rollout, prefix="again")
    torch.testing.assert_close(runner.lm_head.packed.to_dense(), embedding, atol=0, rtol=0)


async def test_sleep_releases_packed_weights_and_refill_restores_them(model_path):
    rollout = make(model_path)
    runner = rollout.runner
    before = await greedy_all(rollout)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    state = hf.state_dict()
    hf_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    # what is held: the HF weights once, plus the tied lm_head's packed copy of the embedding
    embedding_bytes = hf.get_input_embeddings().weight.numel() * 4
    extra = embedding_bytes if runner.tied_lm_head else 0
    assert rollout.memory_bytes()["weights"] == hf_bytes + extra
    await rollout.sleep(["weights"])
    assert rollout.memory_bytes()["weights"] == 0
    assert all(linear.packed is None for linear in runner.packed_linears.values())
    assert runner.lm_head.packed is None
    await rollout.wake_up(["weights"])
    await rollout.update_weights(state.items(), version=1)
    assert await greedy_all(rollout, prefix="back") == before
    assert rollout.memory_bytes()["weights"] == hf_bytes + extra
    assert_packed_equal(rollout, state)


async def test_bfloat16_keeps_the_plain_path(model_path):
    rollout = make(model_path, dtype="bfloat16")
    assert not rollout.runner.packed_linears
    assert isinstance(rollout.runner.lm_head, nn.Linear)
    assert len((await rollout.generate(GenerateRequest("b", PROMPTS[0], GREEDY))).token_ids) == 12


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
async def test_non_finite_packed_linear_weight_is_rejected(model_path, bad):
    """Packed linears are staged straight into the packed layout; the value check still sees
    every element of the weight sent, and the engine keeps its version."""
    rollout = make(model_path)
    before = await greedy_all(rollout)
    state = perturbed_state(model_path)
    name = "model.layers.0.mlp.down_proj.weight"
    assert name in rollout.runner.packed_linears
    state[name] = state[name].index_fill(1, torch.tensor([state[name].shape[1] - 1]), bad)
    with pytest.raises(ValueError, match=f"{name!r} holds NaN or inf"):
        await rollout.update_weights(state.items(), version=1)
    assert rollout.weight_version == 0
    assert await greedy_all(rollout, prefix="after") == before
