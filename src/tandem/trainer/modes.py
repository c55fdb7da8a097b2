"""trainer.trainer_mode -> the function that runs that mode's loop."""

from __future__ import annotations

from tandem.trainer.rl_trainer import RLTrainer, ValidationHook


async def fit(trainer: RLTrainer, on_validation: ValidationHook | None = None) -> dict[str, float]:
    """Run the configured mode's loop for trainer.total_steps; returns the last validation metrics."""
    mode = trainer.config.trainer.trainer_mode
    if mode == "sync":
        from tandem.trainer.sync import fit_sync

        return await fit_sync(trainer, on_validation)
    if mode == "colocate_async":
        from tandem.trainer.colocate_async import fit_colocate_async

        return await fit_colocate_async(trainer, on_validation)
    if mode == "separate_async":
        from tandem.trainer.separate_async import fit_separate_async

        return await fit_separate_async(trainer, on_validation)
    raise ValueError(f"trainer.trainer_mode={mode!r}: choose sync, colocate_async or separate_async")
