"""Simulated-clock study of the trainer modes at GPU scale (no model): sync, colocate_async and
separate_async for 8-256 rollout devices.

Clock model (defaults: a 7B model on H100-class devices, docs/trainer.md "Modes at scale"):
generation: every device runs `slots` sequences at once, each at `decode_s` per token, so a
sequence of L tokens takes L x decode_s; lengths are long-tailed (log-normal, capped).
Training: (prompt + response tokens) x `train_s_per_token` / training devices. Weight sync:
bytes / bandwidth + a fixed latency (in-device for the hybrid modes, over the network for
separate_async). Hardware is equal: the hybrid modes (sync, colocate_async) train and generate
on all R + T devices; separate_async generates on R and trains on T = R.

Staleness follows the trainer's rules: a group's lag = trainer version - the oldest version of
any of its tokens (partial rollouts keep their tokens across syncs); groups over max_staleness
are dropped (their tokens are wasted). Prints a table and writes a PNG; last line
`RATIO <separate_async step / max(generate, train)> at the largest size`.

Spillover (the `separate_async+spill` rows): when a step's first mini-batch would wait (fewer
finished groups than it needs), the T training devices' slots join after an in-device sync
(`sync_s(hybrid=True)`, the trainer waiting) and leave once that mini-batch is taken; at leave
the sequences that no longer fit keep their tokens and wait for a free standalone slot (the
resumable client). Leaving costs nothing in the model.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections import defaultdict, deque
from dataclasses import dataclass

from tandem.trainer.admission import AdmissionSchedule


@dataclass
class Workload:
    """One RL step's work and the hardware's speeds."""

    groups_per_device: int = 8  # prompt groups per step per rollout device
    n: int = 8  # sessions per prompt
    prompt_tokens: int = 512
    median_tokens: float = 512.0  # response length: log-normal(median, sigma), capped
    sigma: float = 1.0
    max_tokens: int = 8192
    slots: int = 64  # sequences a device decodes at once
    decode_s: float = 0.025  # seconds per token per sequence at that concurrency
    train_s_per_token: float = 3.5e-4  # fwd (old log-prob) + fwd/bwd, per device
    weight_bytes: float = 14e9  # 7B in bf16
    hybrid_sync_gbps: float = 200.0  # in-device resharding
    network_sync_gbps: float = 25.0  # trainer -> rollout devices (broadcast, pipelined)
    sync_latency_s: float = 1.0
    parameter_sync_step: int = 4
    max_staleness: int = 8  # the trainer's default (trainer.async_rollout.max_staleness)
    on_stale: str = "wait"  # wait (bounded at admission, the trainer's default) | drop
    buffer_batches: float = 3.0  # buffer capacity (generating + waiting) in batches (the default)

    def length(self, rng: random.Random) -> int:
        """One response length."""
        return min(self.max_tokens, max(1, int(rng.lognormvariate(math.log(self.median_tokens),
                                                                  self.sigma))))

    def train_s(self, tokens: int, devices: int) -> float:
        """Seconds to train on `tokens` (prompt + response) with `devices`."""
        return tokens * self.train_s_per_token / devices

    def sync_s(self, hybrid: bool) -> float:
        """Seconds of one weight sync."""
        gbps = self.hybrid_sync_gbps if hybrid else self.network_sync_gbps
        return self.weight_bytes / (gbps * 1e9) + self.sync_latency_s


@dataclass
class Result:
    """Per-step averages of one mode at one size."""

    mode: str
    rollout_devices: int
    step_s: float
    samples_per_s: float
    trainer_idle: float  # fraction of wall time the trainer waited for data
    rollout_idle: float  # fraction of slot-time not generating
    lag_mean: float
    dropped: float  # fraction of finished groups dropped as stale
    length_bias: float = 1.0  # mean response length trained on / generated
    spill_joins: float = 0.0  # fraction of steps whose first mini-batch spilled


class Group:
    """A prompt group in flight: its sequences' lengths and its head version (the oldest)."""

    def __init__(self, lengths: list[int], version: int) -> None:
        self.lengths = lengths
        self.remaining = len(lengths)
        self.min_version = version
        self.order = 0  # finish order: the buffer is FIFO among groups of one head version

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


class Rollout:
    """Continuous batching on `slots` sequence slots, on a generation clock G that advances
    only while generation runs (pauses shift every running sequence)."""

    def __init__(self, work: Workload, slots: int, capacity: int, rng: random.Random,
                 schedule: AdmissionSchedule | None = None) -> None:
        self.work, self.slots, self.capacity, self.rng = work, slots, capacity, rng
        self.schedule = schedule  # on_stale=wait: admission bounded by the trainer's schedule
        self.finished: list[Group] = []  # every group whose generation ended
        self.G = 0.0
        self.running: list[tuple[float, int, Group]] = []  # (finish G, tiebreak, group)
        self.waiting: list[tuple[float, int, Group]] = []  # (seconds left, tiebreak, group)
        self.ready: dict[int, deque[Group]] = defaultdict(deque)  # head version -> finished, FIFO
        self.ready_count = 0
        self.in_flight = 0
        self.busy_slot_s = 0.0
        self.version = 0  # the weights new tokens are generated with
        self._ids = 0

    def fill(self, version: int | None = None) -> None:
        """Start whole groups while n slots are free and the buffer has room."""
        if version is not None:
            self.version = version
        version = self.version
        n = self.work.n
        while self.waiting and len(self.running) < self.slots:  # resumed sequences go first
            left, tiebreak, group = self.waiting.pop()
            heapq.heappush(self.running, (self.G + left, tiebreak, group))
        while self.slots - len(self.running) >= n and self.in_flight + self.ready_count < self.capacity:
            if self.schedule is not None:
                if not self.schedule.can_admit(version):
                    break
                self.schedule.admit(version)
            group = Group([self.work.length(self.rng) for _ in range(n)], version)
            self.in_flight += 1
            for length in group.lengths:
                self._ids += 1
                heapq.heappush(self.running, (self.G + length * self.work.decode_s, self._ids, group))

    def resize(self, slots: int) -> None:
        """Change the slot count (spillover joins or leaves); the sequences that no longer fit,
        the longest left first, keep their tokens and wait for a free slot."""
        self.slots = slots
        if len(self.running) > slots:
            self.running.sort()
            moved, self.running = self.running[slots:], self.running[:slots]
            heapq.heapify(self.running)
            self.waiting += [(finish - self.G, tiebreak, group) for finish, tiebreak, group in moved]
            self.waiting.sort(reverse=True)  # pop() resumes the one with the least left first
        self.fill()

    def next_finish(self) -> float:
        """Generation-clock time of the next sequence end (inf when idle)."""
        return self.running[0][0] if self.running else math.inf

    def run(self, seconds: float) -> None:
        """Generate for `seconds` of wall time; finished groups go to `ready`."""
        end = self.G + seconds
        while self.running and self.running[0][0] <= end:
            finish, _, group = heapq.heappop(self.running)
            self.busy_slot_s += (finish - self.G) * (len(self.running) + 1)
            self.G = finish
            group.remaining -= 1
            if group.remaining == 0:
                self.in_flight -= 1
                self._ids += 1
                group.order = self._ids
                self.ready[group.min_version].append(group)
                self.ready_count += 1
                self.finished.append(group)
            self.fill()  # continuous batching: a free slot takes new work at once
        self.busy_slot_s += (end - self.G) * len(self.running)
        self.G = end


def simulate_sync(work: Workload, rollout_devices: int, steps: int, seed: int) -> Result:
    """Generate the whole batch, then train, then sync, on R + T devices."""
    devices = 2 * rollout_devices
    rng = random.Random(seed)
    batch = work.groups_per_device * rollout_devices
    total = busy = idle_trainer = 0.0
    for _ in range(steps):
        rollout = Rollout(work, devices * work.slots, batch, rng)
        rollout.fill(0)
        while rollout.running:
            rollout.run(rollout.next_finish() - rollout.G)
        generate = rollout.G
        tokens = sum(g.tokens + work.n * work.prompt_tokens for g in rollout.finished)
        train, sync = work.train_s(tokens, devices), work.sync_s(hybrid=True)
        total += generate + train + sync
        busy += rollout.busy_slot_s
        idle_trainer += generate
    slot_time = (total) * devices * work.slots
    return Result("sync", rollout_devices, total / steps, batch * work.n * steps / total,
                  idle_trainer / total, 1 - busy / slot_time, 0.0, 0.0)


def simulate_async(work: Workload, rollout_devices: int, steps: int, seed: int,
                   separate: bool, spillover: bool = False) -> Result:
    """colocate_async (one pool of R + T devices: generation pauses for training and sync) or
    separate_async (R generate, T = R train; generation pauses only for the sync), with
    spillover the T devices generating too while a step's first mini-batch waits."""
    rng = random.Random(seed)
    batch = work.groups_per_device * rollout_devices
    mini = batch // work.parameter_sync_step if separate else batch
    per_step = work.parameter_sync_step if separate else 1
    generating = rollout_devices if separate else 2 * rollout_devices
    train_devices = rollout_devices if separate else 2 * rollout_devices
    schedule = (AdmissionSchedule(batch, work.max_staleness) if work.on_stale == "wait" else None)
    rollout = Rollout(work, generating * work.slots, int(work.buffer_batches * batch), rng, schedule)
    version, now = 0, 0.0
    waited = paused = 0.0
    lags: list[int] = []
    trained: list[Group] = []
    dropped = joins = 0
    spill_slot_s = 0.0  # slot-seconds the training devices lent to generation
    standalone_slots = rollout.slots
    warmup_steps = 2  # fill the pipeline before measuring
    start = 0.0
    for step in range(steps + warmup_steps):
        if step == warmup_steps:
            start, waited, paused, lags, trained, dropped = now, 0.0, 0.0, [], [], 0
            rollout.busy_slot_s, rollout.finished, joins, spill_slot_s = 0.0, [], 0, 0.0
        if schedule is not None:
            schedule.advance(version)
        for index in range(per_step):
            batch_groups: list[Group] = []
            joined_at = None
            if spillover and index == 0 and rollout.ready_count < mini:
                join = work.sync_s(hybrid=True)  # the actor's weights into the spill engines
                rollout.run(join)
                now += join
                waited += join
                rollout.resize(standalone_slots + train_devices * work.slots)
                joined_at, joins = now, joins + 1
            while len(batch_groups) < mini:
                rollout.fill(version)
                group = next_group(rollout, schedule)
                if group is not None:
                    if schedule is not None:
                        schedule.take(group.min_version)
                    if version - group.min_version > work.max_staleness:
                        assert schedule is None, "a group admitted under the bound went stale"
                        dropped += 1
                    else:
                        batch_groups.append(group)
                    continue
                wait = rollout.next_finish() - rollout.G
                rollout.run(wait)
                now += wait
                waited += wait
            if joined_at is not None:  # leave before the update
                spill_slot_s += (now - joined_at) * train_devices * work.slots
                rollout.resize(standalone_slots)
            trained += batch_groups
            lags += [version - g.min_version for g in batch_groups]
            tokens = sum(g.tokens + work.n * work.prompt_tokens for g in batch_groups)
            train = work.train_s(tokens, train_devices)
            if separate:
                rollout.fill(version)
                rollout.run(train)  # generation goes on while the trainer trains
            else:
                paused += train
            now += train
        sync = work.sync_s(hybrid=not separate)
        now += sync
        paused += sync
        version += 1
    wall = now - start
    slot_time = wall * generating * work.slots + spill_slot_s
    generated = sum(g.tokens for g in rollout.finished) / len(rollout.finished)
    mode = ("separate_async+spill" if spillover else "separate_async") if separate else "colocate_async"
    return Result(mode, rollout_devices,
                  wall / steps, batch * work.n * steps / wall, waited / wall,
                  1 - rollout.busy_slot_s / slot_time, sum(lags) / max(len(lags), 1),
                  dropped / max(dropped + len(trained), 1),
                  sum(g.tokens for g in trained) / len(trained) / generated, joins / steps)


def next_group(rollout: Rollout, schedule: AdmissionSchedule | None) -> Group | None:
    """Pop the finished group the trainer takes next: FIFO (on_stale=drop), or, bounded at
    admission, the oldest head first among those the schedule lets it take (None: wait)."""
    heads = sorted(head for head, queue in rollout.ready.items() if queue)
    if schedule is None:
        head = min(heads, key=lambda h: rollout.ready[h][0].order, default=None)
    else:
        head = next((h for h in heads if schedule.can_take(h)), None)
    if head is None:
        return None
    rollout.ready_count -= 1
    return rollout.ready[head].popleft()


def ideal_step_s(work: Workload, rollout_devices: int, seed: int) -> tuple[float, float]:
    """(generate, train) seconds of one step at steady state on R rollout and T = R training
    devices: the lower bound of an overlapped pipeline is their max."""
    rng = random.Random(seed)
    samples = work.groups_per_device * rollout_devices * work.n
    mean = sum(work.length(rng) for _ in range(20_000)) / 20_000
    generate = samples * mean * work.decode_s / (rollout_devices * work.slots)
    train = work.train_s(int(samples * (mean + work.prompt_tokens)), rollout_devices)
    return generate, train


def plot(results: list[Result], path: str) -> None:
    """Samples/s and mean lag per mode against rollout devices."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, lag) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in ("sync", "colocate_async", "separate_async", "separate_async+spill"):
        rows = [r for r in results if r.mode == mode]
        xs = [r.rollout_devices for r in rows]
        speed.plot(xs, [r.samples_per_s for r in rows], marker="o", label=mode)
        lag.plot(xs, [r.lag_mean for r in rows], marker="o", label=mode)
    for axis, title in ((speed, "samples / s"), (lag, "mean staleness (versions)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("rollout devices R (hybrid modes: 2R devices)")
        axis.set_title(title)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,16,32,64,128,256")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-staleness", type=int, default=Workload.max_staleness)
    parser.add_argument("--on-stale", choices=("wait", "drop"), default=Workload.on_stale)
    parser.add_argument("--parameter-sync-step", type=int, default=Workload.parameter_sync_step)
    parser.add_argument("--buffer-batches", type=float, default=Workload.buffer_batches)
    parser.add_argument("--train-s-per-token", type=float, default=Workload.train_s_per_token)
    parser.add_argument("--plot", default="bench/modes_sim.png")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    work = Workload(max_staleness=args.max_staleness, on_stale=args.on_stale,
                    parameter_sync_step=args.parameter_sync_step,
                    buffer_batches=args.buffer_batches, train_s_per_token=args.train_s_per_token)
    print(f"{'mode':<20} {'R':>4} {'step s':>8} {'samples/s':>10} {'trainer idle':>12} "
          f"{'rollout idle':>12} {'lag':>5} {'dropped':>8} {'len bias':>8} {'/ideal':>7} "
          f"{'spilled':>7}")
    results: list[Result] = []
    ratio = length_bias = 0.0
    for size in map(int, args.sizes.split(",")):
        generate, train = ideal_step_s(work, size, args.seed)
        ideal = max(generate, train)
        separate = simulate_async(work, size, args.steps, args.seed, separate=True)
        for result in (simulate_sync(work, size, args.steps, args.seed),
                       simulate_async(work, size, args.steps, args.seed, separate=False),
                       simulate_async(work, size, args.steps, args.seed, separate=True,
                                      spillover=True), separate):
            results.append(result)
            print(f"{result.mode:<20} {size:>4} {result.step_s:>8.1f} {result.samples_per_s:>10.1f} "
                  f"{result.trainer_idle:>12.2f} {result.rollout_idle:>12.2f} "
                  f"{result.lag_mean:>5.2f} {result.dropped:>8.1%} {result.length_bias:>8.3f} "
                  f"{result.step_s / ideal:>7.2f} {result.spill_joins:>7.0%}")
        print(f"{'ideal':<20} {size:>4} generate {generate:.1f} s, train {train:.1f} s per step")
        ratio, length_bias = separate.step_s / ideal, separate.length_bias
    plot(results, args.plot)
    print(f"LENGTH_BIAS {length_bias:.3f} mean response length trained on / generated, "
          f"separate_async, R={results[-1].rollout_devices}, on_stale={work.on_stale}")
    print(f"RATIO {ratio:.2f} separate_async step / max(generate, train), R={results[-1].rollout_devices}"
          f", max_staleness={work.max_staleness}, parameter_sync_step={work.parameter_sync_step}"
          f", buffer {work.buffer_batches:g} batches")


if __name__ == "__main__":
    main()
