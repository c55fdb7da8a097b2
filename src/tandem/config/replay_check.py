"""Load-time sampling-mask replay settings: actor.replay_sampling_mask resolved (unset: on when the
native backend truncates with top_p < 1 or top_k > 0) and rollout.return_kept_sets derived from it;
refused where the backend cannot report the kept sets or nothing is truncated."""

from __future__ import annotations

from tandem.config.choices import ConfigError
from tandem.config.schema import TandemConfig

KEPT_SET_BACKENDS = ("native",)  # the backends that report each token's kept set


def truncates(config: TandemConfig) -> bool:
    """Whether training rollouts sample from a truncated distribution (top-p or top-k)."""
    rollout = config.rollout
    return rollout.temperature > 0 and (rollout.top_p < 1.0 or rollout.top_k > 0)


def derive_replay_sampling_mask(config: TandemConfig, given: set[str]) -> None:
    """Resolve actor.replay_sampling_mask and set rollout.return_kept_sets from it."""
    actor, rollout = config.actor, config.rollout
    if actor.replay_sampling_mask is None:
        actor.replay_sampling_mask = rollout.name in KEPT_SET_BACKENDS and truncates(config)
    if "rollout.return_kept_sets" in given and rollout.return_kept_sets != actor.replay_sampling_mask:
        raise ConfigError(f"rollout.return_kept_sets: is {rollout.return_kept_sets} but "
                          f"actor.replay_sampling_mask={actor.replay_sampling_mask}; it is derived "
                          "from actor.replay_sampling_mask, leave it unset")
    rollout.return_kept_sets = bool(actor.replay_sampling_mask)


def replay_problem(config: TandemConfig) -> str | None:
    """Replay on where it cannot be honoured, as "field: why; fix", else None."""
    if not (config.actor.replay_sampling_mask or config.rollout.return_kept_sets):
        return None
    name = config.rollout.name
    if name not in KEPT_SET_BACKENDS:
        return (f"actor.replay_sampling_mask: is true, but the {name} backend does not report the "
                "set of token ids each token was sampled from (tandem's adapter reads only the "
                "sampled token's logprob; no sampling-mask output of the engine is wired in), so "
                "training could not renormalise over it; use rollout.name=native or set "
                "actor.replay_sampling_mask=false (the ratios then carry the log of the kept mass)")
    if not truncates(config):
        return (f"actor.replay_sampling_mask: is true, but rollout.top_p={config.rollout.top_p} "
                f"and rollout.top_k={config.rollout.top_k} (temperature "
                f"{config.rollout.temperature}) keep the whole vocabulary, so there is no kept set "
                "to replay; set top_p < 1 or top_k > 0, or actor.replay_sampling_mask=false")
    if config.rollout.return_kept_sets != bool(config.actor.replay_sampling_mask):
        return ("rollout.return_kept_sets: differs from actor.replay_sampling_mask; it is derived "
                "from it, leave it unset")
    return None
