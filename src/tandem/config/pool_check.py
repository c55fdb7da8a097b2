"""Load-time checks of the pools' life at run time: restarts (rollout.fault_tolerance) and the
elastic schedule (rollout.elastic). Both act on processes of their own (standalone rollout
replicas, served-reward servers); engines inside the training workers (the hybrid layout) are
neither restarted nor added."""

from __future__ import annotations

from tandem.config.footprint import replica_count, replica_world_size, rollout_devices
from tandem.config.schema import TandemConfig

HYBRID_IS_FATAL = ("the rollout engines run inside the training workers (the hybrid layout: "
                   "rollout.nnodes x rollout.n_gpus_per_node = 0), and a training worker is never "
                   "restarted: its death ends the run (resume it from a checkpoint)")


def pool_problem(config: TandemConfig) -> str | None:
    """The first fault-tolerance or elastic setting that would not run as written, or None."""
    return _fault_tolerance_problem(config) or _elastic_problem(config)


def _fault_tolerance_problem(config: TandemConfig) -> str | None:
    served = config.reward.model.enable or config.reward.judge.enable
    if config.rollout.fault_tolerance.enable and not rollout_devices(config) and not served:
        return (f"rollout.fault_tolerance.enable: is true, but {HYBRID_IS_FATAL}; nothing here "
                "could be restarted. Set it to false, or give the rollout devices of its own "
                "(rollout.nnodes=1, rollout.n_gpus_per_node >= 1): standalone replicas restart")
    return None


def _auto_problem(config: TandemConfig) -> str | None:
    auto = config.rollout.elastic.auto
    if not auto.enable:
        return None
    where = "rollout.elastic.auto.enable: is true, but"
    if config.trainer.trainer_mode != "separate_async":
        return (f"{where} trainer.trainer_mode={config.trainer.trainer_mode!r}: the pressure it "
                "follows (the trainer waiting on rollout, the rollout held back by a full "
                "buffer) exists only in separate_async; disable it or use rollout.elastic."
                "schedule")
    if not rollout_devices(config):
        return f"{where} {HYBRID_IS_FATAL}; disable it or give the rollout devices of its own"
    if config.rollout.elastic.schedule:
        return (f"{where} rollout.elastic.schedule is set too, and both would size the pool; "
                "keep one")
    capacity = replica_count(rollout_devices(config), replica_world_size(config.rollout))
    high = auto.max_replicas or capacity
    if not 1 <= auto.min_replicas <= high <= capacity:
        return (f"rollout.elastic.auto: min_replicas={auto.min_replicas}, max_replicas="
                f"{auto.max_replicas} (0: {capacity}, what the rollout devices hold); need "
                f"1 <= min_replicas <= max_replicas <= {capacity}")
    return None


def _elastic_problem(config: TandemConfig) -> str | None:
    problem = _auto_problem(config)
    if problem:
        return problem
    schedule = config.rollout.elastic.schedule
    if not schedule:
        return None
    if not rollout_devices(config):
        return (f"rollout.elastic.schedule: resizes the standalone rollout pool, but {HYBRID_IS_FATAL}"
                " and their number is trainer.n_devices; leave the schedule empty, or give the "
                "rollout devices of its own (rollout.nnodes=1, rollout.n_gpus_per_node >= 1)")
    previous = -1
    for index, entry in enumerate(schedule):
        if len(entry) != 2:
            return (f"rollout.elastic.schedule[{index}]: is {list(entry)}; each entry is "
                    "[step, replicas], e.g. [[10, 3], [20, 1]]")
        step, replicas = entry
        if step < 0:
            return (f"rollout.elastic.schedule[{index}]: step {step}; steps count from 0 (the "
                    "first weight sync)")
        if step <= previous:
            return (f"rollout.elastic.schedule[{index}]: step {step} does not come after the "
                    f"previous entry's {previous}; list the steps in increasing order, each once")
        if replicas < 1:
            return (f"rollout.elastic.schedule[{index}]: {replicas} replicas at step {step}; the "
                    "pool keeps at least 1 (generation would stop)")
        previous = step
    if previous > config.trainer.total_steps:
        return (f"rollout.elastic.schedule: its last entry is at step {previous}, after the run's "
                f"last (trainer.total_steps={config.trainer.total_steps}), so it would never apply; "
                "remove it or raise total_steps")
    return None
