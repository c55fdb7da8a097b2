"""The tensor-parallel native engine (rollout.tensor_model_parallel_size=2: rank 0 in this process,
rank 1 a worker process) against the one-rank engine on tiny fp32 models: greedy tokens, logprobs
within the float32 bound, seeds, abort, resharded weight updates (all or nothing across ranks),
sleep/wake, shutdown and a dead rank. The resharding plan itself is checked without processes."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

from float_bounds import assert_within, token_logprob_bounds
from tandem.config.choices import ConfigError
from tandem.config.load import load_config
from tandem.config.schema import RolloutConfig
from tandem.models import TinyModelSpec, build_tiny_model
from tandem.preflight import check_model_fit
from tandem.rollout.engine import rank_worker
from tandem.rollout.engine.tensor_parallel import ShardLayout, reshard
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest, WeightPatch

GREEDY = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
# qwen2: 4 query heads, 2 KV heads (one per rank), tied embeddings, q/k/v biases.
# llama-kv1: one KV head (replicated on both ranks), an untied lm_head, an odd vocabulary
# (1031 rows: 516 on rank 0, 515 on rank 1).
SPECS = {"qwen2": TinyModelSpec(),
         "llama-kv1": TinyModelSpec(architecture="llama", num_key_value_heads=1, vocab_size=1031,
                                    tie_word_embeddings=False)}


@pytest.fixture(scope="module", params=list(SPECS))
def model_path(request):
    return build_tiny_model(SPECS[request.param])


@pytest.fixture(scope="module")
def qwen2_path():
    return build_tiny_model(SPECS["qwen2"])


def make(model_path, tp: int, device: str = "cpu", **overrides) -> NativeRollout:
    config = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=4,
                           tensor_model_parallel_size=tp, **overrides)
    return NativeRollout.create(model_path, config, device=device)


def random_prompts(count: int, vocab: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(low, high))]
            for _ in range(count)]


async def run_all(rollout: NativeRollout, prompts: list[list[int]], params: dict,
                  prefix: str = "r", stagger_s: float = 0.0) -> list:
    async def one(index: int, prompt: list[int]):
        await asyncio.sleep(stagger_s * index)
        return await rollout.generate(GenerateRequest(f"{prefix}{index}", prompt, params))

    return await asyncio.gather(*(one(index, prompt) for index, prompt in enumerate(prompts)))


def rank_slices(rollout: NativeRollout) -> list[dict[str, torch.Tensor]]:
    """What every rank serves, rank 0 first (dense copies of its slices)."""
    runner = rollout.runner
    names = list(rollout.ranks.weights()[0])
    own = {name: runner.dense_weight(name).to("cpu", copy=True) for name in names}
    return [own] + rollout.ranks.weights()


def expected_slices(rollout: NativeRollout, state: dict[str, torch.Tensor]
                    ) -> list[dict[str, torch.Tensor]]:
    """Each rank's slice of the full `state`, by the resharding plan (a tied lm_head is the
    embedding)."""
    layouts = rollout.runner.tensor_parallel.layout.all_ranks()
    full = {name: state[name] for name in rollout.runner.full_shapes}
    return [{name: layout.slice(name, tensor) for name, tensor in full.items()}
            for layout in layouts]


def assert_ranks_hold(rollout: NativeRollout, state: dict[str, torch.Tensor]) -> None:
    for rank, (held, expected) in enumerate(zip(rank_slices(rollout),
                                                expected_slices(rollout, state))):
        assert held.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(held[name], tensor.to(held[name].dtype)), (rank, name)


def perturbed_model(model_path, directory, seed: int = 1) -> dict[str, torch.Tensor]:
    """A copy of the model (saved in `directory`) with every parameter moved by seeded noise;
    returns its state dict (a tied lm_head is the same tensor as the embedding)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(directory)
    return model.state_dict()


# ---- generation -------------------------------------------------------------------------
async def test_greedy_equals_one_rank_with_batching_and_the_prefix_cache(model_path):
    """Staggered arrivals, chunked prefill mixed with decode, and prompts sharing a prefix
    (prefix-cache hits): the same tokens as TP=1. The log-probs: the TP forward is a float32
    evaluation of the same model whose row-parallel dot products are summed in another order
    (each rank's partial sum, then the all-reduce's sum of TP terms), the vocab-parallel
    embedding's sum adds exact zeros and the logits gather copies: so the bound that holds any
    float32 forward in any summation order (float_bounds.token_logprob_bounds) holds both
    engines, and they differ by at most twice it."""
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    shared = random_prompts(1, vocab, 13, 13, seed=7)[0]
    prompts = (random_prompts(8, vocab, 3, 50, seed=5)
               + [shared + tail for tail in random_prompts(4, vocab, 1, 9, seed=6)])
    overrides = dict(max_num_batched_tokens=40, max_num_seqs=6)
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    one = await run_all(make(model_path, 1, **overrides), prompts, params, stagger_s=0.005)
    two_ranks = make(model_path, 2, **overrides)
    try:
        two = await run_all(two_ranks, prompts, params, stagger_s=0.005)
        assert two_ranks.stats()["prompt_tokens_cached"] >= 3 * 12  # 3 prompts x 3 shared blocks
    finally:
        await two_ranks.shutdown()
    assert [out.token_ids for out in two] == [out.token_ids for out in one]
    assert len({tuple(out.token_ids) for out in two}) > 6  # not one degenerate continuation
    for index in (0, 3, 8, 11):
        exact, bound = token_logprob_bounds(hf, prompts[index], two[index].token_ids)
        assert_within(torch.tensor(two[index].log_probs), exact, bound, "TP=2 vs exact")
        assert_within(torch.tensor(two[index].log_probs), torch.tensor(one[index].log_probs),
                      2 * bound, "TP=2 vs TP=1")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_on_cuda_greedy_equals_one_rank_and_an_update_reaches_every_rank(model_path,
                                                                              tmp_path):
    """TP=2 on CUDA (on one GPU the ranks share it and compute over gloo, rank_devices): the
    same greedy tokens as TP=1 on CUDA, log-probs within the float32 bound of the exact forward,
    and a resharded update lands on both ranks."""
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompts = random_prompts(6, hf.config.vocab_size, 3, 40, seed=11)
    one = await run_all(make(model_path, 1, "cuda"), prompts, GREEDY)
    two_ranks = make(model_path, 2, "cuda")
    try:
        two = await run_all(two_ranks, prompts, GREEDY)
        new_state = perturbed_model(model_path, tmp_path / "new")
        await two_ranks.update_weights(new_state.items(), version=1)
        assert_ranks_hold(two_ranks, new_state)
        updated = await run_all(two_ranks, prompts, GREEDY, prefix="u")
    finally:
        await two_ranks.shutdown()
    assert [out.token_ids for out in two] == [out.token_ids for out in one]
    for prompt, out in zip(prompts, two):
        assert_within(torch.tensor(out.log_probs),
                      *token_logprob_bounds(hf, prompt, out.token_ids), "TP=2 on CUDA vs exact")
    fresh = await run_all(make(tmp_path / "new", 1, "cuda"), prompts, GREEDY)
    assert [out.token_ids for out in updated] == [out.token_ids for out in fresh]
    assert all(out.extra_fields["global_steps"] == 1 for out in updated)


def test_cuda_ranks_take_gpus_of_their_own_or_share_one(monkeypatch, caplog):
    """Consecutive GPUs when there are enough; all on one (logged) when there are not."""
    from tandem.rollout.engine.tensor_parallel import rank_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert rank_devices(torch.device("cuda", 1), 2) == [torch.device("cuda", 1),
                                                        torch.device("cuda", 2)]
    assert rank_devices(torch.device("cpu"), 3) == [torch.device("cpu")] * 3
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with caplog.at_level("WARNING"):
        assert rank_devices(torch.device("cuda"), 2) == [torch.device("cuda", 0)] * 2
    assert "share cuda:0" in caplog.text and "gloo" in caplog.text


async def test_seeded_sampling_reproduces(qwen2_path):
    prompt = [15, 16, 17, 18, 19]
    params = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 16, "seed": 123,
              "ignore_eos": True}
    reference = await make(qwen2_path, 1).generate(GenerateRequest("a", prompt, params))
    rollout = make(qwen2_path, 2)
    try:
        alone = await rollout.generate(GenerateRequest("a", prompt, params))
        crowd = await asyncio.gather(
            rollout.generate(GenerateRequest("b", prompt, params)),
            *(rollout.generate(GenerateRequest(f"x{i}", [40, 41, i + 50],
                                               {"temperature": 1.0, "max_tokens": 10}))
              for i in range(5)))
        other = await rollout.generate(GenerateRequest("c", prompt, {**params, "seed": 124}))
    finally:
        await rollout.shutdown()
    assert alone.token_ids == crowd[0].token_ids == reference.token_ids
    assert other.token_ids != alone.token_ids


async def test_abort_mid_generation_keeps_the_ranks_in_step(qwen2_path):
    rollout = make(qwen2_path, 2)
    try:
        before = await rollout.generate(GenerateRequest("g", [20, 21, 22], GREEDY))
        long = asyncio.create_task(rollout.generate(GenerateRequest(
            "long", [30, 31, 32], {"temperature": 1.0, "max_tokens": 1000, "ignore_eos": True})))
        while rollout.stats()["generated_tokens"] < before.token_ids.__len__() + 5:
            await asyncio.sleep(0.001)
        await rollout.abort("long")
        out = await long
        assert out.stop_reason == "aborted" and 5 <= len(out.token_ids) < 1000
        assert len(out.log_probs) == len(out.token_ids)
        after = await rollout.generate(GenerateRequest("g2", [20, 21, 22], GREEDY))
        assert after.token_ids == before.token_ids
    finally:
        await rollout.shutdown()


def test_a_loop_that_ends_mid_step_leaves_the_ranks_in_step(qwen2_path, monkeypatch):
    """The caller's event loop ends while rank 0 is between two layers of a step (the worker is
    inside the same step): rank 0 finishes the step with it before the cancellation goes on, so
    the next loop's steps still meet in the same collectives."""
    import tandem.rollout.engine.async_engine as async_engine

    monkeypatch.setattr(async_engine, "YIELD_EVERY_S", 0.0)  # every step yields between layers
    rollout = make(qwen2_path, 2)
    runner = rollout.runner
    real_forward = runner.forward_layers
    inside = []

    def watched(plan):
        inside.append(True)
        try:
            return (yield from real_forward(plan))
        finally:
            inside.clear()

    runner.forward_layers = watched
    reference = asyncio.run(rollout.generate(GenerateRequest("a", [20, 21, 22], GREEDY)))

    async def leave_mid_step() -> None:
        asyncio.create_task(rollout.generate(GenerateRequest(
            "long", [30, 31], {"max_tokens": 10_000, "ignore_eos": True})))
        while rollout.stats()["generated_tokens"] < len(reference.token_ids) + 3 or not inside:
            await asyncio.sleep(0)
        # returns inside a step: asyncio.run cancels the engine's task between two layers

    asyncio.run(leave_mid_step())
    again = asyncio.run(rollout.generate(GenerateRequest("b", [20, 21, 22], GREEDY)))
    assert again.token_ids == reference.token_ids
    asyncio.run(rollout.shutdown())


# ---- weights ----------------------------------------------------------------------------
async def test_weight_update_delivers_each_rank_its_slice(model_path, tmp_path):
    new_state = perturbed_model(model_path, tmp_path / "new")
    prompts = random_prompts(4, AutoModelForCausalLM.from_pretrained(model_path).config.vocab_size,
                             4, 20, seed=9)
    rollout = make(model_path, 2)
    try:
        old = await run_all(rollout, prompts, GREEDY)
        await rollout.update_weights(new_state.items(), version=1)
        assert_ranks_hold(rollout, new_state)
        updated = await run_all(rollout, prompts, GREEDY, prefix="u")
    finally:
        await rollout.shutdown()
    fresh = await run_all(make(tmp_path / "new", 1), prompts, GREEDY)
    assert [out.token_ids for out in updated] == [out.token_ids for out in fresh]
    assert [out.token_ids for out in updated] != [out.token_ids for out in old]
    assert all(out.extra_fields["global_steps"] == 1 for out in updated)


def test_the_resharding_plan_sends_each_rank_a_share(model_path):
    """Every weight split over the ranks reassembles into the full one; each rank receives
    1/TP of the split weights' bytes plus the replicated ones (norms), none twice."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    state = model.state_dict()
    full_shapes = {name: p.shape for name, p in model.named_parameters()}
    head_dim = model.model.layers[0].self_attn.head_dim
    layouts = ShardLayout.of(model.config, head_dim, 0, 2).all_ranks()
    alias = {"lm_head.weight": "model.embed_tokens.weight"} if "lm_head.weight" not in full_shapes \
        else {}
    received = [0, 0]
    split_bytes = replicated_bytes = 0
    for name, parts in reshard([(n, t) for n, t in state.items() if n in full_shapes],
                               layouts, full_shapes, alias):
        full = state[name]
        for rank, part in enumerate(parts):
            received[rank] += part.numel() * part.element_size()
        if all(part is full for part in parts):
            replicated_bytes += full.numel() * full.element_size()
            assert name.endswith("norm.weight"), name
            continue
        split_bytes += full.numel() * full.element_size()
        leaf = name.rsplit(".", 2)[-2]
        dim = 1 if leaf in ("o_proj", "down_proj") else 0
        if leaf in ("k_proj", "v_proj") and model.config.num_key_value_heads < 2:
            assert all(torch.equal(part, full) for part in parts)  # one KV head on both ranks
            split_bytes -= full.numel() * full.element_size()
            replicated_bytes += full.numel() * full.element_size()
        else:
            assert torch.equal(torch.cat(parts, dim=dim), full), name
    vocab = model.config.vocab_size
    odd = vocab % 2 * model.config.hidden_size * 4 * (1 if model.config.tie_word_embeddings
                                                        else 2)  # rank 0's extra vocab row(s)
    assert received[0] == split_bytes // 2 + replicated_bytes + odd // 2
    assert received[1] == split_bytes // 2 + replicated_bytes - odd // 2
    with pytest.raises(ValueError, match="unknown weight"):
        list(reshard([("model.nope.weight", torch.zeros(1))], layouts, full_shapes, alias))
    with pytest.raises(ValueError, match="has shape"):
        list(reshard([("model.norm.weight", torch.zeros(3))], layouts, full_shapes, alias))


def test_row_parallel_bias_is_added_once():
    layout = ShardLayout(rank=0, size=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, vocab_size=100)
    bias = torch.arange(64.0)
    parts = [each.slice("model.layers.0.self_attn.o_proj.bias", bias)
             for each in layout.all_ranks()]
    assert torch.equal(parts[0], bias) and torch.equal(parts[1], torch.zeros(64))
    with pytest.raises(ValueError, match="num_attention_heads=4 do not split over 3"):
        ShardLayout.of(type("Config", (), dict(num_attention_heads=4, num_key_value_heads=2,
                                                intermediate_size=128, vocab_size=100)), 16, 0, 3)


async def test_a_failed_update_on_one_rank_leaves_every_rank_on_the_old_version(qwen2_path):
    state = AutoModelForCausalLM.from_pretrained(qwen2_path, dtype=torch.float32).state_dict()
    rollout = make(qwen2_path, 2)
    try:
        before = await rollout.generate(GenerateRequest("b", [20, 21, 22], GREEDY))
        held = rank_slices(rollout)
        name = "model.layers.1.self_attn.q_proj.weight"

        def with_nan(row: int) -> dict[str, torch.Tensor]:
            bad = {key: value.clone() for key, value in state.items()}
            bad[name][row, 0] = float("nan")
            return bad

        rows = state[name].shape[0]
        # rank 1's rows only: rank 0 stages fine, rank 1 refuses, nobody installs
        with pytest.raises(ValueError, match=r"rank\(s\) refused their slices \{1: .*NaN"):
            await rollout.update_weights(with_nan(rows - 1).items(), version=1)
        with pytest.raises(ValueError, match="NaN"):  # rank 0's rows: refused at staging
            await rollout.update_weights(with_nan(0).items(), version=1)
        wrong = dict(state)
        wrong["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
        with pytest.raises(ValueError, match="has shape"):
            await rollout.update_weights(wrong.items(), version=1)
        assert rollout.weight_version == 0
        for rank, (now, then) in enumerate(zip(rank_slices(rollout), held)):
            assert all(torch.equal(now[key], then[key]) for key in then), rank
        again = await rollout.generate(GenerateRequest("a", [20, 21, 22], GREEDY))
        assert again.token_ids == before.token_ids
        assert again.extra_fields["global_steps"] == 0
        await rollout.update_weights(state.items(), version=2)  # a good one still lands
        assert rollout.weight_version == 2
    finally:
        await rollout.shutdown()


async def test_weight_slot_regions_are_each_ranks_slices(model_path):
    """The double-buffered slots of a replica: every entry's region of the full tensor is the
    slice its rank serves (the transfer itself: test_engine_tensor_parallel_slots.py)."""
    rollout = make(model_path, 2)
    try:
        specs, _, regions = rollout.weight_slot_specs()
        shapes = {name: shape for name, shape, _ in specs}
        assert shapes.keys() == regions.keys()
        layouts = rollout.runner.tensor_parallel.layout.all_ranks()
        for entry, (source, dim, start, stop) in regions.items():
            rank = int(entry.partition("@")[2] or 0)
            shape = rollout.runner.full_shapes[source]
            full = torch.arange(shape.numel(), dtype=torch.float32).reshape(shape)
            expected = layouts[rank].slice(source, full)
            assert torch.equal(full.narrow(dim, start, stop - start), expected), entry
            assert shapes[entry] == tuple(expected.shape), entry
        assert {int(entry.partition("@")[2] or 0) for entry in regions} == {0, 1}
    finally:
        await rollout.shutdown()


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_a_delta_patch_cut_per_rank_patches_each_slice_exactly(kv_heads):
    """Every kind of region (rows, columns, vocabulary, replicated, a row-parallel bias held by
    rank 0 only): each rank's part of a patch, applied to its slice, gives the slice of the
    patched full weight."""
    layout = ShardLayout(rank=0, size=2, num_heads=4, num_kv_heads=kv_heads, head_dim=16,
                         intermediate_size=128, vocab_size=101)
    shapes = {"model.layers.0.self_attn.q_proj.weight": (64, 64),
              "model.layers.0.self_attn.k_proj.weight": (16 * kv_heads, 64),
              "model.layers.0.self_attn.o_proj.weight": (64, 64),
              "model.layers.0.self_attn.o_proj.bias": (64,),
              "model.layers.0.mlp.down_proj.weight": (64, 128),
              "model.embed_tokens.weight": (101, 64), "model.norm.weight": (64,)}
    generator = torch.Generator().manual_seed(3)
    for name, shape in shapes.items():
        full = torch.randn(shape, generator=generator)
        index = torch.randperm(full.numel(), generator=generator)[:full.numel() // 7]
        patch = WeightPatch(index, torch.randn(index.shape, generator=generator))
        patched = full.clone()
        patch.apply_to(patched)
        for each in layout.all_ranks():
            part = each.patch_part(name, patch, torch.Size(shape))
            local = each.slice(name, full).clone()
            if part is None:
                assert name.endswith("o_proj.bias") and each.rank == 1
            else:
                part.apply_to(local)
            assert torch.equal(local, each.slice(name, patched)), (name, each.rank)


async def test_the_split_weights_read_back_whole_from_the_loop_and_from_a_sync_thread(
        model_path):
    """current_weight assembles every rank's slice; current_values reads each position from
    the rank holding it, also from another thread while requests generate (between steps)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    state = model.state_dict()
    rollout = make(model_path, 2)
    try:
        for name in rollout.runner.full_shapes:
            assert torch.equal(rollout.current_weight(name), state[name]), name
        prompts = random_prompts(6, model.config.vocab_size, 4, 12, seed=4)
        running = asyncio.ensure_future(run_all(rollout, prompts, {**GREEDY, "max_tokens": 40}))
        generator = torch.Generator().manual_seed(5)

        def read_all() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
            read = {}
            for name in rollout.runner.full_shapes:
                index = torch.randint(0, state[name].numel(), (50,), generator=generator)
                read[name] = index, rollout.current_values(name, index)
            return read

        await asyncio.sleep(0.05)
        read = await asyncio.to_thread(read_all)
        outputs = await running
        for name, (index, values) in read.items():
            assert torch.equal(values, state[name].reshape(-1)[index]), name
        assert all(len(output.token_ids) == 40 for output in outputs)
    finally:
        await rollout.shutdown()


# ---- memory, processes ------------------------------------------------------------------
async def test_sleep_and_wake_reach_every_rank(qwen2_path):
    state = AutoModelForCausalLM.from_pretrained(qwen2_path, dtype=torch.float32).state_dict()
    rollout = make(qwen2_path, 2)
    try:
        before = await rollout.generate(GenerateRequest("b", [20, 21, 22], GREEDY))
        per_rank = rollout.ranks.memory[0]
        assert rollout.memory_bytes()["kv_cache"] == 2 * per_rank["kv_cache"] > 0
        running = asyncio.create_task(rollout.generate(GenerateRequest(
            "r", [20, 21, 22], {**GREEDY, "max_tokens": 200})))
        while rollout.stats()["generated_tokens"] < len(before.token_ids) + 3:
            await asyncio.sleep(0.001)
        await rollout.sleep(["kv_cache"])  # preempts the running request on every rank
        assert rollout.memory_bytes()["kv_cache"] == 0 and rollout.ranks.memory[0]["kv_cache"] == 0
        await rollout.wake_up(["kv_cache"])
        assert (await running).token_ids[:len(before.token_ids)] == before.token_ids
        await rollout.sleep()
        assert rollout.memory_bytes() == {"weights": 0, "kv_cache": 0}
        await rollout.wake_up()
        with pytest.raises(RuntimeError, match="update_weights"):
            await rollout.generate(GenerateRequest("x", [20, 21], GREEDY))
        await rollout.update_weights(state.items(), version=1)
        assert rollout.ranks.memory[0]["weights"] > 0
        assert_ranks_hold(rollout, state)
        after = await rollout.generate(GenerateRequest("a", [20, 21, 22], GREEDY))
        assert after.token_ids == before.token_ids
    finally:
        await rollout.shutdown()


def started_workers(monkeypatch) -> list[subprocess.Popen]:
    """Record the worker processes rank 0 starts."""
    started = []
    real = rank_worker.subprocess.Popen

    def recorded(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(rank_worker.subprocess, "Popen", recorded)
    return started


def gone(process: subprocess.Popen) -> bool:
    if process.poll() is None:
        return False
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_shutdown_leaves_no_process_behind(qwen2_path, monkeypatch):
    workers = started_workers(monkeypatch)
    rollout = make(qwen2_path, 2)
    task = asyncio.create_task(rollout.generate(GenerateRequest(
        "s", [20, 21], {"max_tokens": 10_000, "ignore_eos": True})))
    while rollout.stats()["generated_tokens"] < 2:
        await asyncio.sleep(0.001)
    await rollout.shutdown()
    assert (await task).stop_reason == "aborted"
    assert len(workers) == 1 and all(gone(process) for process in workers)
    # a model that does not split: refused by name, and the started worker is gone too
    workers.clear()
    with pytest.raises(ValueError, match="num_attention_heads=4 do not split over 3 ranks"):
        make(qwen2_path, 3)
    assert len(workers) == 2 and all(gone(process) for process in workers)


async def test_a_dead_rank_takes_the_replica_out_with_a_clear_error(qwen2_path, monkeypatch):
    workers = started_workers(monkeypatch)
    rollout = make(qwen2_path, 2)
    try:
        await rollout.generate(GenerateRequest("a", [20, 21], GREEDY))
        os.kill(workers[0].pid, signal.SIGKILL)
        workers[0].wait(10)
        with pytest.raises(RuntimeError, match="tensor-parallel replica failed"):
            await asyncio.wait_for(rollout.generate(GenerateRequest("b", [20, 21], GREEDY)), 60)
        with pytest.raises(RuntimeError, match=r"rank 1 exited \(code -9\)"):
            await rollout.generate(GenerateRequest("c", [20, 21], GREEDY))
    finally:
        await asyncio.wait_for(rollout.shutdown(), 60)


# ---- configuration ----------------------------------------------------------------------
def test_the_preflight_refuses_a_model_that_does_not_split(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 192,
        "vocab_size": 1000, "max_position_embeddings": 1024}))
    standalone = ["trainer.trainer_mode=separate_async", "data.train_batch_size=8",
                  "actor.ppo_mini_batch_size=8", "rollout.nnodes=1", f"model.path={model}"]
    check_model_fit(load_config(overrides=[*standalone, "rollout.tensor_model_parallel_size=3",
                                           "rollout.n_gpus_per_node=3"]))
    with pytest.raises(ConfigError, match="num_attention_heads=6 does not split over 4 ranks"):
        check_model_fit(load_config(overrides=[
            *standalone, "rollout.tensor_model_parallel_size=4", "rollout.n_gpus_per_node=4"]))
    with pytest.raises(ConfigError, match="num_key_value_heads=3 does not split over 2 ranks"):
        check_model_fit(load_config(overrides=[
            *standalone, "rollout.tensor_model_parallel_size=2", "rollout.n_gpus_per_node=2"]))
