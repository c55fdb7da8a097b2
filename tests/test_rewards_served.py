"""Served rewards: reward-model scores equal a direct HF forward, judge scores follow parsed
verdicts, a killed replica's calls are retried on another, and a lost pool fails only its
samples."""

import asyncio

import pytest
import ray
import torch

from float_bounds import U
from tandem.config.schema import RewardJudgeConfig, RewardModelConfig
from tandem.models.tiny import build_tiny_reward_model, resolve_model_path
from tandem.rewards.registry import RewardResult
from tandem.rewards.scorer import FAILED, RewardFunction, RewardScorer
from tandem.rewards.served import BAD_VERDICT, JudgeReward, RewardModelReward, same_tokenizer
from tandem.rewards.verdict import judge_prompt, parse_verdict
from tandem.rewards.worker import RewardWorker
from tandem.serving.reward_pool import RewardModelPool
from tandem.types import GenerateRequest, TokenOutput

SEQUENCES = [[5, 17, 230, 9, 44], [7] * 3, list(range(20, 83)), [300, 12, 12, 99, 41, 8, 8, 3]]


def direct_scores(path, dtype):
    """One unbatched, unpadded HF forward per sequence: the reference of the served scores."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).eval()
    with torch.inference_mode():
        return torch.tensor([float(model(input_ids=torch.tensor([s])).logits[0, 0])
                             for s in SEQUENCES], dtype=torch.float64)


def test_served_reward_model_scores_equal_a_direct_hf_forward(ray_cluster):
    path = build_tiny_reward_model()
    exact = direct_scores(path, torch.float64)
    single = direct_scores(path, torch.float32)

    async def run():
        pool = await RewardModelPool.create(str(path), RewardModelConfig(
            enable=True, path=str(path), n_devices=2, max_batch_size=3))
        try:
            client = pool.client()
            # concurrent calls are batched into shared, right-padded forwards on each server
            results = await asyncio.gather(*(client.score(f"r{i}", SEQUENCES) for i in range(6)))
            return results, await pool.stats()
        finally:
            await pool.shutdown()

    results, stats = asyncio.run(run())
    # float32 bound: the served (batched, padded) score may be off the float64 value by no more
    # than a few times what float32 HF itself is off by, plus a few ulp of the score
    single_error = float((single - exact).abs().max())
    bound = 4 * single_error + 8 * U * exact.abs()
    for scores in results:
        served = torch.tensor(scores, dtype=torch.float64)
        assert bool(((served - exact).abs() <= bound).all()), (served, exact, bound)
    assert sum(s["calls"] for s in stats.values()) == 6
    assert sum(s["sequences"] for s in stats.values()) == 6 * len(SEQUENCES)


def test_killed_reward_replica_mid_batch_is_retried_on_another(ray_cluster):
    path = build_tiny_reward_model()

    async def run():
        pool = await RewardModelPool.create(str(path), RewardModelConfig(
            enable=True, path=str(path), n_devices=2))
        try:
            client = pool.client()
            heavy = [list(range(1 + i, 400 + i)) for i in range(32)]  # long enough to be caught
            calls = [asyncio.ensure_future(client.score(f"k{i}", heavy)) for i in range(8)]
            while not (await pool.balancer.status.remote()).in_flight().get("reward-0"):
                await asyncio.sleep(0.005)
            ray.kill(pool.servers["reward-0"])  # mid-batch: calls are on it
            results = await asyncio.gather(*calls)
            status = await pool.balancer.status.remote()
            # the last server goes too: the reward fails these samples and nothing raises
            ray.kill(pool.servers["reward-1"])
            lost = await RewardModelReward(client)(fake_trajectories(2))
            return results, status, lost
        finally:
            await pool.shutdown()

    results, status, lost = asyncio.run(run())
    assert all(r == results[0] and None not in r for r in results)
    assert status.dead_servers == ["reward-0"] and status.retried_requests >= 1
    assert all(result.extra[FAILED] == 1.0 for result in lost)


class FakeTrajectory:
    def __init__(self, index, text="", ids=(3, 4, 5)):
        self.uid, self.session_id = f"u{index}", 0
        self.input_ids = torch.tensor(list(ids))
        self.metadata = {"response_text": text, "messages": [{"role": "user", "content": f"q{index}"}]}
        self.reward, self.reward_extra, self.data_source, self.ground_truth = None, {}, "x", None


def fake_trajectories(count, texts=None):
    return [FakeTrajectory(i, texts[i] if texts else "") for i in range(count)]


def test_verdict_parser_and_template():
    pattern = r"SCORE:\s*(-?\d+(?:\.\d+)?)"
    assert parse_verdict("blah SCORE: 7 and SCORE: 2", pattern, 0.1) == pytest.approx(0.7)
    assert parse_verdict("SCORE:-2.5", pattern) == -2.5
    assert parse_verdict("no verdict", pattern) is None
    assert parse_verdict("SCORE: 1", r"SCORE") is None  # a pattern without a group scores nothing
    assert judge_prompt("Q {prompt} A {response} {x}", "why", "because") == "Q why A because {x}"


class ScriptedJudge:
    """A judge client answering each prompt with a scripted verdict (keyed by the reply)."""

    def __init__(self, tokenizer, verdicts):
        self.tokenizer, self.verdicts, self.requests = tokenizer, verdicts, []

    async def generate(self, request: GenerateRequest) -> TokenOutput:
        self.requests.append(request)
        text = self.tokenizer.decode(request.prompt_ids)
        reply = next(v for key, v in self.verdicts.items() if f"Answer: {key}" in text)
        return TokenOutput(self.tokenizer.encode(reply), None, "completed", {"global_steps": 0})


def test_judge_scores_follow_parsed_verdicts_and_a_bad_one_fails_only_its_sample():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny:qwen2"))
    config = RewardJudgeConfig(enable=True, path="tiny:qwen2")
    client = ScriptedJudge(tokenizer, {"good": "SCORE: 9", "meh": "SCORE: 4", "odd": "I cannot say"})
    judge = JudgeReward(client, tokenizer, config.prompt_template, config.verdict_pattern,
                        config.score_scale, config.max_new_tokens, config.prompt_length)
    trajectories = fake_trajectories(3, ["good", "meh", "odd"])
    scorer = RewardScorer([RewardFunction("judge", judge, "served", 2.0)])
    asyncio.run(scorer.score(trajectories))
    assert [t.reward for t in trajectories] == pytest.approx([1.8, 0.8, 0.0])
    assert trajectories[2].reward_extra[FAILED] == 1.0 and trajectories[2].reward_extra[BAD_VERDICT] == 1.0
    assert FAILED not in trajectories[0].reward_extra
    assert all(r.sampling["temperature"] == 0.0 for r in client.requests)


def test_served_and_rule_rewards_add_up_with_weights_and_the_worker_batches():
    async def model(trajectories):  # a served reward model: 1 per sample, the second fails
        return [RewardResult(1.0) if i != 1 else RewardResult(0.0, {FAILED: 1.0})
                for i, _ in enumerate(trajectories)]

    calls = []

    def rule(data_source, solution_str, ground_truth, extra_info):
        calls.append(solution_str)
        return 0.5

    scorer = RewardScorer([RewardFunction("rule", rule, "verl", 2.0),
                           RewardFunction("reward_model", model, "served", 3.0)])
    assert scorer.served
    trajectories = fake_trajectories(3)
    asyncio.run(scorer.score(trajectories))
    assert [t.reward for t in trajectories] == [4.0, 0.0, 4.0]
    assert trajectories[0].reward_extra["reward/reward_model"] == 1.0

    worker = RewardWorker(scorer, max_batch=64)

    async def score_all():
        more = fake_trajectories(6)
        return await asyncio.gather(*(worker.score_one(t) for t in more))

    results = asyncio.run(score_all())
    assert [score for score, _ in results] == [4.0, 0.0, 4.0, 4.0, 4.0, 4.0]
    assert worker.batches < 6 and worker.take_busy_seconds() > 0  # queued ones share a call


def test_same_tokenizer_tells_the_tiny_reward_model_matches_the_policy():
    from transformers import AutoTokenizer

    policy = AutoTokenizer.from_pretrained(resolve_model_path("tiny:qwen2"))
    assert same_tokenizer(policy, AutoTokenizer.from_pretrained(build_tiny_reward_model()))
    other = AutoTokenizer.from_pretrained(build_tiny_reward_model(tokenizer_vocab_size=700))
    assert not same_tokenizer(policy, other)
    reward = RewardModelReward(None, other)  # different tokenizers: the chat is re-rendered
    trajectory = FakeTrajectory(0)
    text = other.apply_chat_template(trajectory.metadata["messages"], tokenize=False)
    assert reward.sequence(trajectory) == other.encode(text, add_special_tokens=False)
    assert RewardModelReward(None).sequence(trajectory) == [3, 4, 5]  # same: its own ids


def test_served_judge_follows_its_greedy_verdicts_and_survives_a_killed_replica(ray_cluster):
    """A real native-engine judge on two replicas of its own: each score is the parse of the
    judge's own greedy reply; a replica killed mid-batch leaves every score as it was."""
    from transformers import AutoTokenizer

    from tandem.config.schema import TandemConfig
    from tandem.fleet.served_rewards import ServedRewards

    config = TandemConfig()
    # the demo model (warmed up on word problems) answers with numbers: score its first digit
    config.reward.judge = RewardJudgeConfig(enable=True, path="tiny:demo", n_devices=2,
                                            verdict_pattern=r"(\d)", score_scale=1.0,
                                            max_new_tokens=12, prompt_length=512)
    config.trainer.timeout_s = 300
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny:demo"))

    async def run():
        served = ServedRewards(config)
        await served.start(None)
        try:
            (function,) = served.functions(tokenizer)
            judge = function.fn
            trajectories = fake_trajectories(6, [f"reply {i} is {i * 7}" for i in range(6)])
            expected = []
            for trajectory in trajectories:  # the verdicts, asked one by one through the client
                output = await judge.client.generate(GenerateRequest(
                    "direct", judge.prompt_ids(trajectory),
                    {"temperature": 0.0, "max_tokens": 12, "logprobs": False,
                     "stop_token_ids": [tokenizer.eos_token_id]}))
                expected.append(parse_verdict(tokenizer.decode(output.token_ids, skip_special_tokens=True),
                                              r"(\d)"))
            batch = asyncio.ensure_future(judge(trajectories))
            await asyncio.sleep(0.02)
            ray.kill(served.judge.replicas["replica-0"].main_server)  # mid-batch
            results = await batch
            return expected, results, await served.fault_metrics()
        finally:
            await served.stop()

    expected, results, faults = asyncio.run(run())
    assert any(want is not None for want in expected)  # some verdicts parse (greedy: fixed)
    for want, result in zip(expected, results):
        if want is None:
            assert result.extra == {FAILED: 1.0, BAD_VERDICT: 1.0}
        else:
            assert result.score == want and FAILED not in result.extra
    assert faults["serving/judge_dead_servers"] == 1.0


@pytest.mark.parametrize("overrides, field", [
    (["trainer.trainer_mode=separate_async", "reward.model.enable=true",
      "reward.model.path=tiny:reward", "reward.model.n_devices=0"], "reward.model.n_devices"),
    (["trainer.trainer_mode=separate_async", "reward.judge.enable=true",
      "reward.judge.path=tiny:qwen2", "reward.judge.n_devices=0"], "reward.judge.n_devices"),
    (["reward.model.enable=true"], "reward.model.path"),
    (["reward.judge.enable=true", "reward.judge.path=tiny:qwen2",
      "reward.judge.prompt_template=rate {prompt}"], "reward.judge.prompt_template"),
    (["reward.judge.enable=true", "reward.judge.path=tiny:qwen2",
      "reward.judge.verdict_pattern=SCORE"], "reward.judge.verdict_pattern"),
])
def test_served_reward_config_is_refused_at_load_naming_the_field(overrides, field):
    from tandem.config.choices import ConfigError
    from tandem.config.load import load_config

    base = ["trainer.n_devices=1", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"] \
        if "trainer.trainer_mode=separate_async" in overrides else []
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as error:
        load_config(overrides=[*base, *overrides])
    if field.endswith("n_devices"):
        assert "n_devices >= 1" in str(error.value)  # the fix: a pool of its own


def test_no_reward_at_all_is_refused_before_ray_but_a_python_reward_fn_counts(tmp_path):
    from tandem import Trainer
    from tandem.config.choices import ConfigError
    from tandem.config.load import load_config
    from tandem.demo.tasks import make_datasets
    from tandem.preflight import check_job

    train, _ = make_datasets(tmp_path / "data", 4, 2, seed=0)
    overrides = ["model.path=tiny:qwen2", f"data.train_files=[{train}]",
                 "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "reward.rule_weight=0",
                 f"trainer.output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"reward\.rule_weight: is 0 .*Trainer\(reward_fn"):
        check_job(load_config(overrides=overrides))
    trainer = Trainer({}, reward_fn=lambda *args, **kwargs: 1.0, overrides=overrides)
    assert len(trainer.rewards.functions) == 1  # the user's function alone, no rule reward


def test_served_reward_config_accepted_in_separate_async_with_its_own_pool():
    from tandem.config.load import load_config

    config = load_config(overrides=["trainer.trainer_mode=separate_async", "trainer.n_devices=1",
                                    "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
                                    "reward.model.enable=true", "reward.model.path=tiny:reward",
                                    "reward.rule_weight=0"])
    assert config.reward.model.n_devices == 1


def test_reward_client_releases_its_server_when_cancelled_and_routes_least_loaded():
    from tandem.serving.balancer import LoadBalancer
    from tandem.serving.reward_client import RewardModelClient

    class SlowServer:
        def __init__(self):
            self.calls = 0

        async def score(self, sequences):
            self.calls += 1
            await asyncio.sleep(10)
            return [0.0] * len(sequences)

    balancer, servers = LoadBalancer(), {"a": SlowServer(), "b": SlowServer()}
    for server_id in servers:
        balancer.add_server(server_id)
    client = RewardModelClient(balancer, servers)

    async def run():
        calls = [asyncio.ensure_future(client.score(f"c{i}", [[1, 2]])) for i in range(4)]
        await asyncio.sleep(0.05)
        in_flight = balancer.status().in_flight()
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await asyncio.sleep(0)
        return in_flight, balancer.status().in_flight()

    during, after = asyncio.run(run())
    assert during == {"a": 2, "b": 2} and after == {"a": 0, "b": 0}


def test_stalled_reward_replica_leaves_and_its_calls_run_on_another(ray_cluster):
    import os
    import signal

    path = build_tiny_reward_model()

    async def run():
        pool = await RewardModelPool.create(str(path), RewardModelConfig(
            enable=True, path=str(path), n_devices=2))
        stopped = pool.infos["reward-0"].pid
        try:
            reference = await pool.client().score("ref", SEQUENCES)
            os.kill(stopped, signal.SIGSTOP)  # alive, answering nothing
            client = pool.client(stall_timeout_s=2.0)
            results = await asyncio.gather(*(client.score(f"s{i}", SEQUENCES) for i in range(4)))
            return reference, results, await pool.balancer.status.remote()
        finally:
            os.kill(stopped, signal.SIGCONT)
            await pool.shutdown()

    reference, results, status = asyncio.run(run())
    assert all(r == reference for r in results)
    assert status.stalled_servers == ["reward-0"] and status.retried_requests >= 1
