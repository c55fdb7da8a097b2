"""A data-parallel replica of the native engine (rollout.data_parallel_size > 1): DP engine
groups, each of rollout.tensor_model_parallel_size ranks, behind the replica's one address
(docs/engine.md, "Data parallelism inside a replica"; what they share with a prefill/decode
replica: engine_group.py). A request runs on the engine its request_id ran on before (a
session's earlier turns are in that engine's prefix cache), else on the one with the fewest
requests in flight.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tandem.config.schema import RolloutConfig
from tandem.rollout.engine_group import EngineGroup, engine_devices, stop_started
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest, TokenOutput


class DataParallelRollout(EngineGroup):
    """DP native engines (each TP ranks) serving as one replica."""

    kind = "data-parallel"

    @classmethod
    def create(cls, model_path: str | Path, config: RolloutConfig, dtype: str = "float32",
               device: str = "cpu", rendezvous: Any = None) -> "DataParallelRollout":
        """`config.data_parallel_size` engines of `config`'s tensor-parallel size."""
        if rendezvous is not None:
            raise ValueError("a data-parallel replica fits one node; it takes no rendezvous")
        member = dataclasses.replace(config, data_parallel_size=1)
        width = config.tensor_model_parallel_size
        engines: list[NativeRollout] = []
        try:
            for engine_device in engine_devices(device, [width] * config.data_parallel_size):
                engines.append(NativeRollout.create(model_path, member, dtype, engine_device))
        except BaseException:
            stop_started(engines)
            raise
        return cls(engines)

    async def generate(self, request: GenerateRequest) -> TokenOutput:
        """Run the request on its session's engine, or the least loaded one."""
        self.raise_if_failed()
        return await self.serve(request.request_id, self.engines,
                                lambda engine: engine.generate(request))
