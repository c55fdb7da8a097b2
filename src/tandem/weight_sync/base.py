"""The checkpoint-engine interface: one weight sync is
prepare -> build_topology -> init_process_group -> send || receive -> finalize."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Iterable, Iterator

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class CheckpointEngine(ABC):
    """Moves one (name, tensor) stream from the training side to a rollout backend."""

    def __init__(self, bucket_megabytes: int = 512, **engine_kwargs) -> None:
        if engine_kwargs:
            raise ValueError(f"{type(self).__name__} takes no engine_kwargs, got "
                             f"{sorted(engine_kwargs)} (rollout.checkpoint_engine.engine_kwargs)")
        self.bucket_bytes = bucket_megabytes << 20

    def prepare(self) -> None:
        """Allocate transfer buffers."""

    def build_topology(self) -> None:
        """Decide who sends to whom."""

    def init_process_group(self) -> None:
        """Connect senders and receivers."""

    @abstractmethod
    async def send_weights(self, named_tensors: NamedTensors) -> None:
        """Push the stream (training side)."""

    @abstractmethod
    def receive_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the stream as it arrives (rollout side)."""

    def finalize(self) -> None:
        """Release buffers and process groups."""

    async def sync(self, named_tensors: NamedTensors, rollout, version: int) -> None:
        """Run the whole protocol once: `rollout.update_weights` consumes what arrives."""
        self.prepare()
        self.build_topology()
        self.init_process_group()
        try:
            await asyncio.gather(self.send_weights(named_tensors),
                                 rollout.update_weights(self.receive_weights(), version))
        finally:
            self.finalize()
