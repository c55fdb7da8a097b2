"""trainer.deterministic on the training side: every RNG seeded, torch's deterministic kernels
(docs/trainer.md, "Determinism")."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and every CUDA device) global generators."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))  # NumPy's legacy seed is 32-bit
    torch.manual_seed(seed)


def use_deterministic_kernels() -> None:
    """torch.use_deterministic_algorithms(True): an op without a deterministic kernel raises
    instead of running a racy one. cuBLAS needs its workspace pinned before its first call."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
