"""Load-time checks of trainer.deterministic (docs/trainer.md, "Determinism"): it derives the
native engine's batch-invariant mode (prefix cache off), and refuses every component whose
result could depend on timing or on which requests share a step."""

from __future__ import annotations

from tandem.config.choices import ConfigError
from tandem.config.footprint import replica_count, replica_world_size, rollout_devices
from tandem.config.schema import TandemConfig

FIX = "or set trainer.deterministic=false"


def derive_determinism(config: TandemConfig, given: set[str]) -> None:
    """trainer.deterministic: turn on rollout.batch_invariant and turn off the prefix cache,
    unless the YAML or an override set them the other way (then refuse, naming the field)."""
    if not config.trainer.deterministic:
        return
    rollout = config.rollout
    if "rollout.batch_invariant" in given and not rollout.batch_invariant:
        raise ConfigError("rollout.batch_invariant: is false, but trainer.deterministic=true needs "
                          "it (a sequence's log-probs would depend on which requests share its "
                          f"engine step); leave it unset {FIX}")
    if "rollout.enable_prefix_caching" in given and rollout.enable_prefix_caching:
        raise ConfigError("rollout.enable_prefix_caching: is true, but trainer.deterministic=true "
                          "turns it off: whether a prompt's blocks are cached depends on which "
                          "request ran first, and a hit computes the rest of the prompt in other "
                          f"shapes (other float rounding); leave it unset {FIX}")
    rollout.batch_invariant = True
    rollout.enable_prefix_caching = False


def determinism_problem(config: TandemConfig) -> str | None:
    """The first setting that breaks rollout.batch_invariant or trainer.deterministic, or None."""
    rollout = config.rollout
    if rollout.batch_invariant and rollout.name != "native":
        return (f"rollout.batch_invariant: is true, but the {rollout.name} backend batches "
                "requests with kernels whose rounding depends on the batch, and tandem does not "
                "switch it into a batch-invariant mode; use rollout.name=native "
                + ("(trainer.deterministic=true needs it) " if config.trainer.deterministic else "")
                + "or set rollout.batch_invariant=false")
    if rollout.batch_invariant and rollout.enable_prefix_caching:
        return ("rollout.enable_prefix_caching: is true with rollout.batch_invariant=true: a "
                "prefix-cache hit depends on which request ran first and computes the rest of the "
                "prompt in other shapes; set rollout.enable_prefix_caching=false")
    if rollout.batch_invariant and rollout.tensor_model_parallel_size > 1:
        return (f"rollout.tensor_model_parallel_size: is {rollout.tensor_model_parallel_size}, "
                "but batch-invariant steps are built and tested for one-rank engines only (the "
                "ranks' all-reduce is not covered); set it to 1")
    if config.trainer.deterministic:
        return _deterministic_problem(config)
    return None


def _deterministic_problem(config: TandemConfig) -> str | None:
    mode = config.trainer.trainer_mode
    if mode != "sync":
        return (f"trainer.deterministic: is true, but trainer.trainer_mode={mode} lets timing "
                "decide which groups finish first (their order in the batch, hence the float "
                "sums) and where a request aborted for a weight sync resumes with the new "
                f"weights; set trainer.trainer_mode=sync, {FIX}")
    if rollout_devices(config):
        return ("rollout.nnodes: standalone rollout replicas (rollout.nnodes x "
                "rollout.n_gpus_per_node > 0) are not covered: determinism is built and tested "
                f"for the hybrid layout; set rollout.nnodes=0 and rollout.n_gpus_per_node=0, {FIX}")
    replicas = replica_count(config.trainer.n_devices, replica_world_size(config.rollout))
    if replicas > 1:
        return (f"trainer.n_devices: is {config.trainer.n_devices}, so {replicas} rollout "
                "replicas share the requests by their in-flight counts (timing), and the "
                "training workers all-reduce gradients; neither is verified to give the same "
                f"bits run to run. Set trainer.n_devices=1, {FIX}")
    served = [name for name in ("model", "judge") if getattr(config.reward, name).enable]
    if served:
        return (f"reward.{served[0]}.enable: is true, but a served reward batches the requests "
                "that arrive together, so a score depends on its neighbours' timing; use reward "
                f"functions, {FIX}")
    return None
