"""The job's checks that need more than the config's fields, run before Ray or torch start (by
`tandem train | eval | serve` and `Trainer`): the registries know every name, the model resolves
and the lengths and budgets fit it, every dataset row loads and can be scored, the tool loop
has tools, a resume has a checkpoint. Each failure is one ConfigError naming the field."""

from __future__ import annotations

import logging
from pathlib import Path

from tandem.agent.dataset import DatasetRow, PromptDataset
from tandem.agent.prompt_fit import describe, loop_tool_schemas, overlong_rows, tokenizer_chat_format
from tandem.config.choices import ConfigError
from tandem.config.schema import TandemConfig
from tandem.models.tiny import resolve_model_path
from tandem.multimodal import VISION_FAMILIES, vision_model_type
from tandem.preflight.model_files import (check_model, checkpoint_model_problem, hf_config,
                                          latest_checkpoint, model_directory_if_known)
from tandem.preflight.model_fit import check_model_fit
from tandem.preflight.names import check_names
from tandem.rewards.registry import reward_input_problem
from tandem.rewards.scorer import RewardScorer
from tandem.tools.registry import ToolRegistry

__all__ = ["check_job", "check_model", "check_model_fit", "check_names", "check_prompts",
           "has_checkpoint"]

logger = logging.getLogger("tandem")


def check_job(config: TandemConfig, command: str = "train", rewards: RewardScorer | None = None,
              tools: ToolRegistry | None = None) -> None:
    """Raise ConfigError for the first problem of the job; log a warning for a missing resume
    checkpoint when trainer.resume_missing=warn."""
    check_names(config, tools)
    check_model(config.model.path)
    check_model_fit(config)
    output = Path(config.trainer.output_dir)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"trainer.output_dir: {output} is a file; a run writes its metrics, "
                          "checkpoints and config into a directory there. Choose another path")
    rewards = rewards or RewardScorer.from_config(
        config.reward, prompt_key=config.data.prompt_key, environment=config.rollout.environment)
    if not (rewards.functions or config.reward.model.enable or config.reward.judge.enable):
        # here, not in config/: Trainer(reward_fn=...) gives functions the config cannot see
        raise ConfigError("reward.rule_weight: is 0 and no other reward is given, so every "
                          "sample would score nothing; raise it, give reward.custom_function / "
                          "reward.reward_funcs or Trainer(reward_fn=...), or enable "
                          "reward.model / reward.judge")
    vision = vision_family(config.model.path) is not None
    problem = vision_problem(config) if vision else None
    if problem:
        raise ConfigError(problem)
    known = config.model.path.startswith("tiny:") or model_directory_if_known(config.model.path)
    if config.actor.freeze_vision_tower and not vision and known:
        raise ConfigError(f"actor.freeze_vision_tower: is true, but model.path="
                          f"{config.model.path} is a text model (no vision tower to freeze); "
                          "set it to false")

    def check_row(row: DatasetRow) -> str | None:
        if row.images and not vision:
            return (f"has {len(row.images)} image(s), but model.path={config.model.path} is a "
                    "text model: rows with images need a vision-language policy (Qwen2-VL "
                    "family, docs/engine.md \"Images\"); drop the images or change the model")
        if rewards.uses_registry:
            return reward_input_problem(row.data_source, row.ground_truth)
        return None

    splits = ["train"] + (["val"] if config.data.val_files else [])
    for split in splits:
        try:
            rows = PromptDataset.from_config(config.data, split, check_row=check_row)
        except (ValueError, FileNotFoundError) as error:
            raise ConfigError(f"data.{split}_files: {error}") from None
        if split == "train" and command == "train" and len(rows) < config.data.train_batch_size:
            raise ConfigError(f"data.train_batch_size: is {config.data.train_batch_size}, more "
                              f"than the {len(rows)} rows of data.train_files; lower it or add "
                              "rows")
    _check_tools(config, tools)
    _check_resume(config, command)


# the built-in tiny vision-language models (built on first use: not built here)
TINY_VISION = {"tiny:qwen2_vl": "qwen2_vl", "tiny:qwen2_5_vl": "qwen2_5_vl",
               "tiny:colours": "qwen2_vl"}


def vision_family(path: str) -> str | None:
    """model.path's vision-language model_type, None for a text model; from config.json alone
    (a model not on this machine yet counts as a text model here; its engine checks again)."""
    if path in TINY_VISION:
        return TINY_VISION[path]
    directory = model_directory_if_known(path)
    return vision_model_type(directory) if directory is not None else None


def vision_problem(config: TandemConfig) -> str | None:
    """What a vision-language policy's run asks for that is not built yet, with the fix."""
    rollout = config.rollout
    where = f"model.path={config.model.path} is a vision-language model, and"
    family = vision_family(config.model.path)
    if family not in VISION_FAMILIES:
        return (f"model.path: {config.model.path} is a {family!r} vision-language model; tandem "
                f"serves and trains {list(VISION_FAMILIES)} (their vision tower and 3-D "
                "positions); use one of those")
    if config.actor.fsdp_size != 1:
        return (f"actor.fsdp_size: is {config.actor.fsdp_size}; {where} its training forward "
                "takes images through the hidden states and an unsharded LM head; set it to 1")
    if rollout.tensor_model_parallel_size != 1 or rollout.disaggregation.enabled:
        return (f"rollout.tensor_model_parallel_size / rollout.disaggregation: {where} its images "
                "are served by one plain engine per replica so far (no tensor parallelism, no "
                "prefill/decode split); set the size to 1 and disaggregation off")
    return None


def check_prompts(config: TandemConfig, tools: ToolRegistry | None = None,
                  command: str = "train") -> None:
    """Every dataset row rendered as the loop renders it (it loads the tokenizer, so it runs
    after check_job, still before Ray): a row longer than rollout.prompt_length is a
    ConfigError, or with data.filter_overlong_prompts it is dropped (logged) unless too few fit."""
    schemas = loop_tool_schemas(config.rollout, tools)
    if schemas is None:  # the OpenAI-agent loop: its harness renders the prompts
        return
    chat_format = tokenizer_chat_format(str(resolve_model_path(config.model.path)))
    limit = config.rollout.prompt_length
    for split in ["train"] + (["val"] if config.data.val_files else []):
        dataset = PromptDataset.from_config(config.data, split)
        found = overlong_rows(dataset, chat_format, schemas, limit)
        if not found:
            continue
        what = describe(dataset, found, split, limit)
        if not config.data.filter_overlong_prompts:
            raise ConfigError(f"rollout.prompt_length: {what}; raise rollout.prompt_length or set "
                              "data.filter_overlong_prompts=true to train on the rows that fit")
        left = len(dataset) - len(found)
        if not left:
            raise ConfigError(f"rollout.prompt_length: {what}, so none is left; raise "
                              "rollout.prompt_length")
        if split == "train" and command == "train" and left < config.data.train_batch_size:
            raise ConfigError(f"data.train_batch_size: is {config.data.train_batch_size}, more "
                              f"than the {left} rows of data.train_files that fit "
                              "rollout.prompt_length; lower it, or raise rollout.prompt_length")
        logger.warning("data.filter_overlong_prompts: dropping %s", what)


def _check_tools(config: TandemConfig, tools: ToolRegistry | None) -> None:
    turns = config.rollout.multi_turn
    given = len(tools) if tools is not None else len(turns.tools)
    if turns.enable and not given:
        raise ConfigError("rollout.multi_turn.tools: is empty but rollout.multi_turn.enable=true; "
                          "list the tools the model may call (calculator, python, "
                          "path/to/tools.py:ClassName) or pass Trainer(tools=[...]), or disable "
                          "multi_turn")
    if config.rollout.environment.kind and tools is not None and len(tools):
        raise ConfigError(f"rollout.environment.kind: is {config.rollout.environment.kind}, whose "
                          f"sessions offer the environment's own actions, so the tools "
                          f"{tools.names()} would be ignored; drop them")
    if not turns.enable and tools is not None and len(tools):
        raise ConfigError(f"rollout.multi_turn.enable: is false, so the tools {tools.names()} "
                          "would be ignored (the single-turn loop calls none); set "
                          "rollout.multi_turn.enable=true")


def has_checkpoint(checkpoints: Path) -> bool:
    """Whether a run's checkpoints directory holds anything to resume from."""
    return (checkpoints / "latest").is_file() or any(checkpoints.glob("step_*"))


def _check_resume(config: TandemConfig, command: str) -> None:
    trainer = config.trainer
    checkpoints = Path(trainer.output_dir) / "checkpoints"
    if not trainer.resume:
        return
    if has_checkpoint(checkpoints):
        _check_checkpoint_model(config, checkpoints)
        return
    problem = (f"trainer.resume=true but {checkpoints} holds no checkpoint (no `latest`, no "
               "step_* directory)")
    if command == "eval":
        raise ConfigError(f"{problem}; train first, fix trainer.output_dir, or set "
                          "trainer.resume=false to evaluate the initial model")
    if trainer.resume_missing == "fail":
        raise ConfigError(f"{problem}; fix trainer.output_dir, or set trainer.resume=false "
                          "(or trainer.resume_missing=warn) to start from step 0")
    logger.warning("%s: starting from step 0 (trainer.resume_missing=fail makes this an "
                   "error)", problem)


def _check_checkpoint_model(config: TandemConfig, checkpoints: Path) -> None:
    """A resume checkpoint must come from the same model shape as model.path."""
    step = latest_checkpoint(checkpoints)
    model = hf_config(config.model.path)
    if model is not None and config.model.path.startswith("tiny:"):
        model.pop("vocab_size", None)  # the spec's is an upper bound, not the built model's
    problem = step and checkpoint_model_problem(step / "actor" / "config.json", model)
    if problem:
        raise ConfigError(problem)
