"""Command line: `tandem train CONFIG [a.b=c ...]`, `tandem eval CONFIG [...]`, `tandem demo [...]`,
`tandem make-data DIR` (the arithmetic word problems as JSONL), `tandem serve CONFIG [...]` (the
OpenAI-compatible endpoint over the config's model)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

from tandem.quiet import quiet_libraries


def _train(config_path: str, overrides: list[str]) -> None:
    from tandem.config.load import load_config
    from tandem.trainer.plots import plot_run
    from tandem.trainer.rl_trainer import RLTrainer
    from tandem.trainer.sync import fit_sync

    config = load_config(config_path, overrides)

    async def run() -> dict:
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            return await fit_sync(trainer)
        finally:
            await trainer.stop()

    validation = asyncio.run(run())
    plot_run(config.trainer.output_dir)
    print(json.dumps(validation, indent=1))


def _eval(config_path: str, overrides: list[str]) -> None:
    from tandem.config.load import load_config
    from tandem.trainer.rl_trainer import RLTrainer

    config = load_config(config_path, overrides)

    async def run() -> dict:
        trainer = RLTrainer(config, evaluation_only=True)
        await trainer.start()
        try:
            if config.trainer.resume:
                await trainer.load_latest_checkpoint()
            await trainer.sync_weights()
            return await trainer.validate()
        finally:
            await trainer.stop()

    print(json.dumps(asyncio.run(run()), indent=1))


def _serve(config_path: str, overrides: list[str]) -> None:
    from tandem.agent.chat_format import ChatFormat
    from tandem.agent.recorder import ChatRecorder
    from tandem.config.load import load_config
    from tandem.serving.openai_endpoint import EndpointServer, create_app
    from tandem.trainer.rl_trainer import RLTrainer

    config = load_config(config_path, overrides)
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
                                               settings.api_key), settings.host, settings.port)
            print(f"serving {settings.served_model_name!r} at {await server.start()}", flush=True)
            await server.wait()
        finally:
            await trainer.stop()

    asyncio.run(run())


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `tandem` command."""
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "RL training from a YAML config"),
                       ("eval", "validation metrics of a config's model (or its latest checkpoint)"),
                       ("serve", "an OpenAI-compatible endpoint over the config's model")):
        command = commands.add_parser(name, help=text)
        command.add_argument("config", help="YAML config file")
        command.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    data = commands.add_parser("make-data", help="write the arithmetic train/val JSONL files")
    data.add_argument("directory")
    data.add_argument("--train-size", type=int, default=512)
    data.add_argument("--val-size", type=int, default=64)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--kind", choices=["tool", "easy"], default="tool",
                      help="tool: word problems needing the calculator; easy: small sums (no tool)")
    demo = commands.add_parser("demo", help="the CPU demo: GRPO teaches a tiny model a calculator tool")
    demo.add_argument("overrides", nargs="*", help="a.b.c=value overrides of the demo config")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    if args.command == "train":
        _train(args.config, args.overrides)
    elif args.command == "eval":
        _eval(args.config, args.overrides)
    elif args.command == "serve":
        _serve(args.config, args.overrides)
    elif args.command == "make-data":
        from pathlib import Path

        from tandem.demo.tasks import make_datasets

        for path in make_datasets(Path(args.directory), args.train_size, args.val_size, args.seed,
                                  args.kind):
            print(path)
    else:
        from tandem.demo.run import run_demo

        run_demo(args.overrides)


if __name__ == "__main__":
    main()
