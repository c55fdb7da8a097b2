"""Supervised warm-up on generated tool-use transcripts, so GRPO starts from a model that knows
the format. Its tool-only phase ends only once the model samples probe tool calls and answers
exactly (WarmupRecipe.min_copy_probability). The result is cached: later runs with the same
recipe load it in a second.

`python -m tandem.demo.warmup DIR` (`make demo-model`) exports the result as the package's
shipped demo model (model.path tiny:demo), so `tandem demo` starts at GRPO on a fresh machine."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem import algorithms
from tandem.batch.jagged import padded_field, trajectories_to_batch
from tandem.batch.trajectory import Trajectory
from tandem.config.schema import OptimConfig
from tandem.demo.tasks import calculator_schemas, make_problem, transcript
from tandem.models.cache import build_once
from tandem.models.tiny import TinyModelSpec
from tandem.progress import progress_bar
from tandem.training.engine import TrainingEngine


# The demo's policy: a 0.9M-parameter Qwen2 (hidden 128, 4 layers) with the local 1k-token tokenizer.
DEMO_MODEL = TinyModelSpec(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=384, seed=1)


@dataclass(frozen=True)
class WarmupRecipe:
    """How the warm-up model is made; any change gives a new cache entry."""

    base_model: str  # directory of the randomly initialised tiny model
    steps: int = 400
    batch_size: int = 32
    lr: float = 1e-3  # 3e-3 leaves the model stuck before it learns to copy numbers
    warmup_steps: int = 20
    # Curriculum: the first tool_only_steps show only calculator transcripts (the model learns
    # the format and to copy numbers); afterwards only tool_fraction of them use the tool and
    # the rest answer directly, so the warmed-up model prefers guessing (mostly wrong) and GRPO
    # has something to teach: call the tool.
    tool_only_steps: int = 300
    tool_fraction: float = 0.2
    seed: int = 0
    # Gate after the tool-only phase: GRPO samples at temperature 1, so greedy copying is not
    # enough; the mean probability of sampling a probe's whole tool call and final answer
    # exactly (given that it calls the tool) must reach min_copy_probability, else
    # gate_steps more tool-only steps, at most max_gate_steps in all.
    min_copy_probability: float = 0.9
    probe_problems: int = 64
    gate_steps: int = 50
    max_gate_steps: int = 600

    def key(self) -> str:
        digest = hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return f"demo-warmup-{digest[:10]}"


def transcript_trajectory(tokenizer, messages: list[dict], tools: list[dict]) -> Trajectory:
    """Tokenise a transcript the way the tool loop builds one: prompt, then assistant tokens
    (through the end-of-turn token, mask 1) and template/tool tokens (mask 0)."""
    def render(upto: int, generation_prompt: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(messages[:upto], tools=tools, return_dict=False,
                                                  add_generation_prompt=generation_prompt))

    prompt = render(2, True)
    tokens, mask, previous = [], [], prompt
    for index in range(2, len(messages)):
        assistant = messages[index]["role"] == "assistant"
        current = render(index + 1, not assistant)
        if current[: len(previous)] != previous:
            raise ValueError("chat template rendering of a prefix is not stable")
        delta = current[len(previous):]
        if assistant:  # content + eos are the policy's; the trailing boundary is the template's
            end = delta.index(tokenizer.eos_token_id) + 1
            tokens += delta
            mask += [1] * end + [0] * (len(delta) - end)
        else:
            tokens += delta
            mask += [0] * len(delta)
        previous = current
    while mask and mask[-1] == 0:  # the response ends with the final eos
        tokens.pop()
        mask.pop()
    return Trajectory(prompts=torch.tensor(prompt), responses=torch.tensor(tokens),
                      response_mask=torch.tensor(mask, dtype=torch.float32),
                      rollout_log_probs=torch.zeros(len(tokens)), min_global_steps=0,
                      max_global_steps=0)


def sft_loss_fn(micro_batch, outputs):
    """Token-mean negative log-likelihood of the policy's tokens over the whole mini-batch."""
    mask = padded_field(micro_batch["loss_mask"], 0).float()
    loss = algorithms.aggregate_loss(-outputs.padded("log_probs"), mask, "token-mean",
                                     global_token_count=outputs.mini_batch.global_tokens)
    return loss, {}


def tool_copy_probability(model: torch.nn.Module, tokenizer, problems: list[dict]) -> float:
    """Mean over problems of P(sampling, at temperature 1, the exact tool call and final answer
    of the tool transcript | the response starts with <tool_call>)."""
    return float(tool_copy_log_probs(model, tokenizer, problems).exp().mean())


@torch.no_grad()
def tool_copy_log_probs(model: torch.nn.Module, tokenizer, problems: list[dict]) -> torch.Tensor:
    """Per problem: log P(the tool transcript's policy tokens after <tool_call>), i.e. the
    whole call, end of turn and final answer, at temperature 1."""
    from tandem.training.forward import actor_forward

    tools = calculator_schemas()
    trajectories = [transcript_trajectory(tokenizer, transcript(problem, True), tools)
                    for problem in problems]
    batch = trajectories_to_batch(trajectories)
    was_training = model.training
    model.eval()
    outputs = actor_forward(model, batch, use_remove_padding=False)
    model.train(was_training)
    log_probs, mask = outputs.padded("log_probs"), padded_field(batch["loss_mask"], 0).bool()
    first = mask.float().argmax(dim=-1)  # the <tool_call> token: the choice GRPO is to teach
    mask[torch.arange(len(problems)), first] = False
    return (log_probs * mask).sum(dim=-1)


def warm_up(recipe: WarmupRecipe, progress: bool = True) -> Path:
    """Train (once) and return the directory of the warmed-up model (HF format + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def build(directory: Path) -> None:
        torch.manual_seed(recipe.seed)
        rng = random.Random(recipe.seed)
        tokenizer = AutoTokenizer.from_pretrained(recipe.base_model)
        model = AutoModelForCausalLM.from_pretrained(recipe.base_model, dtype=torch.float32)
        optim = OptimConfig(lr=recipe.lr, warmup_steps=recipe.warmup_steps, schedule="constant",
                            grad_clip=1.0)
        engine = TrainingEngine(model, "actor", max_token_len=16384, use_remove_padding=False,
                                optim=optim, total_steps=recipe.steps)
        tools = calculator_schemas()
        probe_rng = random.Random(recipe.seed + 1)  # probes never drawn for training
        probes = [make_problem(probe_rng) for _ in range(recipe.probe_problems)]

        def train(steps: int, fraction: float, desc: str) -> None:
            bar = progress_bar(range(steps), desc=desc, disable=not progress)
            for _ in bar:
                trajectories = [transcript_trajectory(tokenizer, transcript(make_problem(rng),
                                                                            rng.random() < fraction),
                                                      tools)
                                for _ in range(recipe.batch_size)]
                metrics = engine.train_mini_batch(trajectories_to_batch(trajectories), sft_loss_fn)
                bar.set_postfix(loss=f"{metrics['actor/loss']:.3f}")

        tool_only = min(recipe.tool_only_steps, recipe.steps)
        train(tool_only, 1.0, "warm-up (supervised, tool only)")
        extra, copy = 0, tool_copy_probability(engine.model, tokenizer, probes)
        # a warm-up no longer than its tool-only phase is a smoke run: no gate
        while recipe.steps > tool_only and copy < recipe.min_copy_probability:
            if extra >= recipe.max_gate_steps:
                raise RuntimeError(
                    f"demo warm-up: after {tool_only + extra} tool-only steps the model samples a "
                    f"probe's tool call and answer exactly with probability {copy:.2f} < "
                    f"min_copy_probability {recipe.min_copy_probability}; GRPO would start from "
                    "a model that cannot use the tool. Raise WarmupRecipe.max_gate_steps or lr")
            print(f"[demo] warm-up: tool copy probability {copy:.3f} < "
                  f"{recipe.min_copy_probability}; {recipe.gate_steps} more tool-only steps", flush=True)
            train(recipe.gate_steps, 1.0, "warm-up (supervised, tool only)")
            extra += recipe.gate_steps
            copy = tool_copy_probability(engine.model, tokenizer, probes)
        train(recipe.steps - tool_only, recipe.tool_fraction, "warm-up (supervised, mixed)")
        print(f"[demo] warm-up: tool copy probability {copy:.3f} after the tool-only phase "
              f"({tool_only + extra} steps), "
              f"{tool_copy_probability(engine.model, tokenizer, probes):.3f} at the end", flush=True)
        engine.model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return build_once(recipe.key(), build)


# the shipped models (`make demo-model`): name -> WarmupRecipe fields besides base_model.
# demo: what `tandem demo` starts from; calculator: a short tool-only warm-up, so the model
# calls the calculator in this format (its numbers often wrong), for examples and tests of tools
SHIPPED_RECIPES = {
    "demo": {},  # WarmupRecipe's defaults: 400 steps of 32 after the copy gate (7 min on 2 cores)
    "calculator": {"steps": 60, "batch_size": 8, "lr": 2e-3, "tool_only_steps": 60,
                   "warmup_steps": 5},
}


def export_model(directory: Path, name: str = "demo", progress: bool = True) -> Path:
    """Warm DEMO_MODEL up with SHIPPED_RECIPES[name] and write the HF model + tokenizer to
    `directory`, with recipe.json saying how it was made."""
    import shutil

    from tandem.models.tiny import build_tiny_model

    recipe = WarmupRecipe(base_model=str(build_tiny_model(DEMO_MODEL)), **SHIPPED_RECIPES[name])
    built = warm_up(recipe, progress)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        old.unlink()
    for source in built.iterdir():
        if source.is_file() and not source.name.startswith("."):
            shutil.copy2(source, directory / source.name)
    fields = {k: v for k, v in asdict(recipe).items() if k != "base_model"}
    (directory / "recipe.json").write_text(json.dumps({
        "made_by": f"python -m tandem.demo.warmup {directory} --recipe {name}",
        "base_model": asdict(DEMO_MODEL), "recipe": fields}, indent=1) + "\n")
    return directory


def main(argv: list[str] | None = None) -> None:
    """`python -m tandem.demo.warmup DIR [--recipe demo|calculator]`: export a shipped model."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tandem.demo.warmup", description=main.__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--recipe", choices=sorted(SHIPPED_RECIPES), default="demo")
    args = parser.parse_args(argv)
    print(export_model(args.directory, args.recipe))


if __name__ == "__main__":
    main()
