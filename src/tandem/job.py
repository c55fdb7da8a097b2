"""`tandem.Trainer`: the user's RL job (config, reward functions, tools) run the way `tandem
train` runs it: checks before Ray or torch start, the configured trainer mode, metrics and
plots under trainer.output_dir, and the trained model saved at the last step."""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from tandem.config.load import load_config
from tandem.config.schema import TandemConfig
from tandem.preflight import check_job, check_prompts
from tandem.rewards.scorer import RewardScorer
from tandem.tools.registry import Tool, ToolRegistry, build_tool_registry

ValidationHook = Callable[[int, dict[str, float]], None]


class Trainer:
    """An RL job. config: a TandemConfig, a YAML path or a nested dict (with `overrides`
    "a.b.c=value" applied); reward_fn: verl's compute_score(data_source, solution_str,
    ground_truth, extra_info=None); reward_funcs: TRL-style batched functions; tools: Tool
    instances besides those rollout.multi_turn.tools names. Everything is checked here."""

    def __init__(self, config: TandemConfig | str | Path | Mapping[str, Any],
                 reward_fn: Callable[..., Any] | None = None,
                 reward_funcs: Sequence[Callable[..., Any]] = (), tools: Sequence[Tool] = (),
                 overrides: Sequence[str] = ()) -> None:
        if isinstance(config, TandemConfig):
            if overrides:
                raise ValueError("overrides apply to a YAML path or dict; a TandemConfig is "
                                 "already loaded (change its fields instead)")
            self.config = config
        else:
            self.config = load_config(config, overrides)
        config = self.config
        self.rewards = RewardScorer.from_config(config.reward, reward_fn, reward_funcs,
                                                prompt_key=config.data.prompt_key,
                                                environment=config.rollout.environment)
        self.tools: ToolRegistry | None = None
        if config.rollout.multi_turn.enable or tools:
            try:
                self.tools = build_tool_registry(config.rollout.multi_turn.tools, tools)
            except ValueError as error:
                from tandem.config.load import ConfigError

                raise ConfigError(str(error)) from None
        check_job(config, "train", self.rewards, self.tools)
        check_prompts(config, self.tools)

    @property
    def output_dir(self) -> Path:
        """trainer.output_dir: metrics.jsonl, plots, checkpoints."""
        return Path(self.config.trainer.output_dir)

    @property
    def model_dir(self) -> Path | None:
        """The latest saved actor (HF model + tokenizer, loads with from_pretrained), or None."""
        from tandem.training.checkpoint import read_latest

        step = read_latest(self.output_dir / "checkpoints")
        return None if step is None else self.output_dir / "checkpoints" / f"step_{step}" / "actor"

    def fit(self, on_validation: ValidationHook | None = None) -> dict[str, float]:
        """Train for trainer.total_steps; returns the final validation metrics ({} without
        data.val_files). on_validation(step, metrics) runs after each validation."""
        return asyncio.run(self.fit_async(on_validation))

    async def fit_async(self, on_validation: ValidationHook | None = None) -> dict[str, float]:
        """fit() for a caller that already runs an event loop (a notebook: `await ...`)."""
        import ray

        from tandem.fleet import placement, startup

        if not startup.has_early_marks():  # a library call counts its start-up from here
            startup.set_origin(time.time())
        started_ray = not ray.is_initialized()
        # ray.init mostly waits for Ray's processes to come up: torch and the rest import meanwhile
        importing = threading.Thread(target=importlib.import_module,
                                     args=("tandem.trainer.rl_trainer",), name="tandem-imports")
        importing.start()
        placement.init_ray(self.config)
        startup.mark_early("ray")
        importing.join()
        from tandem.quiet import quiet_libraries
        from tandem.trainer.modes import fit
        from tandem.trainer.plots import plot_run
        from tandem.trainer.rl_trainer import RLTrainer

        quiet_libraries()
        try:
            trainer = RLTrainer(self.config, rewards=self.rewards, tools=self.tools)
            await trainer.start()
            try:
                validation = await fit(trainer, on_validation)
            finally:
                await trainer.stop()
            plot_run(self.output_dir)
        finally:
            if started_ray:
                ray.shutdown()
        return validation
