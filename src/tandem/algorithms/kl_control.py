"""KL-in-reward coefficient controllers (algorithm.kl_ctrl): fixed, or adaptive towards a target."""

from __future__ import annotations

from tandem.config.schema import KLControlConfig

# The adaptive controller's proportional error is clipped to +-this per update.
PROPORTIONAL_ERROR_LIMIT = 0.2


class FixedKLController:
    """A constant coefficient; update() does nothing."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient (same signature as the adaptive controller)."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional control of the coefficient towards target_kl:
    e = clip(current_kl / target_kl - 1, -0.2, 0.2), value *= 1 + e * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl is {target_kl}; the adaptive KL controller needs a "
                             "positive algorithm.kl_ctrl.target_kl")
        if horizon <= 0:
            raise ValueError(f"horizon is {horizon}; algorithm.kl_ctrl.horizon must be >= 1")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient after a batch of n_steps trajectories whose mean KL was current_kl."""
        error = current_kl / self.target_kl - 1.0
        error = min(max(error, -PROPORTIONAL_ERROR_LIMIT), PROPORTIONAL_ERROR_LIMIT)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def kl_controller_from_config(config: KLControlConfig) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by config.type (fixed | adaptive), starting at config.kl_coef."""
    if config.type == "fixed":
        return FixedKLController(config.kl_coef)
    if config.type == "adaptive":
        return AdaptiveKLController(config.kl_coef, config.target_kl, config.horizon)
    raise ValueError(f"algorithm.kl_ctrl.type: unknown value {config.type!r}; valid values are "
                     "fixed, adaptive")
