"""A reward-model server: one process (a Ray actor) hosting an HF sequence-classification model
with one scalar head; `score(sequences)` returns one float per token sequence.

Calls that arrive while a forward runs wait and go together into the next one (up to
max_batch_size sequences per forward), so many small calls from agent loops become few
batched forwards, as continuous batching does for generation.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any, Sequence

import ray


@dataclass
class RewardServerInfo:
    """Where a reward server runs and what it hosts."""

    server_id: str
    node_ip: str
    pid: int
    torch_threads: int
    pad_token_id: int


class RewardModelServer:
    """Hosts one reward model; score() batches concurrent calls into shared forwards."""

    def __init__(self, server_id: str = "reward-0") -> None:
        self.server_id = server_id
        self._model: Any = None
        self._pending: list[tuple[list[list[int]], asyncio.Future]] = []
        self._drain: asyncio.Task | None = None
        self._counts = {"calls": 0, "sequences": 0, "forwards": 0, "busy_s": 0.0}

    async def start(self, model_path: str, dtype: str = "float32", device: str = "cpu",
                    torch_threads: int | None = None, max_batch_size: int = 32,
                    max_length: int = 2048) -> RewardServerInfo:
        """Load the model (eval mode, no gradients); returns where it runs."""
        import torch
        from transformers import AutoModelForSequenceClassification

        if torch_threads:
            torch.set_num_threads(torch_threads)  # Ray sets OMP_NUM_THREADS=1 in actors
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path, dtype=getattr(torch, dtype)).to(device).eval()
        if model.config.num_labels != 1:
            raise ValueError(f"reward model {model_path}: its head has {model.config.num_labels} "
                             "outputs; a reward model has one scalar head (num_labels=1)")
        if not isinstance(getattr(model, "score", None), torch.nn.Module):
            raise ValueError(f"reward model {model_path}: {type(model).__name__} has no `score` "
                             "head (the decoder-style sequence-classification head scored at "
                             "the last token); use a causal-LM architecture's "
                             "ForSequenceClassification class")
        if model.config.pad_token_id is None:
            model.config.pad_token_id = 0  # only fills the padding; scores read each last token
        self._model, self._device = model, device
        self.max_batch_size, self.max_length = max_batch_size, max_length
        return self.info()

    def info(self) -> RewardServerInfo:
        """Node, process and threads of this server."""
        import torch

        return RewardServerInfo(self.server_id, ray.util.get_node_ip_address(), os.getpid(),
                                torch.get_num_threads(), int(self._model.config.pad_token_id))

    def weight_version(self) -> int:
        """A cheap call the client probes a busy server with (the weights never change)."""
        return 0

    def stats(self) -> dict[str, Any]:
        """Calls, sequences, forwards and seconds spent in forwards."""
        return dict(self._counts)

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[float | None]:
        """One score per sequence (None for an empty or over-long one, which fails only itself)."""
        if self._model is None:
            raise RuntimeError(f"reward server {self.server_id!r}: call start() first")
        future = asyncio.get_running_loop().create_future()
        self._pending.append(([list(map(int, s)) for s in sequences], future))
        self._counts["calls"] += 1
        if self._drain is None or self._drain.done():
            self._drain = asyncio.create_task(self._drain_pending())
        return await future

    async def _drain_pending(self) -> None:
        while self._pending:
            calls, self._pending = self._pending, []
            flat = [s for sequences, _ in calls for s in sequences]
            try:
                scores = await asyncio.to_thread(self._score_all, flat)
            except Exception as error:  # a broken forward fails these calls, not the server
                for _, future in calls:
                    if not future.done():
                        future.set_exception(error)
                continue
            start = 0
            for sequences, future in calls:
                if not future.done():
                    future.set_result(scores[start:start + len(sequences)])
                start += len(sequences)

    def _score_all(self, sequences: list[list[int]]) -> list[float | None]:
        import time

        import torch

        began = time.perf_counter()
        scores: list[float | None] = [None] * len(sequences)
        valid = [i for i, s in enumerate(sequences) if 0 < len(s) <= self.max_length]
        pad = int(self._model.config.pad_token_id)
        for start in range(0, len(valid), self.max_batch_size):
            chunk = valid[start:start + self.max_batch_size]
            width = max(len(sequences[i]) for i in chunk)
            # right padding: a causal model's last real token never sees the pads after it
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, index in enumerate(chunk):
                ids[row, :len(sequences[index])] = torch.tensor(sequences[index])
                mask[row, :len(sequences[index])] = 1
            last = mask.sum(1) - 1
            with torch.inference_mode():
                hidden = self._model.base_model(input_ids=ids.to(self._device),
                                           attention_mask=mask.to(self._device)).last_hidden_state
                values = self._model.score(hidden[torch.arange(len(chunk)), last.to(self._device)])
            for row, index in enumerate(chunk):
                scores[index] = float(values[row, 0])
            self._counts["forwards"] += 1
        self._counts["sequences"] += len(sequences)
        self._counts["busy_s"] += time.perf_counter() - began
        return scores

    def shutdown(self) -> None:
        """Drop the model (the process ends when its actor is killed)."""
        self._model = None


RewardModelServerActor = ray.remote(RewardModelServer)
