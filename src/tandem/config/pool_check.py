"""Load-time checks of the pools' life at run time: restarts (rollout.fault_tolerance) and the
elastic schedule (rollout.elastic). Both act on processes of their own (standalone rollout
replicas, served-reward servers); engines inside the training workers (the hybrid layout) are
neither restarted nor added."""

from __future__ import annotations

from tandem.config.footprint import rollout_devices
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


def _elastic_problem(config: TandemConfig) -> str | None:
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
