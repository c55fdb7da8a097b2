"""`naive`: actor and rollout share a process, so the stream is handed over as it is."""

from __future__ import annotations

import asyncio
from typing import Iterator

import torch

from tandem.weight_sync.base import CheckpointEngine, NamedTensors


class NaiveCheckpointEngine(CheckpointEngine):
    """Hands the actor's generator to the co-located rollout; tensors are never copied twice."""

    name = "naive"

    def __init__(self, bucket_megabytes: int = 512, timeout_s: float = 300.0,
                 **engine_kwargs) -> None:
        super().__init__(bucket_megabytes, timeout_s, **engine_kwargs)
        self._stream: NamedTensors | None = None

    async def send_weights(self, named_tensors: NamedTensors) -> None:
        """Park the generator for the receiver (no copy, no bucket)."""
        self._stream = named_tensors

    def receive_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the parked stream; send_weights runs first within sync()'s gather."""
        if self._stream is None:
            raise RuntimeError("naive receive_weights before send_weights: call sync() or send first")
        stream, self._stream = self._stream, None
        yield from stream

    def finalize(self) -> None:
        """Drop any stream the receiver did not consume."""
        super().finalize()
        self._stream = None

    async def sync(self, named_tensors: NamedTensors, rollout, version: int,
                   partial: bool = False) -> None:
        """Run the whole protocol in one process: `rollout.update_weights` consumes the stream
        (`partial`: it leaves some weights out)."""
        self.prepare()
        try:
            declared = {"partial": True} if partial else {}  # a whole stream: the plain call
            await asyncio.gather(self.send_weights(named_tensors),
                                 rollout.update_weights(self.receive_weights(), version,
                                                        **declared))
        finally:
            self.finalize()
