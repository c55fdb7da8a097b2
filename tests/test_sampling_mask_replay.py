"""Sampling-mask replay: the engine records each token's top-k / top-p kept set, it travels to the
batch, and the actor's log-probs and entropy renormalise over it (docs/algorithms.md)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.agent.response import ResponseBuilder
from tandem.agent.sampling import sampling_params
from tandem.algorithms.kept_sets import kept_mass, restrict_to_kept
from tandem.algorithms.metrics import logprob_gap_metrics
from tandem.algorithms.policy_loss import ppo_clip_loss
from tandem.batch.jagged import batch_to_trajectories, field_values, padded_field, select_samples, \
    trajectories_to_batch
from tandem.batch.padding import pad_to_multiple
from tandem.config.choices import ConfigError
from tandem.config.load import load_config
from tandem.config.schema import OptimConfig, RolloutConfig
from tandem.models.tiny import TinyModelSpec, build_tiny_model
from tandem.rollout.engine.sampler import sample
from tandem.rollout.engine.sequence import Sequence
from tandem.rollout.native import NativeRollout
from tandem.rollout.vllm import VLLMRollout
from tandem.trainer.step_metrics import rollout_metrics
from tandem.training.engine import TrainingEngine
from tandem.training.forward import actor_forward, token_entropy, token_log_probs
from tandem.training.lm_head import chunked_log_probs
from tandem.types import GenerateRequest, KeptSets, SamplingParams, TokenOutput

# one row: logits [2, 1, 0, -1] at temperature 0.5 -> [4, 2, 0, -2]; top_k=2 keeps ids {0, 1}
OLD = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
NEW = torch.tensor([[2.1, 1.0, 0.0, -1.0]])  # the policy after a step
KEPT = (torch.tensor([2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))


def test_renormalised_log_prob_ppo_ratio_and_entropy_by_hand():
    label = torch.tensor([1])
    old = token_log_probs(restrict_to_kept(OLD, *KEPT), label, temperature=0.5)
    new = token_log_probs(restrict_to_kept(NEW, *KEPT), label, temperature=0.5)
    # 2 - log(e^4 + e^2) and 2 - log(e^4.2 + e^2)
    assert float(old) == pytest.approx(-2.1269280110, abs=1e-6)
    assert float(new) == pytest.approx(-2.3050833198, abs=1e-6)
    # the full softmax would give -2.1450779 and -2.3202938: off by log(kept mass) each
    assert float(token_log_probs(OLD, label, 0.5)) == pytest.approx(-2.1450779390, abs=1e-6)
    loss = ppo_clip_loss(new[None], old[None], torch.ones(1, 1), torch.ones(1, 1))
    assert float(loss.loss) == pytest.approx(-0.8368124491, abs=1e-6)  # -A * r, r inside the clip
    # entropy over {0, 1}: p = (1, e^-2) / (1 + e^-2)
    p0 = 1 / (1 + math.exp(-2))
    by_hand = -(p0 * math.log(p0) + (1 - p0) * math.log(1 - p0))
    assert by_hand == pytest.approx(0.3653338551, abs=1e-9)
    entropy = token_entropy(restrict_to_kept(OLD, *KEPT), 0.5, masked=True)
    assert float(entropy) == pytest.approx(by_hand, abs=1e-6)
    assert float(kept_mass(OLD / 0.5, *KEPT)) == pytest.approx(
        (math.exp(4) + math.exp(2)) / (math.exp(4) + math.exp(2) + 1 + math.exp(-2)), abs=1e-6)


def test_chunked_head_renormalises_rows_with_a_set_and_keeps_gradients_finite():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 6, bias=False)
    hidden = torch.randn(5, 8, requires_grad=True)
    labels = torch.tensor([0, 3, 2, 5, 1])
    counts = torch.tensor([2, 0, 3, 0, 1], dtype=torch.int32)  # rows 1, 3: no set (full softmax)
    ids = torch.tensor([0, 4, 1, 2, 3, 1], dtype=torch.int32)
    log_probs, entropy = chunked_log_probs(hidden, head, labels, 0.7, "grad", tokens_per_chunk=2,
                                           kept=(counts, ids))
    logits = restrict_to_kept(head(hidden).float(), counts, ids)
    assert torch.allclose(log_probs, token_log_probs(logits, labels, 0.7), atol=1e-6)
    assert torch.allclose(entropy, token_entropy(logits, 0.7, masked=True), atol=1e-6)
    (log_probs.sum() + entropy.sum()).backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(head.weight.grad).all()


def one_row(**params) -> list[Sequence]:
    return [Sequence("s", [0], SamplingParams(**params), frozenset(), 100)]


def test_recorded_set_is_the_top_k_then_nucleus_of_the_processed_logits():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0]])
    generator = torch.Generator().manual_seed(0)
    _, _, kept, log_mass = sample(logits.clone(), one_row(temperature=0.8, top_k=5, top_p=0.9,
                                                          return_kept_sets=True),
                                  "processed", generator)
    probs = (logits[0, :5] / 0.8).softmax(-1)  # top-k first, then the nucleus of that distribution
    before = probs.cumsum(0) - probs
    expected = [i for i in range(5) if before[i] < 0.9]
    assert expected == [0, 1, 2] and kept[0].tolist() == expected and kept[0].dtype == torch.int32
    # the set's mass under the tempered full softmax, by hand: e^(x/T) of ids 0-2 over all 8
    weights = [math.exp(x / 0.8) for x in logits[0].tolist()]
    assert log_mass[0] == pytest.approx(math.log(sum(weights[:3]) / sum(weights)), abs=1e-6)
    _, _, kept, log_mass = sample(logits.clone(), one_row(temperature=0.8, top_k=3), "processed",
                                  generator)
    assert kept == [None] and log_mass == [None]  # not asked for: nothing recorded
    _, _, kept, log_mass = sample(logits.clone(), one_row(temperature=0.8, top_k=8,
                                                          return_kept_sets=True),
                                  "processed", generator)
    assert kept == [None] and log_mass == [None]  # nothing removed: the full distribution


def test_kept_sets_travel_to_the_batch_with_none_on_context_tokens():
    builder = ResponseBuilder([5, 6])
    first = KeptSets(torch.tensor([2, 1], dtype=torch.int32), torch.tensor([3, 9, 4], dtype=torch.int32))
    builder.add_model_output(TokenOutput([9, 4], [-0.1, -0.2], "completed", {"global_steps": 0},
                                         first), 8)
    builder.add_context_tokens([7, 7])
    builder.add_model_output(TokenOutput([1], [-0.3], "completed", {"global_steps": 0},
                                         KeptSets(torch.tensor([1], dtype=torch.int32),
                                                  torch.tensor([1], dtype=torch.int32))), 8)
    trajectory = builder.to_trajectory("u", 0, 2, "completed")
    assert trajectory.kept_sets.counts.tolist() == [2, 1, 0, 0, 1]
    assert trajectory.kept_sets.ids.tolist() == [3, 9, 4, 1]
    plain = ResponseBuilder([5])
    plain.add_model_output(TokenOutput([2, 3, 4], [0.0] * 3, "completed", {"global_steps": 0}), 8)
    batch = trajectories_to_batch([trajectory, plain.to_trajectory("v", 0, 2, "completed")])
    assert field_values(batch["kept_counts"]).tolist() == [2, 1, 0, 0, 1, 0, 0, 0]
    assert field_values(batch["kept_token_ids"]).tolist() == [3, 9, 4, 1]
    padded = pad_to_multiple(batch, 4, eos_token_id=0)
    assert field_values(padded["kept_counts"]).tolist()[-2:] == [0, 0]
    picked = select_samples(padded, [2, 0])
    assert field_values(picked["kept_token_ids"]).tolist() == [3, 9, 4, 1]
    assert batch_to_trajectories(batch)[0].kept_sets.ids.tolist() == [3, 9, 4, 1]


def test_config_turns_replay_on_for_truncated_native_sampling_and_refuses_it_elsewhere():
    config = load_config(overrides=["rollout.top_p=0.7"])
    assert config.actor.replay_sampling_mask is True and config.rollout.return_kept_sets is True
    assert sampling_params(config.rollout, False, None, 8)["return_kept_sets"] is True
    assert "return_kept_sets" not in sampling_params(config.rollout, True, None, 8)  # validation
    assert load_config().actor.replay_sampling_mask is False
    assert load_config(overrides=["rollout.top_k=20", "actor.replay_sampling_mask=false"]
                       ).rollout.return_kept_sets is False
    assert load_config(overrides=["rollout.name=vllm", "rollout.top_p=0.7"]
                       ).actor.replay_sampling_mask is False
    with pytest.raises(ConfigError, match=r"actor.replay_sampling_mask: .*vllm backend does not "
                                          r"report.*rollout.name=native"):
        load_config(overrides=["rollout.name=vllm", "rollout.top_p=0.7",
                               "actor.replay_sampling_mask=true"])
    with pytest.raises(ConfigError, match="actor.replay_sampling_mask: .*keep the whole vocabulary"):
        load_config(overrides=["actor.replay_sampling_mask=true"])
    with pytest.raises(ConfigError, match="rollout.return_kept_sets: is True but actor.replay"):
        load_config(overrides=["rollout.return_kept_sets=true"])
    with pytest.raises(ValueError, match="return_kept_sets"):
        VLLMRollout.check_request(GenerateRequest("r", [1], {"return_kept_sets": True}))


SAMPLING = {"temperature": 0.8, "top_p": 0.7, "top_k": 20, "max_tokens": 24}


@pytest.fixture(scope="module")
def tiny_path():
    return build_tiny_model(TinyModelSpec())


async def test_replay_closes_the_rollout_gap_to_float32_noise(tiny_path):
    rollout = NativeRollout.create(tiny_path, RolloutConfig(logprobs_mode="processed",
                                                            kv_cache_memory_bytes=8 << 20))
    trajectories = []
    for i in range(6):
        prompt = [3 + (7 * i + j) % 900 for j in range(5 + i)]
        output = await rollout.generate(GenerateRequest(
            f"r{i}", prompt, {**SAMPLING, "seed": i, "return_kept_sets": True}))
        builder = ResponseBuilder(prompt)
        builder.add_model_output(output, SAMPLING["max_tokens"])
        trajectories.append(builder.to_trajectory(f"u{i}", 0, 2, output.stop_reason))
    batch = trajectories_to_batch(trajectories)
    assert int(field_values(batch["kept_counts"]).max()) <= 20
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    actor = TrainingEngine(model, "actor", 4096, optim=OptimConfig())

    def gap(of_batch) -> float:
        old = actor.compute_log_prob(of_batch, temperature=0.8).padded("log_probs")
        return logprob_gap_metrics(padded_field(batch["rollout_log_probs"]), old,
                                   padded_field(batch["response_mask"]))["rollout_gap/abs_diff_mean"]

    replay_on = gap(batch)
    replay_off = gap(batch.exclude("kept_counts", "kept_token_ids"))
    # independently: the mean -log(kept mass) of the sampled tokens under the HF model at 0.8
    minus_log_mass = []
    with torch.no_grad():
        for trajectory in trajectories:
            logits = model(trajectory.input_ids[None]).logits[0].float() / 0.8
            predicting = logits[trajectory.prompts.shape[0] - 1:-1]
            mass = kept_mass(predicting, trajectory.kept_sets.counts, trajectory.kept_sets.ids)
            minus_log_mass.append(-mass.log())
    mean_log_s = float(torch.cat(minus_log_mass).mean())
    print(f"rollout_gap/abs_diff_mean: replay on {replay_on:.2e}, off {replay_off:.4f}; "
          f"mean -log S {mean_log_s:.4f}")
    assert replay_on < 1e-5
    full_logits = actor_forward(model, batch, True, 0.8, logits_chunk_bytes=None).padded("log_probs")
    assert logprob_gap_metrics(padded_field(batch["rollout_log_probs"]), full_logits.detach(),
                               padded_field(batch["response_mask"]))["rollout_gap/abs_diff_mean"] < 1e-5
    assert mean_log_s > 0.05  # the filters really truncate
    assert replay_off == pytest.approx(mean_log_s, rel=1e-3)
    # the engine's own record of the kept mass, per step's metrics: the same log S
    recorded = rollout_metrics(trajectories, {"generate": 1.0})
    assert recorded["rollout/kept_log_mass"] == pytest.approx(-mean_log_s, rel=1e-3)
    masses = torch.cat([(-value).exp() for value in minus_log_mass])
    assert recorded["rollout/kept_mass"] == pytest.approx(float(masses.mean()), rel=1e-3)


def test_recorded_rollouts_keep_their_kept_sets(tmp_path):
    from tandem.trainer.rollout_files import load_rollouts, save_rollouts

    builder = ResponseBuilder([5, 6])
    builder.add_model_output(TokenOutput([9, 4], [-0.1, -0.2], "completed", {"global_steps": 0},
                                         KeptSets(torch.tensor([2, 0], dtype=torch.int32),
                                                  torch.tensor([3, 9], dtype=torch.int32))), 8)
    save_rollouts(tmp_path, 1, [builder.to_trajectory("u", 0, 2, "completed")])
    (back,) = load_rollouts(tmp_path, 1)
    assert back.kept_sets.counts.tolist() == [2, 0] and back.kept_sets.ids.tolist() == [3, 9]


async def test_resumable_client_joins_kept_sets_across_resumes():
    from tandem.serving.resumable_client import ResumableClient

    def kept(counts, ids):
        return KeptSets(torch.tensor(counts, dtype=torch.int32), torch.tensor(ids, dtype=torch.int32))

    class Scripted:
        def __init__(self):
            self.outputs = [
                TokenOutput([7, 8], [-0.1, -0.2], "aborted", {"global_steps": 2}, kept([2, 1], [7, 9, 8])),
                TokenOutput([], [], "aborted", {"global_steps": 3}),  # the server's empty abort: no sets
                TokenOutput([5], [-0.3], "completed", {"global_steps": 3}, kept([2], [4, 5])),
            ]

        async def generate(self, request):
            assert request.sampling["return_kept_sets"] is True
            return self.outputs.pop(0)

    out = await ResumableClient(Scripted()).generate(
        GenerateRequest("r", [1], {"max_tokens": 5, "return_kept_sets": True}))
    assert out.kept_sets.counts.tolist() == [2, 1, 2] and out.kept_sets.ids.tolist() == [7, 9, 8, 4, 5]
