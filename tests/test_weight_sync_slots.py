"""The double-buffered same-host handoff: a sender process writes the native engine's inactive
weight slot while it generates; the engine flips between two steps."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import cpu_kernels
from tandem.config.schema import RolloutConfig
from tandem.models import build_tiny_model
from tandem.rollout.native import NativeRollout
from tandem.serving.server import RolloutServer
from tandem.types import GenerateRequest
from tandem.weight_sync.base import WeightSyncError
from tandem.weight_sync.registry import engine_kwargs_problem
from tandem.weight_sync.slots import byte_sum, write_and_sum
from weight_sync_procs import Worker, build_sender, run_sender

ROLLOUT = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=16)
GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
KWARGS = {"bucket_megabytes": 1, "timeout_s": 10.0}
ANSWER_S = 120


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


@pytest.fixture
def sender():
    worker = Worker()
    yield worker
    worker.close()


def actor_state(model_path, seed: int) -> dict[str, torch.Tensor]:
    """The tiny model's weights after a random step (what a trainer would send)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()
            if not (name == "lm_head.weight" and model.config.tie_word_embeddings)}


def generated(server: RolloutServer) -> int:
    return server.stats()["backend"]["generated_tokens"]


async def greedy(target, prefix: str) -> list[list[int]]:
    outputs = [await target.generate(GenerateRequest(f"{prefix}{i}", prompt, GREEDY))
               for i, prompt in enumerate(PROMPTS)]
    return [output.token_ids for output in outputs]


async def fresh_engine_tokens(model_path, state, directory) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    model.save_pretrained(directory)
    fresh = NativeRollout.create(directory, ROLLOUT)
    try:
        return await greedy(fresh, "fresh")
    finally:
        await fresh.shutdown()


async def start_server(model_path, rollout: RolloutConfig = ROLLOUT) -> RolloutServer:
    server = RolloutServer("slots")
    await server.start(NativeRollout, model_path, rollout)
    return server


async def plan_for(sender: Worker, server: RolloutServer, version: int, key: str = "db"):
    slots = await server.weight_slots({})
    sender.submit(build_sender, key, "shm", KWARGS, 1, version, [server.backend.weight_version],
                  [slots])
    plan = await asyncio.to_thread(sender.result, ANSWER_S)
    assert plan.details["slots"] == [slots]
    return plan


async def test_generation_goes_on_during_the_write_and_straddling_requests_see_both(
        model_path, sender, tmp_path):
    server = await start_server(model_path)
    try:
        plan = await plan_for(sender, server, 1)
        state = actor_state(model_path, 1)
        long = {"temperature": 0.0, "max_tokens": 1900, "ignore_eos": True}  # outlasts the write
        running = [asyncio.create_task(server.generate(GenerateRequest(f"long{i}", prompt, long)))
                   for i, prompt in enumerate(PROMPTS)]
        while generated(server) < 4:
            await asyncio.sleep(0.005)
        inactive = server._slots.slots[plan.details["slots"][0].inactive]
        sender.submit(run_sender, "db", plan, state, None, "cpu", 0.03)  # a slow writer
        receive = asyncio.create_task(server.receive_weights(plan, 1, {}))
        during = []  # tokens generated once the new version's bytes were landing, before the flip
        while not receive.done():
            if server.backend.weight_version == 0 and bool(inactive.any()):
                during.append(generated(server))
            await asyncio.sleep(0.005)
        timings = await receive
        sent = await asyncio.to_thread(sender.result, ANSWER_S)
        assert not sent["error"], sent
        assert len(during) >= 2 and during[-1] > during[0], during  # no pause for the write
        assert timings["version"] == 1 and server.backend.weight_slot_active == 1
        assert timings["flip"] < timings["receive"]
        flipped_at = generated(server)
        while generated(server) < flipped_at + 4:
            await asyncio.sleep(0.005)
        await server.abort_all_requests()  # partial outputs carry their per-token versions
        await server.resume_generation()
        for output in await asyncio.gather(*running):
            assert output.stop_reason == "aborted", "finished before the flip: lengthen the write"
            assert [version for version, _ in output.version_runs] == [0, 1], output.version_runs
        expected = await fresh_engine_tokens(model_path, state, tmp_path)
        assert await greedy(server, "after") == expected
    finally:
        await server.shutdown()


async def test_a_writer_killed_mid_version_leaves_the_old_one_and_the_next_sync_succeeds(
        model_path, tmp_path):
    server = await start_server(model_path)
    dying, second = Worker(), Worker()
    try:
        before = await greedy(server, "before")
        plan = await plan_for(dying, server, 1, "dying")
        dying.submit(run_sender, "dying", plan, actor_state(model_path, 1), 5)
        with pytest.raises(WeightSyncError) as failure:
            await server.receive_weights(plan, 1, {})
        assert failure.value.phase == "receive" and failure.value.peer == "sender"
        assert server.backend.weight_version == 0 and server.backend.weight_slot_active == 0
        assert await greedy(server, "still") == before  # the old, whole version serves

        plan = await plan_for(second, server, 1, "second")
        assert plan.details["slots"][0].inactive == 1  # the torn slot is written again
        state = actor_state(model_path, 2)
        second.submit(run_sender, "second", plan, state)
        timings = await server.receive_weights(plan, 1, {})
        assert not (await asyncio.to_thread(second.result, ANSWER_S))["error"]
        assert timings["version"] == 1 and server.backend.weight_slot_active == 1
        assert await greedy(server, "after") == await fresh_engine_tokens(model_path, state,
                                                                           tmp_path)
    finally:
        await server.shutdown()
        dying.close()
        second.close()


@pytest.mark.parametrize("in_flight_kv", ["recompute", "keep"])
async def test_running_requests_recompute_or_keep_their_kv_cache_at_the_flip(
        model_path, sender, tmp_path, in_flight_kv):
    """recompute: the flip preempts the running requests (their prompt and tokens are computed
    again, with the new weights); keep: they go on from their cache. Both record both versions,
    and a new request after the flip matches a fresh engine (the prefix cache is not reused)."""
    server = await start_server(model_path, dataclasses.replace(ROLLOUT, in_flight_kv=in_flight_kv))
    try:
        plan = await plan_for(sender, server, 1)
        state = actor_state(model_path, 1)
        long = {"temperature": 0.0, "max_tokens": 1900, "ignore_eos": True}
        running = [asyncio.create_task(server.generate(GenerateRequest(f"long{i}", prompt, long)))
                   for i, prompt in enumerate(PROMPTS)]
        while generated(server) < 8:
            await asyncio.sleep(0.005)
        before = server.stats()["backend"]  # both prompts computed, decoding
        sender.submit(run_sender, "db", plan, state)
        await server.receive_weights(plan, 1, {})
        assert not (await asyncio.to_thread(sender.result, ANSWER_S))["error"]
        flipped_at = generated(server)
        while generated(server) < flipped_at + 4:
            await asyncio.sleep(0.005)
        after = server.stats()["backend"]
        await server.abort_all_requests()
        await server.resume_generation()
        for output in await asyncio.gather(*running):
            assert [version for version, _ in output.version_runs] == [0, 1], output.version_runs
        recomputed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
        preempted = after["preemptions"] - before["preemptions"]
        if in_flight_kv == "keep":
            assert preempted == 0 and recomputed == 0
        else:  # every running request was preempted by the flip and computed its context again
            assert preempted == len(PROMPTS) and recomputed >= sum(map(len, PROMPTS))
        expected = await fresh_engine_tokens(model_path, state, tmp_path)
        assert await greedy(server, "after") == expected
    finally:
        await server.shutdown()


def test_in_flight_kv_is_checked_at_load_time():
    from tandem.config.choices import ConfigError
    from tandem.config.load import load_config

    standalone = ["rollout.nnodes=1", "rollout.n_gpus_per_node=1"]  # shm into its own engine
    keep = load_config(overrides=[*standalone, "rollout.in_flight_kv=keep"])
    assert keep.rollout.in_flight_kv == "keep"
    with pytest.raises(ConfigError, match="rollout.in_flight_kv.*recompute, keep"):
        load_config(overrides=["rollout.in_flight_kv=reuse"])
    with pytest.raises(ConfigError, match="rollout.in_flight_kv.*native engine's.*recompute"):
        load_config(overrides=[*standalone, "rollout.in_flight_kv=keep", "rollout.name=vllm"])


async def test_double_buffer_true_is_refused_when_two_copies_do_not_fit(model_path, monkeypatch):
    import tandem.serving.server as server_module

    server = await start_server(model_path)
    try:
        monkeypatch.setattr(server_module, "slots_fit", lambda nbytes, shm_dir: "too small")
        with pytest.raises(ValueError, match="engine_kwargs.double_buffer is true.*set it false"):
            await server.weight_slots({"double_buffer": True})
        assert await server.weight_slots({}) is None  # unset: the plain path where it does not fit
        assert await server.weight_slots({"double_buffer": False}) is None
    finally:
        await server.shutdown()


def test_double_buffer_options_are_checked_at_load_time():
    assert engine_kwargs_problem("shm", {"double_buffer": True}) is None
    assert "true, false" in engine_kwargs_problem("shm", {"double_buffer": "yes"})
    assert "device cuda" in engine_kwargs_problem("shm", {"double_buffer": True, "device": "cuda"})
    assert "double_buffer" in engine_kwargs_problem("delta", {"double_buffer": True})


def word_sum(data: bytes) -> int:
    """byte_sum's definition in plain Python: little-endian int64 words, last zero-padded."""
    padded = data + bytes(-len(data) % 8)
    total = sum(int.from_bytes(padded[i:i + 8], "little") for i in range(0, len(padded), 8))
    return (total + 2**63) % 2**64 - 2**63


# byte lengths around the kernel's 128-byte streaming block, its 8-byte words and its 256 KiB
# streaming threshold and 1 MiB pieces; destination offsets aligned (32) and not (8; 1 for the
# kernel, whose callers' pointers are anything; the torch path views words, as slot entries allow)
SIZES = (0, 1, 7, 8, 9, 127, 128, 129, 1000, (1 << 18) + 13, (3 << 20) + 5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
def test_write_and_sum_copies_every_byte_and_returns_the_word_sum(fused, monkeypatch):
    if fused and (os.environ.get(cpu_kernels.ENV_SWITCH) == "0" or shutil.which("c++") is None):
        pytest.skip("the fused kernels are off or cannot be built here")
    if fused:  # built now if no test built them yet: a sync only uses a finished build
        assert cpu_kernels.load() is not None, cpu_kernels.unavailable_reason()
    else:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    generator = torch.Generator().manual_seed(3)
    for nbytes in SIZES:
        source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
        expected = word_sum(bytes(source.tolist())) if nbytes < 4096 else None
        for offset in (0, 1, 8, 32) if fused else (0, 8, 32):
            buffer = torch.full((nbytes + offset + 8,), 0xAB, dtype=torch.uint8)
            destination = buffer[offset:offset + nbytes]
            got = write_and_sum(destination, source)
            assert torch.equal(destination, source), (nbytes, offset)
            assert (buffer[:offset] == 0xAB).all() and (buffer[offset + nbytes:] == 0xAB).all()
            assert got == byte_sum(destination) == byte_sum(source), (nbytes, offset)
            if expected is not None:
                assert got == expected, (nbytes, offset)


def test_write_and_sum_casts_into_the_slot_dtype():
    """A cast (fp32 actor into a bf16 slot) takes the torch path; the sum is of the cast bytes."""
    source = torch.randn(1001, generator=torch.Generator().manual_seed(4))
    destination = torch.empty(1001, dtype=torch.bfloat16)
    got = write_and_sum(destination, source)
    assert torch.equal(destination, source.to(torch.bfloat16))
    assert got == word_sum(destination.view(torch.uint8).numpy().tobytes())


def test_a_sync_never_waits_for_a_kernel_build(tmp_path, monkeypatch):
    """Without a finished build, load_built() answers None at once (the torch path) and compiles
    nothing; with one, it loads it."""
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_kernels, "build_directory", lambda: tmp_path)
    monkeypatch.setattr(cpu_kernels, "_compile", lambda build_dir: pytest.fail("compiled"))
    monkeypatch.delenv(cpu_kernels.ENV_SWITCH, raising=False)
    assert cpu_kernels.load_built() is None and cpu_kernels._state == {}
    destination = torch.empty(100)
    source = torch.arange(100.0)
    assert write_and_sum(destination, source) == word_sum(source.numpy().tobytes())


def test_the_slot_files_of_a_sigkilled_engine_are_removed_by_the_next_one(tmp_path):
    """Issue 42: an engine SIGKILLed cannot unlink its two slot files; the next engine that
    creates slots in that directory removes them (and a dead sender's ring, and a dead vLLM
    adapter's segment), never the files of a live process."""
    import signal
    import subprocess
    import sys

    from tandem.weight_sync.slots import WeightSlots, make_layout

    script = ("import sys, time, torch\n"
              "from tandem.weight_sync.slots import WeightSlots, make_layout\n"
              "slots = WeightSlots(make_layout([('w', (64,), torch.float32)]), sys.argv[1])\n"
              "print(*slots.paths, flush=True)\n"
              "time.sleep(600)\n")
    engine = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    paths = engine.stdout.readline().split()
    os.kill(engine.pid, signal.SIGKILL)
    engine.wait(30)
    assert len(paths) == 2 and all(map(os.path.exists, paths))
    dead_ring = tmp_path / f"tandem-sync-{engine.pid}-abc"
    dead_segment = tmp_path / f"tandem-vllm-{engine.pid}-3"
    live = tmp_path / f"tandem-slot-{os.getpid()}-0-abc"  # this process's: never touched
    for path in (dead_ring, dead_segment, live):
        path.write_bytes(b"x")
    successor = WeightSlots(make_layout([("w", (64,), torch.float32)]), str(tmp_path))
    assert not any(map(os.path.exists, paths))
    assert not dead_ring.exists() and not dead_segment.exists() and live.exists()
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, *map(os.path.basename,
                                                                   successor.paths)])
    successor.close()
