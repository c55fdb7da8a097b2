"""The serving stack's overhead: client -> balancer -> Ray server -> native engine, vs the same
native engine called directly in this process, on the same workload.

    .venv/bin/python bench/stack.py                 # tiny Qwen2 (hidden 256, 4 layers)
    .venv/bin/python bench/stack.py --model 0.5b    # 0.5B-shape Qwen2 (minutes)

Workload (temperature 1, logprobs on, eos ignored): 8 prompts of 200-300 tokens x 8 samples
(the n samples of GRPO), per-request budgets drawn from [16, 256] with a fixed seed, all sent at
once. The stack runs one standalone replica whose server gets the same torch threads as the
direct engine. Rounds alternate which goes first (prefix cache cleared before each run); each
round is a back-to-back pair, and the ratio reported is the median over rounds of the paired
stack/direct ratio (load drift on a shared machine hits both halves of a pair alike, while the
best rounds of each side may come from different load). The last line is
`RATIO <median paired stack/direct tokens/s>`.

The HTTP row: the same prompts as chat messages (random text, rendered by the chat template)
sent through the OpenAI-compatible endpoint with the official `openai` client (HTTP -> FastAPI
-> session recorder -> client -> balancer -> Ray server -> engine), vs the engine called directly
on the rendered ids with the same sampling dict and seed, so both sample the same tokens (eos is
not ignored here). Printed as `HTTP_RATIO <median paired endpoint/direct tokens/s>`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from engine import MODELS  # noqa: E402  (bench/engine.py: the same two model shapes)
from tandem.config.schema import RolloutConfig  # noqa: E402
from tandem.models import build_tiny_model  # noqa: E402
from tandem.types import GenerateRequest

CONFIG = RolloutConfig(kv_cache_memory_bytes=2 << 30)


def workload(vocab: int, prompts: int, samples: int, top: int,
             seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt_ids, max_tokens) per request; each prompt appears `samples` times in a row."""
    rng = random.Random(seed)
    rows = [[rng.randrange(10, vocab) for _ in range(rng.randint(200, 300))]
            for _ in range(prompts)]
    return [(row, rng.randint(16, top)) for row in rows for _ in range(samples)]


def sampling(budget: int) -> dict:
    return {"temperature": 1.0, "max_tokens": budget, "logprobs": True, "ignore_eos": True}


async def timed(generate, requests: list[tuple[list[int], int]], tag: str) -> float:
    """Send every request at once; seconds until the last one is back."""
    start = time.perf_counter()
    outputs = await asyncio.gather(*(generate(GenerateRequest(f"{tag}-{i}", prompt, sampling(budget)))
                                     for i, (prompt, budget) in enumerate(requests)))
    elapsed = time.perf_counter() - start
    assert [len(out.log_probs) for out in outputs] == [budget for _, budget in requests]
    return elapsed


def chat_workload(tokenizer, requests: list[tuple[list[int], int]]) -> list[tuple[list[dict], int]]:
    """The token workload as one user message of random text per request (same budgets)."""
    return [([{"role": "user", "content": tokenizer.decode(prompt, skip_special_tokens=True)}],
             budget) for prompt, budget in requests]


async def http_rows(path: Path, manager, direct, rounds: int) -> list[float]:
    """Paired rounds of endpoint vs direct tokens/s on the chat workload; the paired ratios."""
    import openai
    from transformers import AutoTokenizer

    from tandem.agent.chat_format import ChatFormat
    from tandem.agent.recorder import ChatRecorder
    from tandem.agent.sampling import sampling_params
    from tandem.agent.openai_endpoint import EndpointServer, create_app

    tokenizer = AutoTokenizer.from_pretrained(path)
    chat_format = ChatFormat(tokenizer)
    config = RolloutConfig(prompt_length=2048, response_length=512)
    chats = chat_workload(tokenizer, workload(tokenizer.vocab_size, 8, 8, 256))
    rendered = [chat_format.prompt_ids(messages) for messages, _ in chats]
    recorder = ChatRecorder(manager.client(), chat_format, config)
    server = EndpointServer(create_app(recorder, "tiny"))
    client = openai.AsyncOpenAI(base_url=await server.start(), api_key="none", max_retries=0)

    async def endpoint(tag: str) -> int:
        replies = await asyncio.gather(*(client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=budget, seed=i, user=f"{tag}-{i}")
            for i, (messages, budget) in enumerate(chats)))
        return sum(reply.usage.completion_tokens for reply in replies)

    async def engine(tag: str) -> int:
        outputs = await asyncio.gather(*(direct.generate(
            GenerateRequest(f"{tag}-{i}", prompt, {**sampling_params(config, False, None, budget), "seed": i}))
            for i, (prompt, (_, budget)) in enumerate(zip(rendered, chats))))
        return sum(len(output.token_ids) for output in outputs)

    await endpoint("warmup")
    paired = []
    for round_index in range(rounds):
        order = ["direct", "http"] if round_index % 2 == 0 else ["http", "direct"]
        speed = {}
        for name in order:
            await (direct.clear_kv_cache() if name == "direct" else manager.control("clear_kv_cache"))
            start = time.perf_counter()
            tokens = await (engine if name == "direct" else endpoint)(f"{name}{round_index}")
            speed[name] = tokens / (time.perf_counter() - start)
        paired.append(speed["http"] / speed["direct"])
        print(f"  http round {round_index}: direct {speed['direct']:8.1f} tok/s, "
              f"endpoint {speed['http']:8.1f} tok/s ({tokens} tokens)")
        recorder.sessions.clear()
    await client.close()
    await server.stop()
    return paired


async def run(args: argparse.Namespace) -> None:
    import ray

    from tandem.rollout.native import NativeRollout
    from tandem.serving.manager import ServerManager
    from tandem.serving.replica import ServerOptions

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    path = build_tiny_model(MODELS[args.model])
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    requests = workload(vocab, *((8, 8, 256) if args.model == "tiny" else (4, 8, 128)))
    tokens = sum(budget for _, budget in requests)
    print(f"{args.model}: {len(requests)} requests, {tokens} tokens, {threads} torch threads")

    direct = NativeRollout.create(path, CONFIG)
    # Ray runs workers at nice 15 by default; the direct engine runs at the driver's priority.
    ray.init(address="local", num_cpus=threads, include_dashboard=False, log_to_driver=False,
             _system_config={"worker_niceness": 0})
    options = ServerOptions(model_path=str(path), device_bundle={"CPU": float(threads)},
                            torch_threads=threads)
    manager = await ServerManager.create(CONFIG, options, "standalone", total_devices=1)
    client = manager.client()
    for warm in (direct.generate, client.generate):  # first-call costs out of the timing
        await timed(warm, requests[:2], "warmup")
    best = {"direct": float("inf"), "stack": float("inf")}
    paired: list[float] = []
    runners = {"direct": (direct.generate, direct.clear_kv_cache),
               "stack": (client.generate, lambda: manager.control("clear_kv_cache"))}
    for round_index in range(args.rounds):
        # Alternate who goes first, so drift in the machine's load hits both alike.
        order = ["direct", "stack"] if round_index % 2 == 0 else ["stack", "direct"]
        seconds = {}
        for name in order:
            generate, clear = runners[name]
            await clear()
            seconds[name] = await timed(generate, requests, f"{name}{round_index}")
            best[name] = min(best[name], seconds[name])
        paired.append(seconds["direct"] / seconds["stack"])
        print(f"  round {round_index}: direct {tokens / seconds['direct']:8.1f} tok/s, "
              f"stack {tokens / seconds['stack']:8.1f} tok/s")
    http = await http_rows(path, manager, direct, args.rounds) if args.http else []
    status = await manager.status()
    assert sum(status.in_flight().values()) == 0
    await manager.shutdown()
    await direct.shutdown()
    ray.shutdown()
    speed = {name: tokens / seconds for name, seconds in best.items()}
    print(f"  direct {speed['direct']:9.1f} tok/s")
    print(f"  stack  {speed['stack']:9.1f} tok/s   (best rounds: {speed['stack'] / speed['direct']:.3f})")
    print(f"  paired stack/direct per round: {' '.join(f'{r:.3f}' for r in paired)}")
    if http:
        print(f"HTTP_RATIO {statistics.median(http):.3f} endpoint/direct tokens/s (median of paired "
              f"rounds: {' '.join(f'{r:.3f}' for r in http)}), {args.model} model, openai client "
              "-> HTTP endpoint -> recorder -> client -> balancer -> Ray server -> native engine")
    print(f"RATIO {statistics.median(paired):.3f} stack/direct tokens/s (median of paired rounds), "
          f"{args.model} model, client -> balancer -> Ray server -> native engine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--http", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the OpenAI-compatible endpoint (the HTTP row)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of both engines (0: torch's default, all cores). With 1, "
                             "the stack's extra processes (driver, balancer) get a core of their own")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
