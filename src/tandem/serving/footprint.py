"""How many devices one rollout replica occupies, and how many replicas a device pool holds.

world_size = TP x DP x PP; with prefill/decode disaggregation the footprint is
(TP_prefill x N_prefill + TP_decode x N_decode) x DP x PP (seed §2.3).
"""

from __future__ import annotations

from tandem.config.load import ConfigError
from tandem.config.schema import RolloutConfig

# Backends whose engine lives on exactly one device: a replica of theirs has world_size 1.
SINGLE_DEVICE_BACKENDS = ("native",)
DISAGGREGATION_BACKENDS = ("vllm", "sglang")


def replica_world_size(config: RolloutConfig) -> int:
    """Devices one replica occupies; raises ConfigError for layouts no backend supports."""
    tp, dp, pp = (config.tensor_model_parallel_size, config.data_parallel_size,
                  config.pipeline_model_parallel_size)
    for name, value in (("tensor_model_parallel_size", tp), ("data_parallel_size", dp),
                        ("pipeline_model_parallel_size", pp)):
        if value < 1:
            raise ConfigError(f"rollout.{name}: is {value}; it must be >= 1")
    if pp != 1:
        raise ConfigError(f"rollout.pipeline_model_parallel_size: is {pp}; no rollout backend "
                          "supports pipeline parallelism. Set it to 1.")
    disagg = config.disaggregation
    if not disagg.enabled:
        return tp * dp * pp
    if config.name not in DISAGGREGATION_BACKENDS:
        raise ConfigError(f"rollout.disaggregation.enabled: prefill/decode disaggregation needs "
                          f"rollout.name in {DISAGGREGATION_BACKENDS}, not {config.name!r}; "
                          "disable it or switch backend.")
    if disagg.prefill_replicas != 1:
        raise ConfigError(f"rollout.disaggregation.prefill_replicas: is {disagg.prefill_replicas};"
                          " it must be exactly 1 with disaggregation.")
    if dp != 1:
        raise ConfigError(f"rollout.data_parallel_size: is {dp}; it must be 1 with prefill/decode "
                          "disaggregation.")
    for name in ("prefill_tensor_parallel_size", "decode_tensor_parallel_size", "decode_replicas"):
        if getattr(disagg, name) < 1:
            raise ConfigError(f"rollout.disaggregation.{name}: is {getattr(disagg, name)}; "
                              "it must be >= 1")
    per_stage = (disagg.prefill_tensor_parallel_size * disagg.prefill_replicas
                 + disagg.decode_tensor_parallel_size * disagg.decode_replicas)
    world_size = per_stage * dp * pp
    if config.n_gpus_per_node > 0 and world_size > config.n_gpus_per_node:
        raise ConfigError(f"rollout.disaggregation: a prefill/decode replica needs {world_size} "
                          f"devices but must fit on one node of rollout.n_gpus_per_node="
                          f"{config.n_gpus_per_node}; lower the tensor-parallel sizes or "
                          "decode_replicas.")
    return world_size


def check_backend_fits(config: RolloutConfig, world_size: int) -> None:
    """Reject footprints the backend cannot serve (the native engine is single-device)."""
    if config.name in SINGLE_DEVICE_BACKENDS and world_size != 1:
        raise ConfigError(
            f"rollout.tensor_model_parallel_size / rollout.data_parallel_size: the {config.name!r} "
            f"engine runs on a single device, so its replica footprint must be 1, not {world_size} "
            f"(TP={config.tensor_model_parallel_size} x DP={config.data_parallel_size}). Set both "
            "to 1; the server manager then makes one replica per device.")


def replica_count(total_devices: int, world_size: int) -> int:
    """Replicas that fit in total_devices; zero is an error naming both numbers."""
    if world_size < 1:
        raise ValueError(f"replica world_size must be >= 1, not {world_size}")
    count = total_devices // world_size
    if count == 0:
        raise ConfigError(f"rollout: {total_devices} device(s) cannot hold one replica of "
                          f"{world_size} devices (TP x DP x PP); add devices (rollout.nnodes x "
                          "rollout.n_gpus_per_node, or trainer.n_devices for the hybrid layout) "
                          "or shrink the parallel sizes.")
    return count
