"""A prefill/decode (PD) replica of the native engine (rollout.disaggregation.enabled): one prefill
engine and `decode_replicas` decode engines behind the replica's one address (docs/engine.md,
"Prefill/decode disaggregation"; what they share with a data-parallel replica: engine_group.py).

A request is prefilled (prompt KV and first token; the prefill engine's prefix cache means a
session's next turn computes only its new tokens), then handed to a decode engine: the session's
last one (sticky by request_id, so its prefix cache holds the earlier turns and only new blocks
move), else the one with the fewest requests in flight. The blocks move through a KV transfer
(engine/kv_transfer.py).

A decode engine that stops is left out (engine_group.py): the requests it was decoding are
decoded again on another from their prefill (the same first token and seed state, the blocks
moved again or recomputed there). With the prefill engine stopped, the decode engines serve
whole requests (their own prefill); with no decode engine left, the replica fails.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable

from tandem.config.schema import DisaggregationConfig, RolloutConfig
from tandem.rollout.base import MEMORY_TAGS
from tandem.rollout.engine.kv_transfer import InProcessTransfer, make_transfer
from tandem.rollout.engine.shared_kv import SHM_DIR
from tandem.rollout.engine_group import EngineGroup, engine_devices, stop_started
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest, TokenOutput


class DisaggregatedRollout(EngineGroup):
    """One prefill engine and N decode engines (native, each of its side's TP size) serving as
    one replica."""

    kind = "prefill/decode"

    def __init__(self, prefill: NativeRollout, decodes: list[NativeRollout],
                 transfer: Any | None = None) -> None:
        if not decodes:
            raise ValueError("a prefill/decode replica needs at least one decode engine")
        super().__init__([prefill, *decodes])
        self.prefill_engine, self.decode_engines = prefill, list(decodes)
        self.transfer = transfer or InProcessTransfer()

    @classmethod
    def create(cls, model_path: str | Path, config: RolloutConfig, dtype: str = "float32",
               device: str = "cpu", rendezvous: Any = None) -> "DisaggregatedRollout":
        """The engines of `config.disaggregation`: plain native engines of `config`, the
        prefill one of prefill_tensor_parallel_size ranks, each decode one of
        decode_tensor_parallel_size (with kv_transfer=shm every rank's KV cache in /dev/shm)."""
        if rendezvous is not None:
            raise ValueError("a prefill/decode replica fits one node; it takes no rendezvous")
        pd = config.disaggregation
        widths = [pd.prefill_tensor_parallel_size] + [pd.decode_tensor_parallel_size] * \
            pd.decode_replicas
        if max(widths) > 1 and pd.kv_transfer != "shm":
            raise ValueError(f"rollout.disaggregation.kv_transfer={pd.kv_transfer!r} moves KV "
                             "between engines of TP 1; tensor-parallel engines need shm")
        if pd.kv_transfer == "shm" and not device.startswith("cpu"):
            raise ValueError(f"rollout.disaggregation.kv_transfer=shm moves KV caches in host "
                             f"memory; the engines run on {device!r} (use in_process)")
        shm_dir = SHM_DIR if pd.kv_transfer == "shm" else None
        engines: list[NativeRollout] = []
        try:
            for width, engine_device in zip(widths, engine_devices(device, widths)):
                plain = dataclasses.replace(config, disaggregation=DisaggregationConfig(),
                                            tensor_model_parallel_size=width)
                engines.append(NativeRollout.create(model_path, plain, dtype, engine_device,
                                                    kv_shm_dir=shm_dir))
            transfer = make_transfer(pd.kv_transfer)
        except BaseException:
            stop_started(engines)
            raise
        return cls(engines[0], engines[1:], transfer)

    async def generate(self, request: GenerateRequest) -> TokenOutput:
        """Prefill, then decode on the session's decode engine (or the least loaded one); the
        decode engines alone when the prefill engine stopped."""
        self.raise_if_failed()
        prefill = self.prefill_engine
        if self.live([prefill]):
            try:
                prefilled = await prefill.prefill(request)
            except Exception:
                if self.closing or self.live([prefill]):
                    raise
            else:
                if prefilled.finished and (self.closing or self.live([prefill])
                                           or prefilled.output.stop_reason != "aborted"):
                    return prefilled.output
                if not prefilled.finished:
                    try:
                        return await self.serve(request.request_id, self.decode_engines,
                                                lambda decode: decode.generate_prefilled(
                                                    request, prefilled, prefill, self.transfer))
                    finally:  # the handoff released it already, unless it failed before
                        prefill.release_prefilled(request.request_id)
            self.requests_moved += 1  # the prefill engine stopped under it: decode it whole
        return await self.serve(request.request_id, self.decode_engines,
                                lambda decode: decode.generate(request))

    async def sleep(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        """Every engine sleeps; with the KV cache, the shm transfer's mappings of the prefill's
        files go too (each decode worker rank drops its own when its engine sleeps)."""
        tags = list(tags)
        await super().sleep(tags)
        if "kv_cache" in tags and hasattr(self.transfer, "forget"):
            self.transfer.forget()

    def serving_problem(self) -> str | None:
        """None while a decode engine is left (the prefill engine may be gone)."""
        return None if self.live(self.decode_engines) else "every decode engine stopped"

    def stats(self) -> dict[str, Any]:
        """Every engine's counters summed, plus the handoffs' blocks and bytes."""
        return {**super().stats(), "kv_transfer_blocks": self.transfer.blocks_moved,
                "kv_transfer_bytes": self.transfer.bytes_moved}
