"""Arithmetic word problems whose answers need a calculator, and tool-use transcripts for warm-up."""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ann", "Bob", "Cai", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo"]
THINGS = ["apples", "books", "coins", "pens", "cards", "boxes", "eggs", "cups", "shells", "stamps"]
SYSTEM_PROMPT = "Use the calculator tool, then give the final number."


def calculator_schemas() -> list[dict]:
    """The calculator's JSON schema exactly as the tool loop renders it into the prompt."""
    from tandem.tools.registry import build_tool_registry

    return build_tool_registry(["calculator"]).schemas()


def make_problem(rng: random.Random) -> dict:
    """One word problem: its question, the expression that solves it and the answer."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.choice(["add", "sub", "mul"])
    if kind == "add":
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        question, expression, answer = f"{name} has {a} {thing} and gets {b} more. How many {thing}?", f"{a} + {b}", a + b
    elif kind == "sub":
        a = rng.randint(500, 999)
        b = rng.randint(100, a - 1)
        question, expression, answer = f"{name} has {a} {thing} and gives away {b}. How many are left?", f"{a} - {b}", a - b
    else:
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        question, expression, answer = f"{name} buys {a} boxes with {b} {thing} each. How many {thing}?", f"{a} * {b}", a * b
    return {"question": question, "expression": expression, "answer": answer}


def make_easy_problem(rng: random.Random) -> dict:
    """A one-step sum a small model can answer without a tool (single-turn examples)."""
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return {"question": f"What is {a} + {b}? Reply with the number.", "expression": f"{a} + {b}",
            "answer": a + b}


def to_row(problem: dict, index: int, split: str, system_prompt: str | None = SYSTEM_PROMPT) -> dict:
    """A dataset row: raw chat messages plus metadata, no tokens."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return {"prompt": [*system, {"role": "user", "content": problem["question"]}],
            "data_source": "arithmetic", "ground_truth": str(problem["answer"]),
            "extra_info": {"index": index, "split": split, "expression": problem["expression"]},
            "tools_kwargs": {}}


def transcript(problem: dict, use_tool: bool) -> list[dict]:
    """A correct demonstration, with the calculator or answering directly (the warm-up mix)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": problem["question"]}]
    if use_tool:
        call = {"type": "function", "function": {"name": "calculator",
                                                  "arguments": {"expression": problem["expression"]}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": str(problem["answer"])}]
    messages.append({"role": "assistant", "content": f"The answer is {problem['answer']}."})
    return messages


def write_jsonl(rows: list[dict], path: Path) -> Path:
    """Write rows as JSON lines (what `data.train_files` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_datasets(directory: Path, train_size: int, val_size: int, seed: int,
                  kind: str = "tool") -> tuple[Path, Path]:
    """Disjoint train and held-out validation problems as JSONL files. kind "tool": word problems
    that need the calculator; "easy": small sums answered directly (no system prompt)."""
    if kind not in ("tool", "easy"):
        raise ValueError(f"kind={kind!r}: use 'tool' or 'easy'")
    rng = random.Random(seed)
    make, system = (make_problem, SYSTEM_PROMPT) if kind == "tool" else (make_easy_problem, None)
    seen, splits = set(), {"train": [], "val": []}
    attempts = 0
    for split, size in (("train", train_size), ("val", val_size)):
        while len(splits[split]) < size:
            problem = make(rng)
            attempts += 1
            if attempts > 50 * (train_size + val_size):
                raise ValueError(f"cannot draw {train_size} + {val_size} distinct {kind!r} problems; "
                                 "ask for fewer (the easy kind has 400)")
            if problem["question"] in seen:
                continue
            seen.add(problem["question"])
            splits[split].append(to_row(problem, len(splits[split]), split, system))
    return (write_jsonl(splits["train"], directory / "train.jsonl"),
            write_jsonl(splits["val"], directory / "val.jsonl"))
