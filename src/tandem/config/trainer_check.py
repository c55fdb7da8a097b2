"""Load-time checks of the trainer modes' fields: what separate_async needs (rollout devices of
its own, whole mini-batches per sync; its transport is footprint.py's standalone rule), its
options refused in the other modes, and the async modes' buffer against the staleness bound."""

from __future__ import annotations

from tandem.config.footprint import rollout_devices
from tandem.config.schema import TandemConfig, changed_fields


def trainer_problem(config: TandemConfig) -> str | None:
    """The first trainer-mode setting that would not run as written, or None."""
    if config.trainer.trainer_mode == "separate_async":
        problem = _separate_async_problem(config)
    else:
        problem = _other_mode_problem(config)
    return problem or _buffer_problem(config) or _debug_problem(config)


def _debug_problem(config: TandemConfig) -> str | None:
    """trainer.debug: record and replay run in the sync loop, each switch with its folder."""
    debug = config.trainer.debug
    if not changed_fields(debug):
        return None
    if config.trainer.trainer_mode != "sync":
        return (f"trainer.debug: rollout record and replay run in trainer.trainer_mode=sync only "
                f"(the async modes generate while training); set the mode to sync")
    if debug.rollout_only and debug.train_only:
        return ("trainer.debug.rollout_only: and train_only are both true, so a step would do "
                "nothing; keep one")
    if debug.rollout_only and not debug.save_rollouts:
        return ("trainer.debug.rollout_only: generates trajectories only to save them; set "
                "trainer.debug.save_rollouts to a folder")
    if debug.train_only != bool(debug.load_rollouts):
        return ("trainer.debug.train_only: trains on the trajectories of trainer.debug."
                "load_rollouts instead of generating; set both (the folder and train_only=true) "
                "or neither")
    return None


def _separate_async_problem(config: TandemConfig) -> str | None:
    rollout, data = config.rollout, config.data
    if rollout.nnodes < 1 or rollout.n_gpus_per_node < 1:
        return ("rollout.nnodes: separate_async runs rollout on its own devices: set "
                "rollout.nnodes and rollout.n_gpus_per_node to at least 1")
    sync_step = config.trainer.separate_async.parameter_sync_step
    mini = config.actor.ppo_mini_batch_size
    if data.train_batch_size != sync_step * mini:
        return (f"data.train_batch_size: is {data.train_batch_size}, but separate_async needs "
                f"train_batch_size == trainer.separate_async.parameter_sync_step ({sync_step}) x "
                f"actor.ppo_mini_batch_size ({mini}) = {sync_step * mini}")
    return None


def _other_mode_problem(config: TandemConfig) -> str | None:
    mode = config.trainer.trainer_mode
    separate = config.trainer.separate_async
    for field in changed_fields(separate):
        return (f"trainer.separate_async.{field}: is {getattr(separate, field)}, but "
                f"trainer.trainer_mode={mode} never reads it (only separate_async does); remove "
                "it or set trainer.trainer_mode=separate_async")
    threads = config.rollout.torch_threads
    if threads and not rollout_devices(config):
        return (f"rollout.torch_threads: is {threads}, but in trainer_mode={mode} the rollout "
                "engine runs inside the training workers, whose threads are actor.torch_threads; "
                "set rollout.torch_threads=0")
    return None


def _buffer_problem(config: TandemConfig) -> str | None:
    buffer, batch = config.trainer.async_rollout, config.data.train_batch_size
    if buffer.buffer_groups and buffer.buffer_groups < batch:
        return (f"trainer.async_rollout.buffer_groups: is {buffer.buffer_groups}, fewer than "
                f"data.train_batch_size={batch}: a step could never fill its batch. Raise it (or "
                "0 for 3 x train_batch_size)")
    usable = (buffer.max_staleness + 1) * batch
    if buffer.buffer_groups > usable:
        return (f"trainer.async_rollout.buffer_groups: is {buffer.buffer_groups}, but a step takes "
                f"data.train_batch_size={batch} groups, so groups past (max_staleness + 1) x "
                f"train_batch_size = {usable} would wait beyond "
                f"trainer.async_rollout.max_staleness={buffer.max_staleness} versions and be "
                f"generated only to go stale. Lower it to at most {usable} (or 0 for 3 x "
                "train_batch_size), or raise max_staleness")
    return None
