"""Per-token weight versions (issue 24): exact across abort/resume on the real native engine,
carried by the trajectory and the batch, and summed into the token-weighted lag metrics."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from tandem.agent.response import ResponseBuilder
from tandem.batch.jagged import batch_to_trajectories, field_lengths, trajectories_to_batch
from tandem.batch.padding import pad_to_multiple
from tandem.batch.trajectory import CONTEXT_VERSION, Trajectory
from tandem.config.schema import RolloutConfig
from tandem.models import build_tiny_model
from tandem.rollout.native import NativeRollout
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ServerOptions
from tandem.serving.server import RolloutServer
from tandem.trainer.step_metrics import merge_mini_batch_metrics, token_lag_metrics
from tandem.types import GenerateRequest, TokenOutput, cut_version_runs, expand_version_runs
from test_serving_scripted import load_weights

CONFIG = RolloutConfig(kv_cache_memory_bytes=16 << 20, block_size=16)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
            for name, tensor in weights.items()}


async def generated_tokens(manager: ServerManager) -> int:
    return sum(s["backend"]["generated_tokens"] for s in (await manager.stats()).values())


async def wait_for_tokens(manager: ServerManager, at_least: int) -> None:
    for _ in range(5000):
        if await generated_tokens(manager) >= at_least:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"the engine never reached {at_least} generated tokens")


async def assert_each_run_is_its_versions_output(model_path, prompt: list[int],
                                                 output: TokenOutput,
                                                 weights: dict[int, dict[str, torch.Tensor]]) -> None:
    """Each run is what its version's weights produce greedily from the tokens before it (one
    request alone): the stamps sit on exactly the tokens each version sampled."""
    direct = NativeRollout.create(model_path, CONFIG)
    start = 0
    for version, count in output.version_runs:
        await direct.update_weights(list(weights[version].items()), version)
        want = await direct.generate(GenerateRequest(
            f"d{version}", prompt + output.token_ids[:start], {**GREEDY, "max_tokens": count}))
        assert output.token_ids[start:start + count] == want.token_ids
        torch.testing.assert_close(torch.tensor(output.log_probs[start:start + count]),
                                   torch.tensor(want.log_probs), atol=1e-4, rtol=1e-4)
        assert want.version_runs == [[version, count]]
        start += count
    await direct.shutdown()


async def test_an_in_place_update_under_a_running_request_restamps_only_later_tokens(
        model_path) -> None:
    engine = NativeRollout.create(model_path, CONFIG)
    base = load_file(model_path / "model.safetensors")
    weights = {0: base, 1: perturbed(base, 1)}
    prompt, budget = [5, 6, 7], 200
    task = asyncio.ensure_future(engine.generate(
        GenerateRequest("r", prompt, {**GREEDY, "max_tokens": budget})))
    for _ in range(5000):
        if engine.stats()["generated_tokens"] >= 8:
            break
        await asyncio.sleep(0.001)
    await engine.update_weights(list(weights[1].items()), 1)  # no abort: preempt and recompute
    output = await task
    await engine.shutdown()
    assert [version for version, _ in output.version_runs] == [0, 1], output.version_runs
    assert sum(count for _, count in output.version_runs) == budget
    await assert_each_run_is_its_versions_output(model_path, prompt, output, weights)


async def test_a_request_interrupted_twice_carries_three_versions_on_exactly_their_tokens(
        model_path) -> None:
    host = RolloutServer("driver")
    manager = await ServerManager.create(CONFIG, ServerOptions(str(model_path)), "hybrid",
                                         hosts=[host])
    base = load_file(model_path / "model.safetensors")
    weights = {0: base, 1: perturbed(base, 1), 2: perturbed(base, 2)}
    budget, prompt = 240, [5, 6, 7]
    task = asyncio.ensure_future(manager.resumable_client().generate(
        GenerateRequest("traj", prompt, {**GREEDY, "max_tokens": budget})))
    boundaries = []  # tokens generated when each abort had drained
    for version in (1, 2):
        await wait_for_tokens(manager, (boundaries[-1] if boundaries else 0) + 8)
        aborted = await manager.control("abort_all_requests")
        assert sum(sum(counts) for counts in aborted.results.values()) == 1
        boundaries.append(await generated_tokens(manager))
        assert boundaries[-1] < budget, "the request finished before the abort; raise the budget"
        await load_weights(manager, list(weights[version].items()), version)
        await manager.control("resume_generation")
    output = await task
    await manager.shutdown()

    first, second = boundaries
    assert len(output.token_ids) == budget and output.extra_fields["resumes"] == 2
    assert output.version_runs == [[0, first], [1, second - first], [2, budget - second]]
    assert (output.extra_fields["min_global_steps"], output.extra_fields["max_global_steps"],
            output.global_steps) == (0, 2, 2)
    await assert_each_run_is_its_versions_output(model_path, prompt, output, weights)

    # -> trajectory (a tool observation between two calls) -> batch, aligned token for token
    builder = ResponseBuilder(prompt)
    builder.add_model_output(output, budget)
    builder.add_context_tokens([1, 2, 3])
    builder.add_model_output(TokenOutput([9, 9], [-0.5, -0.5], "completed",
                                         {"global_steps": 2, "version_runs": [[2, 2]]}), 2)
    trajectory = builder.to_trajectory("u", 0, num_turns=3, stop_reason="completed")
    expected = expand_version_runs(output.version_runs) + [CONTEXT_VERSION] * 3 + [2, 2]
    assert trajectory.response_versions.tolist() == expected
    assert (trajectory.min_global_steps, trajectory.max_global_steps) == (0, 2)


def trajectory(versions: list[int], mask: list[int], low: int, high: int,
               is_padding: bool = False) -> Trajectory:
    length = len(versions)
    return Trajectory(prompts=torch.tensor([1, 2]), responses=torch.arange(length),
                      response_mask=torch.tensor(mask),
                      rollout_log_probs=torch.zeros(length), min_global_steps=low,
                      max_global_steps=high, response_versions=torch.tensor(versions),
                      is_padding=is_padding, reward=0.0)


def test_the_batch_field_lines_up_with_the_responses() -> None:
    trajectories = [trajectory([3, 3, -1, 4], [1, 1, 0, 1], 3, 4),
                    trajectory([4, 4], [1, 1], 4, 4),
                    trajectory([2, -1, -1, 3, 4, 4, 4], [1, 0, 0, 1, 1, 1, 1], 2, 4)]
    batch = pad_to_multiple(trajectories_to_batch(trajectories), 4, eos_token_id=0)
    assert field_lengths(batch["response_versions"]).tolist() == \
        field_lengths(batch["responses"]).tolist() == [4, 2, 7, 1]
    assert batch["response_versions"].dtype == torch.long
    assert [t.response_versions.tolist() for t in batch_to_trajectories(batch)] == \
        [[3, 3, -1, 4], [4, 4], [2, -1, -1, 3, 4, 4, 4], [CONTEXT_VERSION]]


def test_versions_must_agree_with_the_mask_and_the_bounds() -> None:
    with pytest.raises(ValueError, match="where response_mask is 0"):
        trajectory([3, 3], [1, 0], 3, 3)
    with pytest.raises(ValueError, match="outside min/max_global_steps"):
        trajectory([3, 5], [1, 1], 3, 4)
    with pytest.raises(ValueError, match="must match responses"):
        Trajectory(torch.tensor([1]), torch.tensor([4, 5]), torch.tensor([1, 1]), torch.zeros(2),
                   0, 0, response_versions=torch.tensor([0]))
    legacy = Trajectory(torch.tensor([1]), torch.tensor([4, 5, 6]), torch.tensor([1, 0, 1]),
                        torch.zeros(3), 5, 6)  # no per-token versions: the oldest bound
    assert legacy.response_versions.tolist() == [5, CONTEXT_VERSION, 5]


def test_version_runs_default_check_and_cut() -> None:
    assert TokenOutput([1, 2], None, "length", {"global_steps": 7}).version_runs == [[7, 2]]
    assert TokenOutput([], None, "aborted", {"global_steps": 7}).version_runs == []
    with pytest.raises(ValueError, match="do not cover"):
        _ = TokenOutput([1, 2], None, "length", {"global_steps": 7,
                                                 "version_runs": [[7, 1]]}).version_runs
    assert cut_version_runs([[0, 3], [1, 2], [2, 4]], 4) == [[0, 3], [1, 1]]
    assert cut_version_runs([[0, 3]], 3) == [[0, 3]]


def test_token_lag_metrics_are_token_weighted_over_policy_tokens() -> None:
    trajectories = [trajectory([5, 5, -1, 6], [1, 1, 0, 1], 5, 6),  # lags 2, 2, 1
                    trajectory([7, 7, 7, 6, 6], [1, 1, 1, 1, 1], 6, 7),  # lags 0, 0, 0, 1, 1
                    trajectory([3, 3], [1, 1], 3, 3, is_padding=True)]  # left out
    metrics = token_lag_metrics(trajectories, version=7)
    assert metrics == {"staleness/token_lag_mean": 7 / 8, "staleness/token_lag_max": 2.0,
                       "staleness/tokens_lag_0": 3 / 8, "staleness/tokens_lag_1": 3 / 8,
                       "staleness/tokens_lag_2": 2 / 8, "staleness/policy_tokens": 8.0}
    assert token_lag_metrics(trajectories[2:], version=7) == {}
    part = {"staleness/lag_max": 1.0, "buffer/wait_seconds": 0.0, "staleness/dropped_total": 0.0,
            "staleness/regenerated_total": 0.0}
    merged = merge_mini_batch_metrics([{**part, **metrics},
                                       {**part, **token_lag_metrics(trajectories[1:2], 7)}])
    assert merged["staleness/token_lag_max"] == 2.0
    # token-weighted over both mini-batches (8 + 5 tokens), not a mean of the two means
    assert merged["staleness/policy_tokens"] == 13.0
    assert merged["staleness/token_lag_mean"] == pytest.approx((7 + 2) / 13)
    assert merged["staleness/tokens_lag_0"] == pytest.approx((3 + 3) / 13)
    assert merged["staleness/tokens_lag_2"] == pytest.approx(2 / 13)
