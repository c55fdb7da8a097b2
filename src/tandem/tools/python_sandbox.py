"""Run untrusted Python in a separate, locked-down process (the child side is sandbox_boot.py).

Every guarantee comes from the kernel, so tampering with Python state in the sandbox gains
nothing (docs/agent_loops.md has the table of guarantee, mechanism and test):
- seccomp (sandbox_seccomp.py) refuses process and thread creation, exec, every socket(),
  io_uring, ptrace, mounts, namespaces, device nodes, and signals to any pid but its own;
- a mount namespace covers /tmp, /run, /dev/shm with empty tmpfs (no host socket paths);
  network and PID namespaces: no interfaces, the code is PID 1 and sees no other process;
- Landlock: read only the interpreter's stdlib/site-packages and system libraries, read and
  write only the fresh temp dir (cwd), execute nothing, no TCP;
- no capabilities (root in the sandbox cannot raise its limits); RLIMIT_AS, RLIMIT_CPU,
  RLIMIT_FSIZE, RLIMIT_NOFILE, no core dumps; wall time: the parent SIGKILLs the group;
- an optional audit hook only turns the common refusals into clearer errors.
strict=True (default) refuses to run when any kernel layer is unavailable.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from tandem.tools.sandbox_boot import EXIT_SETUP_FAILED, REPORT_PREFIX

BOOT_SCRIPT = Path(__file__).with_name("sandbox_boot.py")
LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")


class SandboxUnavailableError(RuntimeError):
    """The kernel isolation the sandbox was asked to require is not available on this host."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. memory_bytes bounds the address space, so leave room for imports."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    open_files: int = 64
    output_bytes: int = 16 << 10  # per stream; the rest is read and dropped


@dataclass
class SandboxResult:
    """Outcome of one run. error is None on success, else one of ERROR_KINDS."""

    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None = None
    duration_s: float = 0.0
    isolation: dict[str, str] = field(default_factory=dict)


ERROR_KINDS = ("exception", "memory_limit", "cpu_limit", "wall_time", "killed")


def _read_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(directory for directory in LIBRARY_DIRS if os.path.isdir(directory))
    return sorted(roots)


class PythonSandbox:
    """Runs code strings in fresh sandboxed interpreters; at most max_concurrent at a time."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), strict: bool = True,
                 python_guards: bool = True, python: str = sys.executable,
                 max_concurrent: int = 2) -> None:
        self.limits = limits
        self.strict = strict
        self.python = python
        self.max_concurrent = max_concurrent
        self._settings = json.dumps({
            "read_roots": _read_roots(), "devices": list(DEVICES), "strict": strict,
            "python_guards": python_guards, "memory_bytes": limits.memory_bytes,
            "cpu_seconds": limits.cpu_seconds, "file_bytes": limits.file_bytes,
            "open_files": limits.open_files})
        # One semaphore per event loop: asyncio primitives must not cross loops.
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _command(self) -> list[str]:
        return [self.python, "-I", "-B", str(BOOT_SCRIPT), self._settings]

    @staticmethod
    def _environment(work_dir: str) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "HOME": work_dir, "TMPDIR": work_dir, "LANG": "C.UTF-8",
                "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}

    def probe(self) -> dict[str, str]:
        """Run an empty program synchronously; return the isolation report or raise."""
        work_dir = tempfile.mkdtemp(prefix="tandem-sandbox-")
        try:
            Path(work_dir, "main.py").write_text("pass\n")
            done = subprocess.run(self._command(), cwd=work_dir, env=self._environment(work_dir),
                                  capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
            isolation, stderr = _split_report(done.stderr.decode("utf-8", "replace"))
            self._check_setup(done.returncode, isolation, stderr)
            return isolation
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)

    def _check_setup(self, exit_code: int | None, isolation: dict[str, str] | None,
                     stderr: str) -> None:
        missing = [layer for layer, state in (isolation or {}).items()
                   if state.startswith("unavailable")]
        # only the bootstrap exits this way with a layer missing; the code's own exit 97 cannot
        if self.strict and exit_code == EXIT_SETUP_FAILED and missing:
            raise SandboxUnavailableError(
                f"the Python sandbox needs mount, network and PID namespaces, Landlock, "
                f"capability dropping and seccomp; missing: "
                + "; ".join(f"{layer} ({isolation[layer]})" for layer in missing)
                + ". Run on an x86_64 Linux kernel with Landlock, seccomp and (unless root) "
                "unprivileged user namespaces, or accept weaker isolation explicitly with "
                "PythonSandbox(strict=False).")
        if isolation is None and exit_code not in (None, 0) and exit_code > 0:
            raise RuntimeError(f"the sandbox bootstrap failed before running any code "
                               f"(exit {exit_code}): {stderr[-2000:]}")

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.max_concurrent)
        return self._semaphores[loop]

    async def run(self, code: str) -> SandboxResult:
        """Execute `code` as a script; errors in the code come back as a result, never raise."""
        async with self._semaphore():
            work_dir = tempfile.mkdtemp(prefix="tandem-sandbox-")
            try:
                Path(work_dir, "main.py").write_text(code, encoding="utf-8")
                return await self._run_in(work_dir)
            finally:
                shutil.rmtree(work_dir, ignore_errors=True)

    async def _run_in(self, work_dir: str) -> SandboxResult:
        start = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            *self._command(), cwd=work_dir, env=self._environment(work_dir),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        readers = [asyncio.create_task(_read_capped(stream, self.limits.output_bytes))
                   for stream in (process.stdout, process.stderr)]
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), self.limits.wall_seconds)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            _kill_group(process.pid)  # also reaps anything the code left behind in its group
            await process.wait()
        stdout, raw_stderr = await asyncio.gather(*readers)
        isolation, stderr = _split_report(raw_stderr)
        self._check_setup(None if timed_out else process.returncode, isolation, stderr)
        error = _classify(timed_out, process.returncode, stderr)
        if error == "wall_time":
            stderr += f"\nkilled after {self.limits.wall_seconds} s of wall time"
        elif error == "cpu_limit":
            stderr += f"\nkilled after {self.limits.cpu_seconds} s of CPU time"
        return SandboxResult(ok=error is None, stdout=stdout, stderr=stderr,
                             exit_code=None if timed_out else process.returncode, error=error,
                             duration_s=time.monotonic() - start, isolation=isolation or {})


async def _read_capped(stream: asyncio.StreamReader, limit: int) -> str:
    """Read a stream to EOF, keeping the first `limit` bytes."""
    kept = bytearray()
    dropped = 0
    while chunk := await stream.read(65536):
        room = limit - len(kept)
        kept += chunk[:room]
        dropped += max(0, len(chunk) - room)
    text = kept.decode("utf-8", "replace")
    return text + (f"\n... ({dropped} more bytes dropped)" if dropped else "")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _split_report(stderr: str) -> tuple[dict[str, str] | None, str]:
    """Separate the bootstrap's first-line isolation report from the code's own stderr."""
    first, _, rest = stderr.partition("\n")
    if first.startswith(REPORT_PREFIX):
        return json.loads(first[len(REPORT_PREFIX):]), rest
    return None, stderr


def _classify(timed_out: bool, exit_code: int | None, stderr: str) -> str | None:
    if timed_out:
        return "wall_time"
    if exit_code == 0:
        return None
    if exit_code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit" if exit_code == -signal.SIGXCPU else "killed"
    last_line = stderr.strip().rsplit("\n", 1)[-1]
    if last_line.startswith("MemoryError"):
        return "memory_limit"
    return "exception"
