"""Keep library chatter out of run logs (per process: the CLI and every Ray worker call it)."""

from __future__ import annotations

import logging
import os


def quiet_libraries() -> None:
    """Silence transformers' per-load progress bars and torch's fx-tracing deprecation notice."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # transformers is a dependency; this only guards odd installs
        pass
