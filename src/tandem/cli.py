"""Command line: `tandem train CONFIG [a.b=c ...]`, `tandem eval CONFIG [...]`, `tandem demo [...]`,
`tandem make-data DIR` (the arithmetic word problems as JSONL), `tandem serve CONFIG [...]` (the
OpenAI-compatible endpoint over the config's model).

Before torch or Ray is imported, the config, the datasets (every row's reward inputs) and the
resume checkpoint are checked, so a mistake shows in well under a second as one message;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger("tandem")


def checked_config(config_path: str, overrides: list[str], command: str) -> Any:
    """The loaded config after the checks that need no torch: datasets, rewards, resume."""
    from tandem.agent.dataset import PromptDataset
    from tandem.config.load import ConfigError, load_config
    from tandem.rewards import reward_input_problem

    from tandem.config.kv_budget import hf_config
    from tandem.config.model_check import checkpoint_model_problem, latest_checkpoint

    config = load_config(config_path, overrides)
    trainer = config.trainer
    output = Path(trainer.output_dir)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"trainer.output_dir: {output} is a file; a run writes its metrics, "
                          "checkpoints and config into a directory there. Choose another path")
    splits = ["train"] + (["val"] if config.data.val_files else [])
    for split in splits:
        rows = PromptDataset.from_config(config.data, split, check_row=lambda row: reward_input_problem(
            row.data_source, row.ground_truth))
        if split == "train" and command == "train" and len(rows) < config.data.train_batch_size:
            raise ConfigError(f"data.train_batch_size: is {config.data.train_batch_size}, more "
                              f"than the {len(rows)} rows of data.train_files; lower it or add "
                              "rows")
    checkpoints = output / "checkpoints"
    if trainer.resume and not has_checkpoint(checkpoints):
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
    step = latest_checkpoint(checkpoints) if trainer.resume else None
    model = hf_config(config.model.path)
    if model is not None and config.model.path.startswith("tiny:"):
        model.pop("vocab_size")  # the spec's is an upper bound, not the built model's
    problem = step and checkpoint_model_problem(step / "actor" / "config.json", model)
    if problem:
        raise ConfigError(problem)
    return config


def has_checkpoint(checkpoints: Path) -> bool:
    """Whether a run's checkpoints directory holds anything to resume from."""
    return (checkpoints / "latest").is_file() or any(checkpoints.glob("step_*"))


def _train(config_path: str, overrides: list[str]) -> None:
    config = checked_config(config_path, overrides, "train")
    from tandem.trainer import placement
    from tandem.trainer.startup import mark_early

    mark_early("config")
    # ray.init mostly waits for Ray's processes to come up: torch and the rest import meanwhile
    importing = threading.Thread(target=importlib.import_module, args=("tandem.trainer.rl_trainer",),
                                 name="tandem-imports")
    importing.start()
    placement.init_ray(config)
    mark_early("ray")
    importing.join()
    from tandem.quiet import quiet_libraries

    quiet_libraries()
    from tandem.trainer.plots import plot_run
    from tandem.trainer.rl_trainer import RLTrainer
    from tandem.trainer.modes import fit

    async def run() -> dict:
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            return await fit(trainer)
        finally:
            await trainer.stop()

    validation = asyncio.run(run())
    plot_run(config.trainer.output_dir)
    print(json.dumps(validation, indent=1))


def _eval(config_path: str, overrides: list[str]) -> None:
    config = checked_config(config_path, overrides, "eval")
    from tandem.quiet import quiet_libraries

    quiet_libraries()
    from tandem.trainer.rl_trainer import RLTrainer

    async def run() -> dict:
        trainer = RLTrainer(config, evaluation_only=True)
        await trainer.start()
        try:
            if config.trainer.resume and not await trainer.load_latest_checkpoint():
                raise RuntimeError(f"trainer.resume=true but no checkpoint could be loaded from "
                                   f"{config.trainer.output_dir}/checkpoints")
            await trainer.sync_weights()
            return await trainer.validate()
        finally:
            await trainer.stop()

    print(json.dumps(asyncio.run(run()), indent=1))


def _serve(config_path: str, overrides: list[str]) -> None:
    config = checked_config(config_path, overrides, "serve")
    from tandem.quiet import quiet_libraries

    quiet_libraries()
    from tandem.agent.chat_format import ChatFormat
    from tandem.agent.recorder import ChatRecorder
    from tandem.agent.openai_endpoint import EndpointServer, create_app
    from tandem.trainer.rl_trainer import RLTrainer

    settings = config.rollout.openai_agent

    async def run() -> None:
        trainer = RLTrainer(config, evaluation_only=True)
        await trainer.start()
        try:
            if config.trainer.resume:
                await trainer.load_latest_checkpoint()
            await trainer.sync_weights()
            recorder = ChatRecorder(trainer.client(), ChatFormat(trainer.tokenizer), config.rollout)
            server = EndpointServer(create_app(recorder, settings.served_model_name,
                                               settings.api_key, settings.max_request_bytes),
                                    settings.host, settings.port)
            await server.serve_until_signal(lambda url: print(
                f"serving {settings.served_model_name!r} at {url}", flush=True))
        finally:
            await trainer.stop()

    asyncio.run(run())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "RL training from a YAML config"),
                       ("eval", "validation metrics of a config's model (or its latest checkpoint)"),
                       ("serve", "an OpenAI-compatible endpoint over the config's model")):
        command = commands.add_parser(name, help=text, parents=[debug])
        command.add_argument("config", help="YAML config file")
        command.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    data = commands.add_parser("make-data", help="write the arithmetic train/val JSONL files",
                               parents=[debug])
    data.add_argument("directory")
    data.add_argument("--train-size", type=int, default=512)
    data.add_argument("--val-size", type=int, default=64)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--kind", choices=["tool", "easy"], default="tool",
                      help="tool: word problems needing the calculator; easy: small sums (no tool)")
    demo = commands.add_parser("demo", help="the CPU demo: GRPO teaches a tiny model a calculator tool",
                               parents=[debug])
    demo.add_argument("overrides", nargs="*", help="a.b.c=value overrides of the demo config")
    demo.add_argument("--warmup-steps", type=int, default=400, help="supervised warm-up steps")
    demo.add_argument("--train-size", type=int, default=512, help="training problems")
    demo.add_argument("--val-size", type=int, default=64, help="held-out problems")
    return parser


def _run(args: argparse.Namespace) -> None:
    if args.command == "train":
        _train(args.config, args.overrides)
    elif args.command == "eval":
        _eval(args.config, args.overrides)
    elif args.command == "serve":
        _serve(args.config, args.overrides)
    elif args.command == "make-data":
        from tandem.demo.tasks import make_datasets

        for path in make_datasets(Path(args.directory), args.train_size, args.val_size, args.seed,
                                  args.kind):
            print(path)
    else:
        from tandem.demo.run import run_demo
        from tandem.quiet import quiet_libraries

        quiet_libraries()
        run_demo(args.overrides, args.train_size, args.val_size, args.warmup_steps)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `tandem` command: exit status 2 for a config error, 1 for any other."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tandem.trainer.startup").setLevel(logging.INFO)  # its one summary line
    try:
        _run(args)
    except KeyboardInterrupt:  # Ctrl-C before `tandem serve` serves, or during train/eval
        print(f"tandem {args.command}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as error:  # one message per error; the traceback only on request
        if args.debug:
            raise
        from tandem.config.load import ConfigError

        config_error = isinstance(error, ConfigError)
        message = str(error) if config_error else f"{type(error).__name__}: {error}"
        print(f"tandem {args.command}: error: {message}\n(run with --debug to see the traceback)",
              file=sys.stderr)
        sys.exit(2 if config_error else 1)


if __name__ == "__main__":
    main()
