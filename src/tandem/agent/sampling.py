"""The sampling dict an agent loop sends with each generate call (seed §6.3).

Training uses rollout.temperature/top_p/top_k, except that a row with do_sample=False is
greedy (temperature 0, top_p 1, top_k -1). Validation ignores that row flag and uses
rollout.val_kwargs: greedy when val_kwargs.do_sample is False. repetition_penalty is always 1.0.
"""

from __future__ import annotations

from typing import Any

from tandem.config.schema import RolloutConfig

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}


def sampling_params(config: RolloutConfig, validate: bool, do_sample: bool | None,
                    max_tokens: int) -> dict[str, Any]:
    """The unified sampling dict for one call; max_tokens is this call's token budget."""
    if validate:
        val = config.val_kwargs
        filters = ({"temperature": val.temperature, "top_p": val.top_p, "top_k": val.top_k}
                   if val.do_sample else dict(GREEDY))
    elif do_sample is False:
        filters = dict(GREEDY)
    else:
        filters = {"temperature": config.temperature, "top_p": config.top_p,
                   "top_k": config.top_k}
    params = {**filters, "repetition_penalty": 1.0, "logprobs": config.calculate_log_probs,
              "max_tokens": max_tokens}
    if config.return_kept_sets and not validate and filters["temperature"] > 0:
        params["return_kept_sets"] = True  # training replays the kept sets (actor.replay_sampling_mask)
    return params


def remaining_budget(config: RolloutConfig, prompt_tokens: int, response_tokens: int) -> int:
    """Tokens one more call may produce: the response budget, capped by the context limit
    prompt_length + response_length."""
    context_left = config.prompt_length + config.response_length - prompt_tokens - response_tokens
    return min(config.response_length - response_tokens, context_left)


def check_prompt_length(prompt_tokens: int, config: RolloutConfig, uid: str) -> None:
    """A rendered prompt longer than rollout.prompt_length is an error, never silently cut."""
    if prompt_tokens > config.prompt_length:
        raise ValueError(f"prompt {uid or '?'} renders to {prompt_tokens} tokens, more than "
                         f"rollout.prompt_length={config.prompt_length}; raise "
                         "rollout.prompt_length or filter long prompts out of the dataset")
