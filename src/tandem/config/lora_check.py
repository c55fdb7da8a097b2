"""Load-time LoRA settings: rollout.lora_rank derived from actor.lora.rank, and actor.lora's
targets checked against the decoder linears the rollout engines serve with an adapter."""

from __future__ import annotations

from tandem.config.choices import ConfigError
from tandem.config.schema import LORA_TARGETS, TandemConfig, changed_fields


def derive_lora_rank(config: TandemConfig, given: set[str]) -> None:
    """rollout.lora_rank follows actor.lora.rank (the engines must fit the actor's adapter)."""
    rollout, rank = config.rollout, config.actor.lora.rank
    if "rollout.lora_rank" in given and rollout.lora_rank < 0:
        return  # out of its range: ranges.py says so
    if "rollout.lora_rank" in given and rollout.lora_rank != rank:
        raise ConfigError(f"rollout.lora_rank: is {rollout.lora_rank} but actor.lora.rank={rank}; "
                          "it is derived from actor.lora.rank, leave it unset")
    rollout.lora_rank = max(rank, 0)  # a negative rank is refused by ranges.py, under its own name
    kwargs = rollout.checkpoint_engine.engine_kwargs
    if rank > 0 and kwargs.get("double_buffer") is True:
        raise ConfigError("rollout.checkpoint_engine.engine_kwargs.double_buffer: weight slots "
                          "hold full versions and a LoRA sync sends only the adapter; set it "
                          "false (or leave it unset) with actor.lora")


def lora_problem(config: TandemConfig) -> str | None:
    """actor.lora: targets the engines serve, each once; its other options only with adapters
    on. The first problem as "field: why; fix", else None."""
    lora = config.actor.lora
    if not lora.rank:
        for field in changed_fields(lora, ("alpha", "dropout", "target_modules", "save_merged")):
            return (f"actor.lora.{field}: is {getattr(lora, field)}, but actor.lora.rank=0 (LoRA "
                    "off: a full fine-tune, no adapter), so it would do nothing; set "
                    f"actor.lora.rank > 0 or remove actor.lora.{field}")
        return None
    targets = list(lora.target_modules)
    if not targets:
        return f"actor.lora.target_modules: is empty; name some of {', '.join(LORA_TARGETS)}"
    unknown = [name for name in targets if name not in LORA_TARGETS]
    if unknown:
        return (f"actor.lora.target_modules: {unknown} are not decoder linears the rollout "
                f"engines serve with an adapter; use some of {', '.join(LORA_TARGETS)}")
    if len(set(targets)) != len(targets):
        return f"actor.lora.target_modules: {targets} names a module twice; list each once"
    return None
