"""A deterministic token engine for the OpenAI endpoint tests: its output is a function of the
prompt tokens and the sampling dict only, so two loops get the same tokens exactly when they send
the same stream with the same parameters (a re-tokenization or wrong seed changes everything)."""

from __future__ import annotations

import asyncio
import zlib

from tandem.types import TokenOutput


class ScriptedEngine:
    """Calls the calculator (up to two times per conversation) or answers, in real tokens."""

    def __init__(self, tokenizer, version: int = 3, delay: bool = False) -> None:
        self.tokenizer = tokenizer
        self.version = version
        self.delay = delay  # yield to the event loop mid-call (interleaves concurrent sessions)
        self.calls: list[tuple[str, list[int], dict]] = []

    def _text(self, digest: int, prompt_text: str, seed: int | None) -> str:
        """A tool call (while fewer than two were answered) or a final answer. The request's
        seed decides which when given (seed % 4 != 0 calls), so a test's choice of seed does
        not hang on how the tiny tokenizer splits the prompt; the digest otherwise."""
        calls_so_far = prompt_text.count("<tool_response>")
        a, b = digest % 97, (digest >> 8) % 89
        if calls_so_far < 2 and (digest if seed is None else seed) % 4 != 0:
            return ('<tool_call>{"name": "calculator", "arguments": {"expression": "%d + %d"}}'
                    "</tool_call>" % (a, b))
        return f"The answer is {a + b}."

    async def generate(self, request) -> TokenOutput:
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        self.calls.append((request_id, list(prompt_ids), dict(sampling_params)))
        if self.delay:
            await asyncio.sleep(0.001 * (len(self.calls) % 3))
        key = f"{prompt_ids}|{sorted(sampling_params.items())}".encode()
        digest = zlib.crc32(key)
        text = self._text(digest, self.tokenizer.decode(prompt_ids), sampling_params.get("seed"))
        tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        stop = "completed"
        if len(tokens) > sampling_params["max_tokens"]:
            tokens, stop = tokens[:sampling_params["max_tokens"]], "length"
        log_probs = [-((digest >> (i % 16)) % 1000) / 256.0 for i in range(len(tokens))]
        return TokenOutput(tokens, log_probs, stop, {"global_steps": self.version})
