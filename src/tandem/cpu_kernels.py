"""tandem's fused CPU kernels (csrc/cpu_kernels.cpp), compiled on first use (docs/engine.md,
"Fused CPU kernels").

They replace the chains of small torch ops of the native engine's CPU fp32 step (decode
attention reading the paged K/V in place, RMSNorm with the residual add fused, rotary fused with
the KV-cache write, silu(gate) * up) and the two passes of a weight-slot write with one
(`copy_and_sum`, `sum_words`: weight_sync/slots.py). `load()` builds them once per machine with
torch's extension builder into a folder named after a hash of the source, flags, torch and the
CPU's instruction sets, and registers them as `torch.ops.tandem_cpu.*`; once a build succeeded
(`READY`) later processes load the library without the builder. A lock older than
`STALE_LOCK_S` (a build that died) is removed and a build past `BUILD_TIMEOUT_S` is given up on,
so a start never hangs on it. Without a compiler tandem logs why, once, and runs the same
computation with torch ops (the path CUDA and bf16 always take); `TANDEM_CPU_KERNELS=0` chooses
that path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
ENV_SWITCH = "TANDEM_CPU_KERNELS"
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # head sizes decode_attention is compiled for
MAX_GROUP = 64  # query heads per kv head it handles
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]

STALE_LOCK_S = 120.0  # a build takes 5-25 s
READY = "READY"  # written into the build folder once the library built and loaded
LIBRARY = "tandem_cpu_kernels.so"
BUILD_TIMEOUT_S = 300.0

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": the op namespace or None, "reason": why None


def load() -> object | None:
    """`torch.ops.tandem_cpu` once the kernels are built and loaded; None (after logging the
    reason once) when they are switched off or cannot be built."""
    with _lock:
        if "ops" not in _state:
            _state["ops"], _state["reason"] = _build()
            if _state["ops"] is None:
                logger.warning("fused CPU kernels not used (%s); the native engine's step and "
                               "the weight-slot copy run with torch ops, slower", _state["reason"])
        return _state["ops"]


def load_built() -> object | None:
    """`load()` when it cannot compile: this process's ops, or a finished build of this machine
    loaded (~0.1 s); else None. For callers within a deadline (a weight sync)."""
    with _lock:
        if "ops" in _state:  # the hot path: a sync asks once per tensor
            return _state["ops"]
    if os.environ.get(ENV_SWITCH, "1") != "0":
        build_dir = build_directory()
        if not ((build_dir / READY).exists() and (build_dir / LIBRARY).exists()):
            return None
    return load()


def unavailable_reason() -> str | None:
    """Why `load()` returned None, or None if it did not (or was not called)."""
    return _state.get("reason")


def _build() -> tuple[object | None, str | None]:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"{ENV_SWITCH}=0"
    return _build_in(build_directory())


def _build_in(build_dir: Path) -> tuple[object | None, str | None]:
    """Load the finished build in build_dir, or compile into it, clearing a stale lock first
    and giving up after the timeout."""
    if (build_dir / READY).exists() and (build_dir / LIBRARY).exists():
        torch.ops.load_library(str(build_dir / LIBRARY))
        return torch.ops.tandem_cpu, None
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        logger.warning("removing %s, left by a kernel build that did not finish", lock)
        lock.unlink(missing_ok=True)
    result: list[tuple[object | None, str | None]] = []
    # in a daemon thread, so that a build waiting forever on another process's lock cannot
    # hang the engine (no torch parallel work runs in it: see async_engine's OpenMP note)
    builder = threading.Thread(target=lambda: result.append(_compile(build_dir)), daemon=True,
                               name="tandem-kernel-build")
    builder.start()
    builder.join(BUILD_TIMEOUT_S)
    if not result:
        return None, f"building {SOURCE.name} took over {BUILD_TIMEOUT_S:.0f} s (lock: {lock})"
    return result[0]


def build_directory() -> Path:
    """Where the kernels are built: one folder per (source, flags, torch version and
    location, CPU)."""
    key = hashlib.sha1(SOURCE.read_bytes() + " ".join(FLAGS).encode() + torch.__version__.encode()
                       + torch.__file__.encode() + _cpu_signature().encode()).hexdigest()[:12]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"tandem_cpu_kernels-{key}"


def _cpu_signature() -> str:
    """The machine and its instruction-set flags: a build for one CPU must not load on another
    that shares the cache folder (`-march=native`)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {flags.strip()}"


def _compile(build_dir: Path) -> tuple[object | None, str | None]:
    from torch.utils import cpp_extension

    source = build_dir / SOURCE.name  # the same path for every checkout: ninja's command agrees
    if not source.exists() or source.read_bytes() != SOURCE.read_bytes():
        partial = build_dir / f".{SOURCE.name}.{os.getpid()}"
        partial.write_bytes(SOURCE.read_bytes())
        os.replace(partial, source)  # atomic: a concurrent build never compiles half a file
    try:
        cpp_extension.load(name="tandem_cpu_kernels", sources=[str(source)],
                           extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                           build_directory=str(build_dir), is_python_module=False,
                           verbose=False)
    except Exception as error:  # no compiler, no ninja, a compile error: say which
        lines = str(error).strip().splitlines() or [type(error).__name__]
        cause = next((line for line in lines if "error:" in line), lines[0])
        return None, f"building {SOURCE.name} failed: {cause.strip()[:300]}"
    (build_dir / READY).touch()
    return torch.ops.tandem_cpu, None
