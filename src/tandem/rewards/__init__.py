"""Rule-based rewards, registered by data source."""

from tandem.rewards.registry import (RewardResult, compute_reward, register_reward,
                                    reward_input_problem, reward_names)

__all__ = ["RewardResult", "compute_reward", "register_reward", "reward_input_problem",
           "reward_names"]
