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
import json
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("tandem")


def checked_config(config_path: str, overrides: list[str], command: str) -> Any:
    """The loaded config after the checks that need no torch (tandem.preflight)."""
    from tandem.config.load import load_config
    from tandem.preflight import check_job

    config = load_config(config_path, overrides)
    check_job(config, command)
    return config


def _train(config_path: str, overrides: list[str]) -> None:
    from tandem.job import Trainer
    from tandem.fleet.startup import mark_early

    trainer = Trainer(config_path, overrides=overrides)
    mark_early("config")  # the CLI's start-up counts from the process start
    print(json.dumps(trainer.fit(), indent=1))


def _eval(config_path: str, overrides: list[str]) -> None:
    from tandem.preflight import check_prompts

    config = checked_config(config_path, overrides, "eval")
    check_prompts(config, command="eval")  # loads the tokenizer: after the torch-free checks
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
    from tandem import __version__

    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
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
    data = commands.add_parser("make-data", help="write the arithmetic (or colour pictures') "
                               "train/val JSONL files", parents=[debug])
    data.add_argument("directory")
    data.add_argument("--train-size", type=int, default=512)
    data.add_argument("--val-size", type=int, default=64)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--kind", choices=["tool", "easy", "colours"], default="tool",
                      help="tool: word problems needing the calculator; easy: small sums (no "
                           "tool); colours: pictures to name the colour of (examples/colours.yaml; "
                           "sizes default to 96 and 24 there)")
    demo = commands.add_parser("demo", help="the CPU demo: GRPO teaches a tiny model a calculator tool",
                               parents=[debug])
    demo.add_argument("overrides", nargs="*", help="a.b.c=value overrides of the demo config")
    demo.add_argument("--warmup-steps", type=int, default=None,
                      help="redo the supervised warm-up with this many steps (default: start from "
                           "the shipped warmed-up model, tiny:demo)")
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
    elif args.command == "make-data" and args.kind == "colours":
        from tandem.demo.colours import make_colour_datasets

        sizes = (96, 24) if (args.train_size, args.val_size) == (512, 64) else (
            args.train_size, args.val_size)
        for path in make_colour_datasets(Path(args.directory), *sizes, seed=args.seed):
            print(path)
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
    logging.getLogger("tandem.fleet.startup").setLevel(logging.INFO)  # its one summary line
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
