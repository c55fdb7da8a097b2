"""The `native` rollout backend: tandem's own engine (rollout/engine/) under its registry name."""

from __future__ import annotations

from pathlib import Path

from tandem.config.schema import RolloutConfig
from tandem.rollout.base import CAPABILITIES
from tandem.rollout.engine import AsyncEngine
from tandem.rollout.engine.rank_worker import Rendezvous


class NativeRollout(AsyncEngine):
    """Continuous batching, paged KV cache, prefix cache, per-token logprobs; CPU or CUDA."""

    # multi_modal_inputs: for a vision-language model (Qwen2-VL family); a text model refuses
    # a request's images naming it
    capabilities = {**{name: "yes" for name in CAPABILITIES}, "adapters": "no"}

    @classmethod
    def create(cls, model_path: str | Path, config: RolloutConfig | None = None,
               dtype: str = "float32", device: str = "cpu",
               rendezvous: Rendezvous | None = None, kv_shm_dir: str | None = None
               ) -> "NativeRollout":
        """The engine; `rendezvous`: rank 0 of a tensor-parallel replica spread over nodes;
        `kv_shm_dir`: every rank's KV cache in a file there (a PD replica's shm transfer)."""
        from tandem.models import resolve_model_path

        return cls(resolve_model_path(str(model_path)), config or RolloutConfig(), dtype, device,
                   rendezvous, kv_shm_dir)
