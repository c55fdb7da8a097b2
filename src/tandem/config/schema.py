"""The configuration tree as dataclasses. Field names follow the seed's config slice (§13).

Every field is read by some code path; an option nothing reads does not belong here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.config.rollout_schema import (  # noqa: F401 (re-exported: the rollout section)
    ValKwargs, DisaggregationConfig, CheckpointEngineConfig, OpenAIAgentConfig, MultiTurnConfig,
    EnvironmentConfig, FaultToleranceConfig, ElasticAutoConfig, ElasticConfig, RolloutConfig)


@dataclass
class ModelConfig:
    """Which HF model both copies of the policy start from."""

    # an HF directory, a hub id found in transformers' cache (HF_HOME), or "tiny:qwen2" /
    # "tiny:llama" (built locally) / "smollm2"
    path: str = "tiny:qwen2"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda


@dataclass
class OptimConfig:
    """AdamW with warm-up then constant or cosine decay."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0


# the decoder linears a LoRA adapter may target: those every rollout backend serves with one
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    """LoRA adapters on the actor through peft (docs/training.md, "LoRA"); rank 0 is off."""

    rank: int = 0  # 0: full fine-tune
    alpha: float = 16.0  # the update is (alpha / rank) x B @ A
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    save_merged: bool = False  # checkpoints also hold the merged model (merged/, a plain HF folder)


@dataclass
class ActorConfig:
    """The training actor: PPO/GRPO policy update."""

    ppo_mini_batch_size: int = 8  # in prompts x n trajectories: see docs/training.md
    ppo_epochs: int = 1
    ppo_max_token_len_per_micro_batch: int = 4096  # micro-batches by token budget
    # > 0: also fit each micro-batch's estimated activations in this many GB (1e9 bytes); the
    # smaller of the two budgets wins (docs/training.md, "Micro-batches")
    micro_batch_memory_gb: float = 0.0
    use_remove_padding: bool = True
    # packed forwards compute a prompt shared by several samples (GRPO's n) once (docs/training.md)
    share_prompts: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual clip; must be > 1
    loss_agg_mode: str = "token-mean"  # token-mean | token-sum | seq-mean-token-{sum,mean,sum-norm}
    loss_scale_factor: int | None = None  # seq-mean-token-sum-norm's divisor; null: response_length
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    # k1 (kl) | abs | k2 (mse) | k3 (low_var_kl); a trailing "+" backpropagates k2's gradient
    kl_loss_type: str = "low_var_kl"
    fsdp_size: int = 1  # data-parallel processes; 1 = no sharding
    torch_threads: int = 0  # CPU threads of each training worker and its hybrid engine; 0: auto
    # log-probs and entropy renormalised over the set each token was sampled from (top-k/top-p);
    # unset: on when the native backend truncates (docs/algorithms.md, "Sampling-mask replay")
    replay_sampling_mask: bool | None = None
    # a vision-language policy's vision tower is not trained, and weight syncs leave it out
    # where every receiver holds it (docs/training.md, "Images")
    freeze_vision_tower: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class RefConfig:
    """The frozen reference policy used for the KL term."""

    enable: bool = False  # forced on when a KL loss or KL reward is used


@dataclass
class CriticConfig:
    """Value model for PPO with GAE."""

    enable: bool = False
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class DataConfig:
    """Prompt datasets: JSONL or parquet files, or HF `datasets` (a save_to_disk directory, or
    data files of any format `datasets` reads), rows of raw chat messages."""

    # each entry a .jsonl / .parquet file, a `datasets.save_to_disk` directory, or
    # "<builder>:<files>" for `datasets.load_dataset(builder, data_files=files)` (e.g. "csv:a.csv")
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    train_batch_size: int = 8  # prompts per step
    shuffle: bool = True
    seed: int = 0
    # rows whose rendered prompt (chat template + tool schemas) exceeds rollout.prompt_length:
    # false refuses the job before Ray starts naming the first; true drops them (verl's name)
    filter_overlong_prompts: bool = False


@dataclass
class KLControlConfig:
    """KL-in-reward coefficient: fixed, or adaptive towards a target KL."""

    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction between the rollout and training distributions."""

    bypass_mode: bool = False  # old_log_probs = rollout_log_probs (no actor re-forward)
    importance_sampling: str = "none"  # none | token | sequence  (verl: rollout_is)
    # truncate: min(r, threshold) | icepop: r where low <= r <= threshold, else 0
    importance_sampling_mode: str = "truncate"
    importance_sampling_threshold: float = 2.0  # upper bound on the ratio (verl: rollout_is_threshold)
    importance_sampling_low: float = 0.5  # icepop's lower bound
    # divide the weights by their batch mean (verl: rollout_is_batch_normalize)
    importance_sampling_batch_normalize: bool = False
    # none, or comma-separated criteria (verl: rollout_rs): token | sequence (ratio in
    # [rejection_low, rejection_high]) and verl's token_k1..k3, seq_{sum,mean}_k1..k3, seq_max_k2/k3
    rejection: str = "none"
    rejection_low: float = 0.5
    rejection_high: float = 2.0
    rejection_threshold: str | None = None  # thresholds of verl's criteria (verl: rollout_rs_threshold)


@dataclass
class OverlongConfig:
    """Answers cut at rollout.response_length (DAPO): out of the loss, or a soft length penalty."""

    filter: bool = False  # truncated answers (stop_reason length) get loss_mask 0
    buffer_len: int = 0  # > 0: reward falls linearly to -penalty_factor over the last buffer_len tokens
    penalty_factor: float = 1.0


@dataclass
class FilterGroupsConfig:
    """Dynamic sampling (DAPO): groups whose metric has zero variance are dropped and more prompts
    are generated until the batch is full or max_gen_batches prompt batches were drawn."""

    enable: bool = False
    metric: str = "reward"  # reward (the scalar score), or a reward detail such as acc
    max_gen_batches: int = 10  # prompt batches drawn per step at most, the first included


@dataclass
class AlgorithmConfig:
    """Advantage estimator and KL-in-reward."""

    adv_estimator: str = "grpo"  # grpo | gae
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class CustomRewardFunctionConfig:
    """verl's custom_reward_function: compute_score(data_source, solution_str, ground_truth,
    extra_info=None) -> float | dict, scoring every row."""

    path: str = ""  # a .py file or an importable module; "" = none
    name: str = "compute_score"


@dataclass
class RewardModelConfig:
    """A served sequence-classification reward model (one scalar head) on a reward pool of its
    own (docs/rewards.md)."""

    enable: bool = False
    path: str = ""  # an HF directory with AutoModelForSequenceClassification weights, or "tiny:reward"
    weight: float = 1.0  # its share of the summed reward
    n_devices: int = 1  # devices (CPU: cores) reserved for it, one replica each; 0: share the training workers'
    torch_threads: int = 1  # CPU threads of each replica
    max_batch_size: int = 32  # sequences in one forward; concurrent calls are batched up to it
    max_length: int = 2048  # a longer sequence fails its sample


@dataclass
class RewardJudgeConfig:
    """A generative LLM judge served by the native engine on replicas of its own: a prompt
    template, a verdict parser, a score (docs/rewards.md)."""

    enable: bool = False
    path: str = ""  # an HF causal-LM directory, or a tiny: model name
    weight: float = 1.0
    n_devices: int = 1  # devices (CPU: cores) of the judge's replicas; 0: share the training workers'
    torch_threads: int = 1
    # {prompt} (the row's last user message) and {response} (the policy's reply) are filled in
    prompt_template: str = ("Rate the answer from 0 to 10.\nQuestion: {prompt}\nAnswer: {response}\n"
                            "Reply as SCORE: <number>.")
    # a regex whose first group is the verdict's number; no match is a bad verdict
    verdict_pattern: str = r"SCORE:\s*(-?\d+(?:\.\d+)?)"
    score_scale: float = 0.1  # score = number x score_scale
    max_new_tokens: int = 16
    prompt_length: int = 1024  # longer judge prompts fail their sample
    kv_cache_memory_bytes: int = 1 << 26


@dataclass
class RewardConfig:
    """Where rewards come from: the user's functions (custom_function, reward_funcs) or, with
    neither, tandem's rule-based rewards by data source (docs/api.md, "Rewards"), plus a served
    reward model and judge (docs/rewards.md); all add up with their weights."""

    placement: str = "agent_loop"  # agent_loop (async order) | after_sampling (colocated order)
    custom_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    # TRL-style batched functions fn(prompts, completions, **columns) -> list[float]:
    # "path/to/file.py:name" or "package.module:name"
    reward_funcs: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # one per function; empty: all 1.0
    timeout_seconds: float = 60.0  # per call of a reward function; over it the sample fails
    rule_weight: float = 1.0  # weight of the rule reward by data_source (no user function); 0: off
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: RewardJudgeConfig = field(default_factory=RewardJudgeConfig)


@dataclass
class SeparateAsyncConfig:
    """separate_async: how many mini-batch updates happen between two weight syncs."""

    parameter_sync_step: int = 1
    # spillover: the training workers' engines generate too while the trainer waits for data
    spillover: bool = False
    spill_below_groups: int = 0  # join when fewer finished groups wait (0: actor.ppo_mini_batch_size)


@dataclass
class AsyncRolloutConfig:
    """The async modes' rollout buffer and staleness bound (sync mode ignores it)."""

    # largest (trainer version - head version) of a group in an update; under on_stale=wait it
    # must cover the longest generation counted in steps, or the trainer waits (docs/trainer.md)
    max_staleness: int = 8
    # wait: a group starts only if it can train within the bound, none is dropped | drop |
    # regenerate: anything starts, a finished group over the bound is discarded or drawn again
    on_stale: str = "wait"
    buffer_groups: int = 0  # prompt groups generating or waiting at once (0: 3 x data.train_batch_size)


@dataclass
class DebugConfig:
    """Rollout record and replay (slime's --save/--load-debug-rollout-data, --debug-rollout-only
    / --debug-train-only): train a step again on the trajectories another run generated."""

    save_rollouts: str = ""  # a folder: each step's scored trajectories go to step_<k>.pt there
    load_rollouts: str = ""  # a folder save_rollouts wrote: train_only reads the steps from it
    rollout_only: bool = False  # generate, score and save; no update, no weight sync
    train_only: bool = False  # no generation: every step trains on load_rollouts' trajectories


@dataclass
class TrainerConfig:
    """The outer loop: mode, steps, validation, checkpoints, logging."""

    trainer_mode: str = "sync"  # sync | colocate_async | separate_async
    total_steps: int = 10
    test_freq: int = 0  # validate every k steps (0: only before and after)
    save_freq: int = 0  # checkpoint every k steps (0: never)
    output_dir: str = "runs/default"
    resume: bool = False
    resume_missing: str = "warn"  # resume=true without a checkpoint: warn (start at step 0) | fail
    on_nonfinite_loss: str = "skip"  # skip: drop that optimizer step | stop: raise; NaN/inf loss
    seed: int = 0
    # the same job run twice on one machine gives the same tokens, metrics and weights; refused
    # where a component cannot promise it (docs/trainer.md, "Determinism")
    deterministic: bool = False
    # console (one line per step and validation), jsonl (metrics.jsonl, always written),
    # tensorboard, wandb, mlflow (each needs its package; the preflight names the install)
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    project_name: str = "tandem"  # wandb project / MLflow experiment
    experiment_name: str = ""  # wandb run / MLflow run name; "": output_dir's last part
    progress: bool = True
    separate_async: SeparateAsyncConfig = field(default_factory=SeparateAsyncConfig)
    async_rollout: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)
    n_devices: int = 1  # devices (CPU workers or GPUs) for the actor and hybrid rollout
    # deadline of the fleet's waits outside a weight sync: engine start, every control call to a
    # server, and each collective of the training group (FSDP)
    timeout_s: float = 600.0
    # deadline of each call to the training workers (log-probs, values, an update, a checkpoint
    # save or load): a stalled worker stops the run naming the phase instead of hanging it
    worker_timeout_s: float = 1800.0
    ray_address: str = ""  # join this Ray cluster ("auto", "ip:6379"); "" = $RAY_ADDRESS or start one
    placement_strategy: str = "PACK"  # training workers' bundles: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    debug: DebugConfig = field(default_factory=DebugConfig)  # sync mode only


@dataclass
class TandemConfig:
    """The root of the configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def changed_fields(section: Any, names: tuple[str, ...] | None = None) -> list[str]:
    """The fields of `section` (all, or `names`) whose value differs from the dataclass
    default: what a user set, for the checks that refuse options a layout or backend ignores."""
    default = type(section)()
    names = names or tuple(vars(default))
    return [name for name in names if getattr(section, name) != getattr(default, name)]
