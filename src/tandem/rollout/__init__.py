"""Rollout backends: the decoding copy of the policy (engines and their adapters)."""
