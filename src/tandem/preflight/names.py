"""The config's names that registries and the environment resolve: the rollout backend, the
checkpoint engine and its engine_kwargs, the tools of the tool loop, rollout.environment's class
or verifiers environment, and each logger's package."""

from __future__ import annotations

import importlib.util

from tandem.config.choices import LOGGER_PACKAGES, ConfigError, unknown_value
from tandem.extras import install_command
from tandem.config.schema import TandemConfig
from tandem.rollout.registry import rollout_backend_names
from tandem.tools.registry import ToolRegistry, tool_class
from tandem.user_code import UserCodeError, load_object
from tandem.weight_sync.registry import checkpoint_engine_names, engine_kwargs_problem


def check_names(config: TandemConfig, tools: ToolRegistry | None = None) -> None:
    """Raise ConfigError for the first name nothing resolves; `tools`: the job's built tools
    (then rollout.multi_turn.tools was resolved building them)."""
    rollout = config.rollout
    if rollout.name not in rollout_backend_names():
        raise ConfigError(unknown_value("rollout.name", rollout.name, rollout_backend_names()))
    ckpt = rollout.checkpoint_engine
    engines = ("auto", *checkpoint_engine_names())
    if ckpt.backend not in engines:
        raise ConfigError(unknown_value("rollout.checkpoint_engine.backend", ckpt.backend, engines))
    problem = engine_kwargs_problem(ckpt.backend, dict(ckpt.engine_kwargs))
    if problem:
        raise ConfigError(f"rollout.checkpoint_engine.engine_kwargs: {problem}")
    for entry in rollout.multi_turn.tools if tools is None else ():
        try:
            tool_class(entry)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    _check_environment(config)
    for name in config.trainer.loggers:
        package = LOGGER_PACKAGES[name]
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(f"trainer.loggers: lists {name!r}, but the {package} package is not "
                              f"installed; {install_command(name, package)} or drop {name!r}")


def _check_environment(config: TandemConfig) -> None:
    """rollout.environment's gym class imports, or its verifiers environment loads (the package
    installed, the id and args accepted): before Ray starts, not at the first session."""
    environment = config.rollout.environment
    try:
        if environment.kind == "gym":
            load_object(environment.id, "rollout.environment.id")
        elif environment.kind == "verifiers":
            from tandem.agent.verifiers_env import load_verifiers_environment

            load_verifiers_environment(config.rollout)
    except (UserCodeError, ImportError, ValueError) as error:
        raise ConfigError(str(error)) from None
