"""The README's main job: GRPO teaches a tiny model to use a calculator tool, on CPU."""
