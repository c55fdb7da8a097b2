"""A prefill/decode replica of SGLang engines (rollout.name=sglang, rollout.disaggregation.enabled;
CUDA): one prefill and `decode_replicas` decode `sglang.Engine`s in the replica's server process,
started with SGLang's disaggregation mode (`disaggregation_mode` prefill / decode) and transfer
backend (rollout.disaggregation.kv_transfer: mooncake or nixl), each on its own GPU of the
replica's (`base_gpu_id`) with its own port; the prefill engine's bootstrap server listens on a
free port of this host.

A request goes to the prefill engine and to the chosen decode engine at once, both with the same
bootstrap_host / bootstrap_port / bootstrap_room (a fresh random 63-bit room per run): the decode
engine reserves room for the prompt, the prefill engine computes it and its transfer backend
writes the KV into that room, and the decode engine generates every token (the first one comes
with the KV), so the replica returns the decode engine's output as it is. A prefill that fails or
comes back aborted aborts its decode. Routing, control, weight updates, the version rerun:
external_pd.py.

Not run on a GPU (SGLang runs on CUDA only, and no GPU run has included it yet); a GPU check
must show the two engines starting in one process and the first token's log-prob arriving with
the KV.
"""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path
from typing import Any

from tandem.config.schema import DisaggregationConfig, RolloutConfig
from tandem.rollout.external_pd import ExternalPDRollout
from tandem.types import GenerateRequest, TokenOutput

TRANSFER_BACKENDS = ("mooncake", "nixl")  # rollout.disaggregation.kv_transfer -> SGLang's name
BOOTSTRAP_HOST = "127.0.0.1"  # the replica fits one node: its engines meet on loopback


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as probe:
        probe.bind((BOOTSTRAP_HOST, 0))
        return probe.getsockname()[1]


def engine_args(disaggregation: DisaggregationConfig, device: str, prefill: bool,
                bootstrap_port: int) -> dict[str, Any]:
    """The ServerArgs of one engine of the replica: its mode, transfer backend, GPU and ports."""
    if disaggregation.kv_transfer not in TRANSFER_BACKENDS:
        raise ValueError(f"rollout.disaggregation.kv_transfer: is {disaggregation.kv_transfer!r}; "
                         f"SGLang's prefill/decode takes one of {list(TRANSFER_BACKENDS)}")
    args = {"disaggregation_mode": "prefill" if prefill else "decode",
            "disaggregation_transfer_backend": disaggregation.kv_transfer,
            "base_gpu_id": int(device.split(":")[1]) if ":" in device else 0,
            "host": BOOTSTRAP_HOST, "port": free_port()}
    if prefill:
        args["disaggregation_bootstrap_port"] = bootstrap_port
    return args


class SGLangDisaggregatedRollout(ExternalPDRollout):
    """One prefill and N decode SGLang engines (each an SGLangRollout) serving as one replica."""

    backend = "SGLang"
    cpu_refusal = "SGLang runs on CUDA only"
    capabilities = {"logprobs_raw": "yes", "logprobs_processed": "no", "abort_partial": "yes",
                    "per_request_seed": "yes", "sleep_weights": "yes", "sleep_kv_cache": "yes",
                    "clear_kv_cache": "yes", "update_weights": "yes", "multi_modal_inputs": "no",
                    "adapters": "no", "kept_sets": "no"}

    def __init__(self, prefill: Any, decodes: list[Any], bootstrap_port: int) -> None:
        super().__init__(prefill, decodes)
        self.bootstrap_port = bootstrap_port

    @classmethod
    def create(cls, model_path: str | Path, config: RolloutConfig, dtype: str = "bfloat16",
               device: str = "cuda", rendezvous: Any = None) -> "SGLangDisaggregatedRollout":
        """The engines of `config.disaggregation`, each an SGLangRollout in its mode."""
        from tandem.rollout.sglang import SGLangRollout

        bootstrap_port = free_port()

        def start(index: int, engine_device: str, plain: RolloutConfig) -> Any:
            return SGLangRollout.create(model_path, plain, dtype, "cuda", engine_args(
                config.disaggregation, engine_device, index == 0, bootstrap_port))

        engines = cls.start_engines(config, device, rendezvous, start)
        return cls(engines[0], engines[1:], bootstrap_port)

    async def _handoff(self, request: GenerateRequest, decode: Any, epoch: int
                       ) -> tuple[TokenOutput, TokenOutput | None]:
        """The prefill and the decode engine at once, meeting in a fresh bootstrap room."""
        bootstrap = {"bootstrap_host": BOOTSTRAP_HOST, "bootstrap_port": self.bootstrap_port,
                     "bootstrap_room": random.getrandbits(63)}
        decoding = asyncio.ensure_future(decode.generate(request, bootstrap=bootstrap))
        await asyncio.sleep(0)  # the decode registers the request first: an abort then finds it
        if decoding.done():  # it failed at once: no prefill waits for a peer that never comes
            await decoding
        try:
            prefilled = await self.prefill_engine.generate(request, bootstrap=bootstrap)
        except BaseException:
            await self._stop(decode, request.request_id, decoding)
            raise
        if prefilled.stop_reason == "aborted" or self.aborted_meanwhile(request.request_id,
                                                                          epoch):
            await self._stop(decode, request.request_id, decoding)
            return prefilled, None
        return prefilled, await decoding

    @staticmethod
    async def _stop(decode: Any, request_id: str, decoding: asyncio.Future) -> None:
        """Abort a decode whose prefill will never send its KV, and wait for it to end."""
        await decode.abort(request_id)
        await asyncio.gather(decoding, return_exceptions=True)
