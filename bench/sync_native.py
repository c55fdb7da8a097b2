"""The double-buffered handoff into the native engine itself, for bench/sync.py: a ~500 MB
Qwen2-shaped model (random weights, built locally) served by NativeRollout in this process on one
torch thread while greedy requests decode, and a sender process (one thread) writing the new
version into the engine's inactive slot over shm. Measured on the engine: tokens generated while
the bytes land, the engine's flip (the step lock held: flip + KV invalidation), and the
generation pause: the time no token came out around the flip less one ordinary decode step, or
the flip if that is longer: with rollout.in_flight_kv=recompute (the default) it includes the re-prefill of the
requests the flip preempted; with keep they go on from their cache.

    .venv/bin/python bench/sync_native.py            # also run by bench/sync.py (`shm-db-native`)
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time

import torch

from tandem.models.tiny import TinyModelSpec, build_tiny_model

# ~492 MB of fp32 weights: embedding 32000 x 1024 (tied) and 8 layers of 11.3 M parameters
SPEC = TinyModelSpec(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=4, intermediate_size=2816, vocab_size=32000)
PROMPT_TOKENS, REQUESTS = 32, 4


def _sender_main(conn, model_path: str, bucket_megabytes: int) -> None:
    """Build the next version (every weight moved), serve the plan's store, write the slot."""
    from transformers import AutoModelForCausalLM

    from tandem.weight_sync.registry import get_checkpoint_engine_class

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    state = {}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            state[name] = tensor + torch.randn(tensor.shape, generator=generator) * 1e-3
    del model
    engine = get_checkpoint_engine_class("shm")(bucket_megabytes, 600.0, double_buffer=True)
    slots, version = conn.recv()
    plan = engine.build_topology(1, version + 1, [version], [slots])
    conn.send(plan)
    engine.init_process_group(plan, 0)
    started = time.perf_counter()
    asyncio.run(engine.send_weights(state.items()))
    conn.send(time.perf_counter() - started)
    engine.finalize()
    engine.close()


async def _measure(bucket_megabytes: int, in_flight_kv: str, spec: TinyModelSpec) -> dict:
    from tandem.config.schema import RolloutConfig
    from tandem.rollout.native import NativeRollout
    from tandem.serving.server import RolloutServer
    from tandem.types import GenerateRequest

    torch.set_num_threads(1)
    path = build_tiny_model(spec)
    nbytes = sum(p.numel() * 4 for p in _weights(path))
    server = RolloutServer("bench-native")
    await server.start(NativeRollout, path, RolloutConfig(
        kv_cache_memory_bytes=64 << 20, block_size=16, in_flight_kv=in_flight_kv))
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    sender = context.Process(target=_sender_main, args=(child, str(path), bucket_megabytes),
                             daemon=True)
    sender.start()
    try:
        slots = await server.weight_slots({})
        memcpy_s = _memcpy_s(nbytes)  # on the engine's thread, right before the sync
        conn.send((slots, server.backend.weight_version))
        plan = await asyncio.to_thread(conn.recv)  # the sender built its next version
        sampling = {"temperature": 0.0, "max_tokens": spec.max_position_embeddings - PROMPT_TOKENS,
                    "ignore_eos": True}
        running = [asyncio.create_task(server.generate(GenerateRequest(
            f"r{i}", [5 + i] * PROMPT_TOKENS, sampling))) for i in range(REQUESTS)]
        ticks = await _ticks_until(server, running, lambda count, _: count >= 40 * REQUESTS)
        receive = asyncio.create_task(server.receive_weights(plan, 1, {}))
        started = time.perf_counter()
        during = await _ticks_until(server, running, lambda _, version: version >= 1)
        copy_s = time.perf_counter() - started
        after = await _ticks_until(server, running,
                                   lambda count, _: count >= during[-1][1] + 8 * REQUESTS)
        timings = await receive
        send_s = await asyncio.to_thread(conn.recv)
        await server.abort_all_requests()
        await asyncio.gather(*running)
    finally:
        sender.join(60)
        await server.shutdown()
    steps = [b[0] - a[0] for a, b in zip(ticks, ticks[1:]) if b[1] > a[1]]
    step_s = statistics.median(steps)
    last_before, count = during[-1]  # the last token seen before the flip was
    first_after = next(t for t, n in after if n > count)
    return {"bytes": nbytes, "memcpy_s": memcpy_s, "copy_s": copy_s, "send_s": send_s, "flip_s": timings["flip"],
            "step_s": step_s, "gap_s": first_after - last_before,
            "pause_s": max(timings["flip"], first_after - last_before - step_s),
            "tokens_during": during[-1][1] - during[0][1]}


async def _ticks_until(server, running, done) -> list[tuple[float, int]]:
    """(time, generated tokens) each time the count changes (polled every 0.5 ms), until
    done(count, weight version); raises if the requests finish first."""
    ticks: list[tuple[float, int]] = []
    while True:
        if all(task.done() for task in running):
            raise RuntimeError("sync_native: the requests finished before the measurement did "
                               f"({[task.result().stop_reason for task in running]})")
        count = server.stats()["backend"]["generated_tokens"]
        if not ticks or count != ticks[-1][1]:
            ticks.append((time.perf_counter(), count))
        if done(count, server.backend.weight_version):
            return ticks
        await asyncio.sleep(0.0005)


def _memcpy_s(nbytes: int, repeats: int = 3) -> float:
    """Best of `repeats` copies of nbytes between two fresh buffers."""
    source, destination = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        destination.copy_(source)
        best = min(best, time.perf_counter() - started)
    return best


def _weights(path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return [tensor for file in sorted(path.glob("*.safetensors"))
            for tensor in load_file(file).values()]


def run_native(bucket_megabytes: int = 64, in_flight_kv: str = "recompute",
               spec: TinyModelSpec = SPEC) -> dict:
    """One double-buffered sync into a generating native engine (see the module docstring),
    the running requests recomputing or keeping their KV cache at the flip."""
    return asyncio.run(_measure(bucket_megabytes, in_flight_kv, spec))


if __name__ == "__main__":
    for policy in ("recompute", "keep"):
        result = run_native(in_flight_kv=policy)
        print(policy, {key: round(value, 4) if isinstance(value, float) else value
                       for key, value in result.items()})
