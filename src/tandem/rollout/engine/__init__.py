"""tandem's own inference engine: sequence, block manager (paged KV + prefix cache), scheduler,
model runner, sampler and the async engine loop. See docs/engine.md."""

from tandem.rollout.engine.async_engine import AsyncEngine

__all__ = ["AsyncEngine"]
