"""The resumable client: partial rollout across weight updates (seed §3.6, §12.2).

When a request comes back "aborted" (the trainer is swapping weights), the tokens it already
has are appended to the prompt and the request is asked again, with the same request_id (so it
sticks to the same server) and the remaining budget. The re-ask waits inside the server until
generation resumes, so nothing spins here. Should aborted replies keep coming without a new token
(a server left rerouting, aborts faster than a token), the request fails after
`max_aborts_without_progress` of them in a row instead of spinning forever.
"""

from __future__ import annotations

from tandem.serving.client import ServerClient
from tandem.types import (KEPT_MASS_FIELDS, GenerateRequest, KeptSets, SamplingParams, TokenOutput,
                          append_version_run)


# Aborted replies in a row without a new token before a request gives up: far more than weight
# syncs produce (a re-ask waits in the paused server), few enough that a stuck request fails fast.
MAX_ABORTS_WITHOUT_PROGRESS = 64


class StalledRequestError(RuntimeError):
    """Aborted replies kept coming without a new token; the request gave up."""


class ResumableClient:
    """Same API as ServerClient; resumes aborted requests unless resume=False."""

    def __init__(self, client: ServerClient, resume: bool = True,
                 max_aborts_without_progress: int = MAX_ABORTS_WITHOUT_PROGRESS) -> None:
        if max_aborts_without_progress < 1:
            raise ValueError("max_aborts_without_progress must be >= 1, not "
                             f"{max_aborts_without_progress}")
        self.client = client
        self.resume = resume
        self.max_aborts_without_progress = max_aborts_without_progress

    async def generate(self, request: GenerateRequest) -> TokenOutput:
        """Generate up to max_tokens in total across aborts (the caller's dict is not mutated);
        extra_fields: global_steps (the last version), min_global_steps / max_global_steps,
        version_runs (every segment's, in token order) and resumes (how many times it asked
        again); kept_sets joined across segments when asked for."""
        request_id = request.request_id
        budget = SamplingParams.from_dict(request.sampling).max_tokens
        params = dict(request.sampling)
        token_ids: list[int] = []
        log_probs: list[float] | None = [] if params.get("logprobs", True) else None
        versions: list[tuple[int, int, int]] = []  # (min, max, last) of segments with tokens
        runs: list[list[int]] = []  # [[version, count], ...] of every token so far
        kept: list[KeptSets] = []
        kept_mass = dict.fromkeys(KEPT_MASS_FIELDS, 0.0)  # summed over the segments
        resumes = stalled = 0
        while True:
            params["max_tokens"] = budget - len(token_ids)
            output = await self.client.generate(request.replace(
                prompt_ids=list(request.prompt_ids) + token_ids, sampling=dict(params)))
            token_ids.extend(output.token_ids)
            log_probs = _join_log_probs(log_probs, output, request_id)
            if params.get("return_kept_sets") and output.token_ids:
                kept.append(_kept_sets(output, request_id))
                for key in kept_mass:
                    kept_mass[key] += output.extra_fields.get(key, 0.0)
            for version, count in output.version_runs:
                append_version_run(runs, version, count)
            if output.token_ids:
                fields = output.extra_fields
                versions.append((fields.get("min_global_steps", output.global_steps),
                                 fields.get("max_global_steps", output.global_steps),
                                 output.global_steps))
            stop_reason = output.stop_reason
            if stop_reason != "aborted" or not self.resume:
                break
            if len(token_ids) >= budget:
                stop_reason = "length"  # aborted exactly at the budget: nothing left to ask for
                break
            stalled = 0 if output.token_ids else stalled + 1
            if stalled >= self.max_aborts_without_progress:
                raise StalledRequestError(
                    f"request {request_id!r}: {stalled} aborted replies in a row without a new "
                    f"token ({len(token_ids)} of {budget} tokens so far); a server stays in "
                    "reroute mode (remove_replica(abort=True) without resume_generation()) or "
                    "aborts come faster than one token")
            resumes += 1
        versions = versions or [(output.global_steps,) * 3]
        extra = dict(output.extra_fields)
        extra.update(global_steps=versions[-1][2], min_global_steps=min(v[0] for v in versions),
                     max_global_steps=max(v[1] for v in versions), version_runs=runs,
                     resumes=resumes)
        if KEPT_MASS_FIELDS[0] in output.extra_fields:
            extra.update(kept_mass)
        kept_sets = KeptSets.join(kept) if params.get("return_kept_sets") else None
        return TokenOutput(token_ids, log_probs, stop_reason, extra, kept_sets)


def _kept_sets(output: TokenOutput, request_id: str) -> KeptSets:
    if output.kept_sets is None:
        raise ValueError(f"request {request_id!r}: return_kept_sets was asked for but the server "
                         "returned no kept sets; the backend breaks its kept_sets capability")
    return output.kept_sets


def _join_log_probs(log_probs: list[float] | None, output: TokenOutput,
                    request_id: str) -> list[float] | None:
    if log_probs is None:
        return None
    if output.log_probs is None:
        raise ValueError(f"request {request_id!r}: logprobs were asked for but the server "
                         "returned none; the backend breaks the one-logprob-per-token contract")
    return log_probs + list(output.log_probs)
