"""Load-time checks of the training side's fields: the actor's loss and micro-batches, the
advantage estimator, the KL terms and rollout correction. Ranges are ranges.py's and choices
choices.py's (both checked first); the micro-batch memory against the model is the preflight's."""

from __future__ import annotations

from tandem.config.choices import KL_TYPES, unknown_value
from tandem.config.rejection_spec import parse_rejection
from tandem.config.schema import TandemConfig


def training_problem(config: TandemConfig) -> str | None:
    """The first actor or algorithm setting that would not train as written, or None."""
    return (_actor_problem(config) or _kl_problem("actor.kl_loss_type", config.actor.kl_loss_type)
            or _kl_problem("algorithm.kl_penalty", config.algorithm.kl_penalty)
            or _correction_problem(config) or _estimator_problem(config)
            or _overlong_problem(config) or _filter_groups_problem(config))


# verl's names for the group metric; tandem's scalar score is "reward"
_VERL_METRICS = ("score", "seq_reward", "seq_final_reward")


def _filter_groups_problem(config: TandemConfig) -> str | None:
    groups = config.algorithm.filter_groups
    if not groups.enable:
        return None
    if config.rollout.n < 2:
        return (f"algorithm.filter_groups.enable: rollout.n={config.rollout.n}, and a group of one "
                "sample has no variance, so every group would be dropped; set rollout.n >= 2 or "
                "algorithm.filter_groups.enable=false")
    if not groups.metric.strip():
        return ("algorithm.filter_groups.metric: is empty; use reward (the score) or a detail "
                "the reward function returns, such as acc")
    if groups.metric in _VERL_METRICS:
        return (f"algorithm.filter_groups.metric: is {groups.metric!r}, verl's name for the "
                "score; tandem calls it reward: set algorithm.filter_groups.metric=reward")
    return None


def _overlong_problem(config: TandemConfig) -> str | None:
    overlong, limit = config.algorithm.overlong, config.rollout.response_length
    if overlong.buffer_len > limit:
        return (f"algorithm.overlong.buffer_len: is {overlong.buffer_len}, longer than "
                f"rollout.response_length={limit}, so even an empty answer would be penalised; "
                f"set it to at most {limit}")
    return None


def _actor_problem(config: TandemConfig) -> str | None:
    actor, rollout = config.actor, config.rollout
    if actor.loss_scale_factor is not None and actor.loss_scale_factor <= 0:
        return (f"actor.loss_scale_factor: is {actor.loss_scale_factor}; it must be a positive "
                "constant (or null: rollout.response_length)")
    longest = rollout.prompt_length + rollout.response_length
    if actor.ppo_max_token_len_per_micro_batch < longest:
        return (f"actor.ppo_max_token_len_per_micro_batch: is "
                f"{actor.ppo_max_token_len_per_micro_batch}, below the longest trajectory "
                f"rollout.prompt_length + rollout.response_length = {longest}; raise it to at "
                f"least {longest}")
    if actor.micro_batch_memory_gb and not actor.use_remove_padding:
        return ("actor.micro_batch_memory_gb: sizes packed micro-batches, but "
                "actor.use_remove_padding=false: a padded forward also holds its padding tokens, "
                "which the estimate cannot bound. Set actor.use_remove_padding=true, or "
                "actor.micro_batch_memory_gb=0 and size micro-batches with "
                "actor.ppo_max_token_len_per_micro_batch")
    if config.data.train_batch_size < actor.ppo_mini_batch_size:
        return (f"actor.ppo_mini_batch_size: is {actor.ppo_mini_batch_size} prompts, more than "
                f"data.train_batch_size={config.data.train_batch_size}: a mini-batch would be "
                "mostly padding. Lower it or raise the batch size")
    n_devices = config.trainer.n_devices
    if actor.fsdp_size != n_devices:
        return (f"actor.fsdp_size: is {actor.fsdp_size} but trainer.n_devices={n_devices}: in the "
                "hybrid layout every device runs one FSDP rank; set both to the same value")
    if (actor.ppo_mini_batch_size * rollout.n) % n_devices:
        return (f"actor.ppo_mini_batch_size: a mini-batch of {actor.ppo_mini_batch_size} prompts "
                f"x rollout.n={rollout.n} trajectories does not split over trainer.n_devices="
                f"{n_devices}")
    return None


def _kl_problem(field: str, value: str) -> str | None:
    if value.rstrip("+") == "full":
        return (f"{field}: 'full' (the exact KL over the whole vocabulary) needs both policies' "
                "full distributions per token, which the trainer does not keep (verl does not "
                f"implement it either); use an estimator instead: {', '.join(KL_TYPES)}")
    return None if value in KL_TYPES else unknown_value(field, value, KL_TYPES)


def _correction_problem(config: TandemConfig) -> str | None:
    prefix = "algorithm.rollout_correction"
    correction = config.algorithm.rollout_correction
    low, threshold = correction.importance_sampling_low, correction.importance_sampling_threshold
    if correction.importance_sampling_mode == "icepop" and not 0 < low <= threshold:
        return (f"{prefix}.importance_sampling_low: is {low}; "
                "icepop keeps ratios in [importance_sampling_low, importance_sampling_threshold], "
                "so it must be > 0 and <= importance_sampling_threshold")
    try:
        parse_rejection(correction.rejection, correction.rejection_low, correction.rejection_high,
                        correction.rejection_threshold)
    except ValueError as error:
        return f"{prefix}.rejection: {error}"
    calculated = config.rollout.calculate_log_probs
    corrects = correction.importance_sampling != "none" or correction.rejection != "none"
    if corrects and not calculated:
        return (f"{prefix}: importance sampling and rejection compare rollout and actor "
                "log-probs, so rollout.calculate_log_probs must be true (or set both to none)")
    if correction.bypass_mode and not calculated:
        return (f"{prefix}.bypass_mode: uses rollout_log_probs as old_log_probs, so "
                "rollout.calculate_log_probs must be true")
    return None


def _estimator_problem(config: TandemConfig) -> str | None:
    estimator, n = config.algorithm.adv_estimator, config.rollout.n
    if estimator == "grpo" and n < 2:
        return (f"rollout.n: is {n}, but adv_estimator=grpo normalises each reward against its "
                "prompt's group: a group of one gets advantage 0 and learns nothing. Set "
                "rollout.n >= 2 (e.g. rollout.n=4) or use algorithm.adv_estimator=gae with a "
                "critic")
    if estimator == "gae" and not config.critic.enable:
        return ("algorithm.adv_estimator: gae needs a value model: set critic.enable=true "
                "(or use adv_estimator=grpo)")
    return None
