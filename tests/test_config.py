"""Config loading: YAML + overrides round trip, and every load-time validation rule."""

import pytest

from tandem.config import ConfigError, TandemConfig, load_config, to_yaml


def write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_are_valid():
    config = load_config()
    assert isinstance(config, TandemConfig)
    assert config.rollout.name == "native" and config.rollout.mode == "async"
    assert config.trainer.trainer_mode == "sync"


def test_yaml_and_overrides_round_trip(tmp_path):
    path = write(tmp_path, "rollout:\n  n: 8\n  temperature: 0.7\n  logprobs_mode: processed\n"
                           "  val_kwargs:\n    n: 2\n"
                           "trainer:\n  total_steps: 3\n")
    config = load_config(path, ["rollout.top_k=20", "trainer.trainer_mode=separate_async",
                                "rollout.checkpoint_engine.backend=shm",
                                "rollout.checkpoint_engine.engine_kwargs.shm_dir=/dev/shm",
                                "actor.optim.lr=3e-6"])
    assert config.rollout.n == 8 and config.rollout.temperature == 0.7
    assert config.rollout.val_kwargs.n == 2 and config.rollout.top_k == 20
    assert config.rollout.checkpoint_engine.engine_kwargs == {"shm_dir": "/dev/shm"}
    assert config.actor.optim.lr == 3e-6 and config.trainer.total_steps == 3
    again = load_config(write(tmp_path, to_yaml(config)))
    assert again == config


def test_seed_config_slice_fields_exist():
    config = load_config()
    rollout = config.rollout
    for name in ("name", "mode", "prompt_length", "response_length", "temperature", "top_p", "top_k",
                 "n", "calculate_log_probs", "tensor_model_parallel_size", "data_parallel_size",
                 "pipeline_model_parallel_size", "max_num_batched_tokens", "max_num_seqs",
                 "gpu_memory_utilization", "enable_prefix_caching", "free_cache_engine", "nnodes",
                 "n_gpus_per_node"):
        assert hasattr(rollout, name), name
    assert {"n", "temperature", "top_p", "top_k", "do_sample"} <= set(vars(rollout.val_kwargs))
    assert {"backend", "update_weights_bucket_megabytes", "engine_kwargs"} <= set(
        vars(rollout.checkpoint_engine))
    assert config.trainer.separate_async.parameter_sync_step == 1
    # staleness is bounded at admission by default: no finished group is dropped for its age
    assert (config.trainer.async_rollout.on_stale, config.trainer.async_rollout.max_staleness) == (
        "wait", 8)
    for policy in ("drop", "regenerate"):
        load_config(overrides=[f"trainer.async_rollout.on_stale={policy}"])


@pytest.mark.parametrize("overrides, field, words", [
    (["rollout.mode=sync"], "rollout.mode", "rollout.mode=async"),
    (["rollout.pipeline_model_parallel_size=2"], "rollout.pipeline_model_parallel_size", "Set it to 1"),
    (["rollout.name=trtllm"], "rollout.name", "native"),
    (["rollout.checkpoint_engine.backend=nixl"], "rollout.checkpoint_engine.backend", "naive"),
    (["trainer.trainer_mode=async"], "trainer.trainer_mode", "separate_async"),
    (["rollout.disaggregation.enabled=true"], "rollout.disaggregation.enabled", "not built"),
    (["rollout.top_p=0"], "rollout.top_p", "(0, 1]"),
    (["rollout.temperature=-1"], "rollout.temperature", ">= 0"),
    (["rollout.top_k=0"], "rollout.top_k", "-1"),
    (["actor.clip_ratio_c=1.0"], "actor.clip_ratio_c", "> 1"),
    (["actor.loss_agg_mode=mean"], "actor.loss_agg_mode", "token-mean"),
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator", "critic.enable"),
    (["trainer.async_rollout.on_stale=keep"], "trainer.async_rollout.on_stale",
     "wait, drop, regenerate"),
])
def test_invalid_values_name_the_field_and_fix(overrides, field, words):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=overrides)
    assert field in str(error.value) and words in str(error.value)


def test_disaggregation_is_refused_until_it_is_built():
    base = ["rollout.name=vllm", "rollout.disaggregation.enabled=true"]
    with pytest.raises(ConfigError, match="rollout.disaggregation.enabled: .* not built yet"):
        load_config(overrides=base)
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size"):
        load_config(overrides=["rollout.pipeline_model_parallel_size=2"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="a.b.c=value"):
        load_config(overrides=["rollout.n"])


def test_separate_async_rules(monkeypatch):
    from tandem.weight_sync import registry

    monkeypatch.setitem(registry._CHECKPOINT_ENGINES, "collective", "x:y")
    good = ["trainer.trainer_mode=separate_async", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
            "rollout.checkpoint_engine.backend=collective", "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=4", "trainer.separate_async.parameter_sync_step=2"]
    load_config(overrides=good)
    with pytest.raises(ConfigError, match="rollout.nnodes"):
        load_config(overrides=good + ["rollout.nnodes=0"])
    with pytest.raises(ConfigError, match="rollout.nnodes"):
        load_config(overrides=good + ["rollout.n_gpus_per_node=0"])
    with pytest.raises(ConfigError, match="rollout.checkpoint_engine.backend.*naive"):
        load_config(overrides=good + ["rollout.checkpoint_engine.backend=naive"])
    with pytest.raises(ConfigError, match=r"data.train_batch_size.*parameter_sync_step \(2\)"):
        load_config(overrides=good + ["data.train_batch_size=6"])


@pytest.mark.parametrize("overrides, field, words", [
    (["rollout.temperature=0.7"], "rollout.logprobs_mode", "processed"),
    (["rollout.calculate_log_probs=false", "algorithm.rollout_correction.rejection=token"],
     "algorithm.rollout_correction", "calculate_log_probs"),
    (["rollout.multi_turn.tools=[calculator]"], "rollout.multi_turn.enable", "ignored"),
    (["trainer.n_devices=2"], "actor.fsdp_size", "trainer.n_devices=2"),
    (["trainer.n_devices=3", "actor.fsdp_size=3", "rollout.n=4", "actor.ppo_mini_batch_size=2",
      "data.train_batch_size=2"], "actor.ppo_mini_batch_size", "does not split"),
    (["data.train_batch_size=4", "actor.ppo_mini_batch_size=8"], "actor.ppo_mini_batch_size", "padding"),
])
def test_cross_field_rules(overrides, field, words):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=overrides)
    assert field in str(error.value) and words in str(error.value)


def test_tempered_sampling_with_processed_logprobs_is_fine():
    config = load_config(overrides=["rollout.temperature=0.7", "rollout.logprobs_mode=processed"])
    assert config.rollout.temperature == 0.7


@pytest.mark.parametrize("name", ["examples/arithmetic.yaml", "examples/smollm2.yaml",
                                  "examples/reward_model.yaml",
                                  "src/tandem/demo/demo.yaml"])
def test_shipped_configs_load(name):
    from pathlib import Path

    load_config(Path(__file__).resolve().parents[1] / name)


def test_grpo_with_groups_of_one_is_rejected_naming_the_fix():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["algorithm.adv_estimator=grpo", "rollout.n=1"])
    message = str(error.value)
    assert message.startswith("rollout.n: is 1") and "rollout.n >= 2" in message
    assert "adv_estimator=gae" in message
    load_config(overrides=["algorithm.adv_estimator=grpo", "rollout.n=2"])
    # a critic's baseline needs no group, and validation never computes advantages
    load_config(overrides=["algorithm.adv_estimator=gae", "critic.enable=true", "rollout.n=1",
                           "rollout.val_kwargs.n=1"])


@pytest.mark.parametrize("override, suggestion", [
    ("trainer.totl_steps=3", "Did you mean trainer.total_steps?"),
    ("rollout.tools=[calculator]", "Did you mean rollout.multi_turn.tools?"),
    ("trainer.total_training_steps=3", "Did you mean trainer.total_steps (tandem's name for it)?"),
    ("trainer.default_local_dir=x", "Did you mean trainer.output_dir (tandem's name for it)?"),
    ("algorithm.rollout_is=token", "Did you mean algorithm.rollout_correction.importance_sampling"),
    ("num_generations=8", "Did you mean rollout.n (tandem's name for it)?"),
])
def test_a_misspelt_or_foreign_key_gets_a_suggestion(override, suggestion):
    from tandem.config.load import ConfigError, load_config

    with pytest.raises(ConfigError) as error:
        load_config(overrides=[override])
    assert "unknown config key" in str(error.value) and suggestion in str(error.value)


def test_a_config_from_a_dict_and_yaml_errors_with_line_and_column(tmp_path):
    from tandem.config.load import ConfigError, load_config

    config = load_config({"rollout": {"n": 3}, "trainer": {"loggers": ["console"]}},
                         overrides=["rollout.n=5"])
    assert config.rollout.n == 5 and config.trainer.loggers == ["console"]
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  n: 4\n  temperature: [1.0\ntrainer: {}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:4:8: not valid YAML: did not find expected ','"):
        load_config(path)
