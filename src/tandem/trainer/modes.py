"""trainer.trainer_mode -> the function that runs that mode's loop."""

from __future__ import annotations

from tandem.trainer.rl_trainer import RLTrainer, ValidationHook


async def fit(trainer: RLTrainer, on_validation: ValidationHook | None = None) -> dict[str, float]:
    """Run the configured mode's loop for trainer.total_steps; returns the last validation metrics.
    NoStepTrained when the loop ran its steps but none updated the model."""
    mode = trainer.config.trainer.trainer_mode
    if mode == "sync":
        from tandem.trainer.sync import fit_sync as loop
    elif mode == "colocate_async":
        from tandem.trainer.colocate_async import fit_colocate_async as loop
    elif mode == "separate_async":
        from tandem.trainer.separate_async import fit_separate_async as loop
    else:
        raise ValueError(f"trainer.trainer_mode={mode!r}: choose sync, colocate_async or "
                         "separate_async")
    validation = await loop(trainer, on_validation)
    trainer.check_trained()
    return validation
