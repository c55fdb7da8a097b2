"""Reference computations the conformance tests compare every backend against."""

from __future__ import annotations

import asyncio

import torch

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@torch.no_grad()
def hf_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The HF model's logits for each generated position: [len(tokens), vocab]."""
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def hf_logprobs(model, prompt: list[int], tokens: list[int],
                temperature: float = 1.0) -> list[float]:
    """log softmax(logits / temperature) at the sampled tokens."""
    logits = hf_logits(model, prompt, tokens) / temperature
    picked = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])
    return picked[:, 0].tolist()


def assert_greedy(model, prompt: list[int], tokens: list[int], tolerance: float) -> None:
    """Each token is the HF argmax (up to `tolerance`: near-ties may flip between kernels)."""
    logits = hf_logits(model, prompt, tokens)
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    gap = logits.max(-1).values - chosen
    assert gap.max().item() <= tolerance, f"non-greedy token: logit gaps {gap.tolist()}"


async def wait_generated(rollout, at_least: int, timeout_s: float = 120.0) -> None:
    """Poll the backend's generated-token counter until it has grown by `at_least`."""
    start = rollout.stats()["generated_tokens"]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while rollout.stats()["generated_tokens"] - start < at_least:
        assert loop.time() < deadline, "the backend generated nothing"
        await asyncio.sleep(0.005)
