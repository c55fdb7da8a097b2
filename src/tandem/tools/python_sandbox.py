"""Run untrusted Python in a separate process that only the kernel's isolation holds
(docs/agent_loops.md, "Tools", has the table of guarantee, mechanism and test): bubblewrap's
namespaces, a read-only view of the interpreter's runtime and a size-capped private tmpfs
(sandbox_bwrap.py); inside them rlimits and a seccomp filter (sandbox_boot.py, sandbox_seccomp.py),
which Python state in the sandbox cannot undo. strict=True (default) refuses to run without the
seccomp filter; nothing runs without bubblewrap."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field

from tandem.tools.sandbox_boot import EXIT_SETUP_FAILED, REPORT_PREFIX
from tandem.tools.sandbox_bwrap import (END_SECONDS, INSTALL_HINT, SANDBOX_UID_BASE,
                                        SANDBOX_UID_COUNT, WORK_DIR, BubblewrapCommand,
                                        code_file, end_run, find_bubblewrap,
                                        open_namespace_init, runtime_view)


class SandboxUnavailableError(RuntimeError):
    """The isolation the sandbox was asked to require is not available on this host."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. memory_bytes bounds the address space, so leave room for imports.
    queue_seconds bounds the wait for a free slot, counted apart from wall_seconds."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    work_bytes: int = 64 << 20  # the private tmpfs: every file the code writes, together
    open_files: int = 64
    output_bytes: int = 16 << 10  # per stream; the rest is read and dropped
    queue_seconds: float = 10.0


@dataclass
class SandboxResult:
    """Outcome of one run. error is None on success, else one of ERROR_KINDS; duration_s is the
    run itself, queue_s the wait for its slot."""

    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None = None
    duration_s: float = 0.0
    queue_s: float = 0.0
    isolation: dict[str, str] = field(default_factory=dict)


ERROR_KINDS = ("exception", "memory_limit", "cpu_limit", "wall_time", "killed", "busy")


class PythonSandbox:
    """Runs code strings in fresh sandboxed interpreters, each run in its own slot; at most
    max_concurrent slots at a time (default: one per CPU, at least two)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), strict: bool = True,
                 python_guards: bool = True, seccomp: bool = True, python: str = sys.executable,
                 max_concurrent: int | None = None, bubblewrap: str | None = None) -> None:
        if strict and not seccomp:
            raise ValueError("PythonSandbox(seccomp=False) drops the seccomp filter, which "
                             "strict mode requires: pass strict=False as well to accept that")
        bwrap = find_bubblewrap(bubblewrap)
        if bwrap is None:
            raise SandboxUnavailableError(
                f"the Python sandbox runs inside bubblewrap, and {bubblewrap or 'bwrap'!r} is "
                f"not {'there' if bubblewrap else 'on PATH'}: {INSTALL_HINT}. Without it "
                "nothing runs, in strict mode or not.")
        self.limits = limits
        self.strict = strict
        self.seccomp = seccomp
        self.max_concurrent = max_concurrent or max(2, os.cpu_count() or 2)
        executable, view = runtime_view(python)
        self.command = BubblewrapCommand(bwrap, executable, tuple(view), limits.work_bytes,
                                         host_root=os.geteuid() == 0)
        self.view = self.command.view  # the host paths the code can read (and nothing else)
        self._settings = json.dumps({
            "strict": strict, "python_guards": python_guards, "seccomp": seccomp,
            "memory_bytes": limits.memory_bytes, "cpu_seconds": limits.cpu_seconds,
            "file_bytes": limits.file_bytes, "open_files": limits.open_files})
        # One semaphore per event loop: asyncio primitives must not cross loops.
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._runs = itertools.count()  # each run its own sandbox uid (per-user kernel limits)

    @staticmethod
    def _environment() -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "HOME": WORK_DIR, "TMPDIR": WORK_DIR, "LANG": "C.UTF-8",
                "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}

    def probe(self) -> dict[str, str]:
        """Run an empty program synchronously; return the isolation report or raise."""
        code_fd = code_file("pass\n")
        try:
            done = subprocess.run(self.command.argv(code_fd, self._settings),
                                  env=self._environment(), capture_output=True, timeout=60,
                                  stdin=subprocess.DEVNULL, pass_fds=(code_fd,))
        finally:
            os.close(code_fd)
        isolation, stderr = _split_report(done.stderr.decode("utf-8", "replace"))
        _check_setup(self.strict, done.returncode, isolation, stderr)
        return {**self.command.report(), **isolation}

    def _next_uid(self) -> int:
        return SANDBOX_UID_BASE + next(self._runs) % SANDBOX_UID_COUNT

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.max_concurrent)
        return self._semaphores[loop]

    async def run(self, code: str) -> SandboxResult:
        """Execute `code` as a script; errors in the code come back as a result, never raise.
        No slot free within limits.queue_seconds: a "busy" result, before anything ran."""
        semaphore = self._semaphore()
        queued = time.monotonic()
        try:
            await asyncio.wait_for(semaphore.acquire(), self.limits.queue_seconds)
        except asyncio.TimeoutError:
            return SandboxResult(
                ok=False, stdout="", exit_code=None, error="busy",
                queue_s=time.monotonic() - queued,
                stderr=f"no sandbox slot was free within {self.limits.queue_seconds:g} s "
                       f"({self.max_concurrent} runs at a time); the code did not run")
        try:
            queue_s = time.monotonic() - queued
            result = await self._run_in_slot(code)
            result.queue_s = queue_s
            return result
        finally:
            semaphore.release()

    async def _run_in_slot(self, code: str) -> SandboxResult:
        start = time.monotonic()
        code_fd = code_file(code)
        info_read, info_write = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                *self.command.argv(code_fd, self._settings, info_write, self._next_uid()),
                env=self._environment(), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True, pass_fds=(code_fd, info_write))
        except BaseException:
            os.close(info_read)
            raise
        finally:
            os.close(code_fd)
            os.close(info_write)
        readers = [asyncio.create_task(_read_capped(stream, self.limits.output_bytes))
                   for stream in (process.stdout, process.stderr)]
        namespace_init = asyncio.create_task(open_namespace_init(info_read, process.pid))
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), self.limits.wall_seconds)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            await end_run(namespace_init, process)  # every process of the run dies with its init
        try:
            stdout, raw_stderr = await asyncio.wait_for(asyncio.gather(*readers), END_SECONDS)
        except asyncio.TimeoutError as error:
            for reader in readers:
                reader.cancel()
            raise RuntimeError("the sandbox's output pipes stayed open after its namespace "
                               "was killed") from error
        isolation, stderr = _split_report(raw_stderr)
        exit_code = None if timed_out else _exit_code(process.returncode)
        _check_setup(self.strict, exit_code, isolation, stderr)
        error = _classify(timed_out, exit_code, stderr)
        if error == "wall_time":
            stderr += f"\nkilled after {self.limits.wall_seconds:g} s of wall time"
        elif error == "cpu_limit":
            stderr += f"\nkilled after {self.limits.cpu_seconds} s of CPU time"
        elif error == "killed":  # SIGXCPU ignored: the hard limit a second later is SIGKILL
            stderr += (f"\nkilled by SIGKILL: {self.limits.cpu_seconds + 1} s of CPU time "
                       "(the hard limit) or the kernel")
        return SandboxResult(ok=error is None, stdout=stdout, stderr=stderr, exit_code=exit_code,
                             error=error, duration_s=time.monotonic() - start,
                             isolation={**self.command.report(), **(isolation or {})})


def _check_setup(strict: bool, exit_code: int | None, isolation: dict[str, str] | None,
                 stderr: str) -> None:
    """Raise when the sandbox was not built: bubblewrap's own error, a bootstrap that died
    before its report, or (strict) a layer the bootstrap reported missing."""
    if isolation is None and exit_code not in (None, 0):
        # bubblewrap's own errors ("bwrap: ...") come before the bootstrap ever runs
        words = stderr.strip()[-2000:]
        if stderr.startswith("bwrap:"):
            raise SandboxUnavailableError(f"bubblewrap could not build the sandbox: {words}")
        raise RuntimeError(f"the sandbox bootstrap failed before running any code "
                           f"(exit {exit_code}): {words}")
    missing = [layer for layer, state in (isolation or {}).items()
               if state.startswith("unavailable")]
    # only the bootstrap exits this way with a layer missing; the code's own exit 97 cannot
    if strict and exit_code == EXIT_SETUP_FAILED and missing:
        raise SandboxUnavailableError(
            "the Python sandbox needs its seccomp filter; missing: "
            + "; ".join(f"{layer} ({isolation[layer]})" for layer in missing)
            + ". Run on an x86_64 Linux kernel with seccomp, or accept weaker isolation "
            "explicitly with PythonSandbox(strict=False).")


def _exit_code(returncode: int | None) -> int | None:
    """bubblewrap passes on a signal death as 128 + n (as shells do): report it as -n."""
    if returncode is not None and returncode > 128:
        return 128 - returncode
    return returncode


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
    if exit_code == -signal.SIGXCPU:
        return "cpu_limit"
    if exit_code == -signal.SIGKILL:
        return "killed"
    last_line = stderr.strip().rsplit("\n", 1)[-1]
    if last_line.startswith("MemoryError"):
        return "memory_limit"
    return "exception"
