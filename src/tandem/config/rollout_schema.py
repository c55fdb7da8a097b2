"""The rollout section of the configuration tree (`rollout.*`): sampling, the engine and its
replica layout (tensor / data parallel, prefill/decode), the weight-sync transport, agent loops
and environments, fault tolerance and elasticity. Re-exported by config/schema.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ValKwargs:
    """Sampling used for validation; overrides the training sampling fields."""

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False


@dataclass
class DisaggregationConfig:
    """Prefill/decode disaggregation: one prefill and decode_replicas decode engines per replica
    (the native engine, each of its side's TP size, on one node; rollout/disaggregated.py)."""

    enabled: bool = False
    prefill_tensor_parallel_size: int = 1
    prefill_replicas: int = 1
    decode_tensor_parallel_size: int = 1
    decode_replicas: int = 1
    # in_process (TP 1) | shm (CPU, any TP sizes: every rank's KV in /dev/shm) | mooncake
    # (Mooncake's transfer engine, the pd extra; TP 1); with rollout.name=vllm (CUDA): nixl
    kv_transfer: str = "in_process"


@dataclass
class CheckpointEngineConfig:
    """The weight-sync transport from the training actor into the rollout engine."""

    # auto: naive in-process (hybrid); across processes shm when every server shares the
    # sender's host, else nccl (cuda) / gloo (cpu); or a name in tandem.weight_sync.registry
    backend: str = "auto"
    update_weights_bucket_megabytes: int = 512
    timeout_s: float = 300.0  # deadline of every wait of a sync (rendezvous, bucket, phase)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class OpenAIAgentConfig:
    """The openai_agent loop: a user agent talking to tandem's OpenAI-compatible endpoint."""

    enable: bool = False
    agent: str = ""  # import path "package.module:function" of async def run(client, row)
    host: str = "127.0.0.1"  # the endpoint binds to localhost unless set otherwise
    port: int = 0  # 0: a free port
    api_key: str = ""  # bearer token the endpoint requires; empty: none
    served_model_name: str = "tandem"  # the `model` callers must name
    max_request_bytes: int = 8 << 20  # a larger request body is answered 413


@dataclass
class MultiTurnConfig:
    """Limits of the tool-calling agent loop."""

    enable: bool = False
    max_assistant_turns: int = 4
    max_user_turns: int = 4
    max_tool_response_length: int = 256  # in tokens
    tool_response_truncate_side: str = "middle"  # left | right | middle
    # built-in names (calculator, python) or the user's classes: "path/to/tools.py:ClassName",
    # "package.module:ClassName" (constructed with no arguments; the Tool contract)
    tools: list[str] = field(default_factory=list)
    max_tool_calls_per_turn: int = 8  # calls over it are not run; the model gets one error message
    # per call, enforced by the loop; above the python sandbox's worst case (10 s queue + 10 s wall)
    tool_timeout_seconds: float = 30.0


@dataclass
class EnvironmentConfig:
    """An environment whose episodes are the sessions (docs/agent_loops.md, "Environments"):
    a `verifiers` environment run against the token-recording endpoint, or a Gym-style
    (OpenEnv) environment driven by the tool-calling loop. Its reward joins reward.*'s sum."""

    kind: str = ""  # "" (none) | verifiers | gym
    # verifiers: the environment's id (an installed taskset package, e.g. "my-env" or
    # "owner/my-env"); gym: the class, "package.module:Class" or "path/to/file.py:Class"
    id: str = ""
    # verifiers: the taskset's config fields; gym: the class's keyword arguments
    args: dict[str, Any] = field(default_factory=dict)
    reward_weight: float = 1.0  # the environment's reward in the weighted sum of rewards
    # verifiers only: a harness config for the agent's seat (its "id" and fields); {}: the
    # taskset's own harness
    harness: dict[str, Any] = field(default_factory=dict)


@dataclass
class FaultToleranceConfig:
    """Standalone rollout servers and served-reward servers that die or stall are restarted,
    re-synced to the trainer's version and put back (docs/serving.md, "Restarts")."""

    enable: bool = False
    max_restarts: int = 3  # restarts of the whole run; one more ends it, naming the server
    # seconds between health checks; a server answering no probe within 3 x this is stalled
    health_interval_s: float = 10.0


@dataclass
class ElasticAutoConfig:
    """The pool's size from the last step's idle fractions (separate_async): one replica more
    after a step in which the trainer waited on rollout for more than grow_above of it, one
    fewer after one in which the rollout was held back (full buffer, sync) more than
    shrink_above; within [min_replicas, max_replicas]."""

    enable: bool = False
    min_replicas: int = 1
    max_replicas: int = 0  # 0: as many as the rollout devices hold
    grow_above: float = 0.3  # idle/trainer_fraction
    shrink_above: float = 0.5  # idle/rollout_fraction


@dataclass
class ElasticConfig:
    """The standalone rollout pool's size by step (docs/trainer.md, "An elastic pool")."""

    # [[step, replicas], ...]: from the weight sync of `step` on, the pool has `replicas`
    # replicas (added ones serve that version before their first request); empty: fixed size
    schedule: list[list[int]] = field(default_factory=list)
    auto: ElasticAutoConfig = field(default_factory=ElasticAutoConfig)


@dataclass
class RolloutConfig:
    """The rollout engine, its servers and the sampling used in training."""

    name: str = "native"  # a name in tandem.rollout.registry (today: native)
    mode: str = "async"  # async only: the synchronous generation path does not exist
    prompt_length: int = 512
    response_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 4
    calculate_log_probs: bool = True
    logprobs_mode: str = "raw"  # raw (model distribution) | processed (after temperature/top-k/top-p)
    # requests running when new weights arrive mid-generation (a double-buffered flip):
    # recompute (their KV cache again, with the new weights) | keep (their KV cache; native only)
    in_flight_kv: str = "recompute"
    # auto | kv | fixed: whether the native engine admits by its free KV (config/choices.py)
    admission: str = "auto"
    tensor_model_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.5  # fraction of device memory for the KV cache (GPU)
    kv_cache_memory_bytes: int = 1 << 30  # KV budget on CPU, or on GPU when > 0 and set explicitly
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True
    free_cache_engine: bool = True  # release KV (and weights) while the actor trains
    seed: int = 0
    # the adapter rank engines load (vLLM / SGLang reserve LoRA slots of it); load_config sets
    # it from actor.lora.rank, 0: no adapters
    lora_rank: int = 0
    # engines record each sampled token's top-k / top-p kept set; load_config sets it from
    # actor.replay_sampling_mask
    return_kept_sets: bool = False
    # native engine: each sequence's forward and chunking never depend on its neighbours
    # (slower: no batched forward); load_config sets it from trainer.deterministic
    batch_invariant: bool = False
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    openai_agent: OpenAIAgentConfig = field(default_factory=OpenAIAgentConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    agent_concurrency: int = 64  # agent-loop sessions in flight at once
    torch_threads: int = 0  # CPU threads of each standalone rollout server (separate_async); 0: auto
    # Devices of a standalone rollout pool (separate_async); 0 means "share the actor's".
    nnodes: int = 0
    n_gpus_per_node: int = 0
