"""What every sandbox escape test does first, and the sandboxes it attacks.

TAMPER is what issue 11 reproduced: the code walks up the stack to the bootstrap's globals,
empties its audit hook's blocked-event tables and re-imports `_posixsubprocess` to get the real
`fork_exec` back. Whatever still holds afterwards is the kernel's doing. Each attack runs
against the full sandbox ("seccomp") and, where the namespaces alone are meant to hold, against
bubblewrap without the seccomp filter too ("namespaces").
"""

from __future__ import annotations

import ctypes
import os
import signal

from tandem.tools.python_sandbox import (PythonSandbox, SandboxLimits, SandboxResult,
                                         SandboxUnavailableError)

LIMITS = SandboxLimits(wall_seconds=8.0, cpu_seconds=2, memory_bytes=512 << 20)
LAYERS = {"seccomp": {}, "namespaces": {"strict": False, "seccomp": False}}
PR_SET_CHILD_SUBREAPER = 36

TAMPER = """
import errno, json, os, sys
frame = sys._getframe()
while "BLOCKED_EVENTS" not in frame.f_globals:
    frame = frame.f_back
boot = frame.f_globals  # the bootstrap's module globals, reached by walking the stack
boot["BLOCKED_EVENTS"] = boot["BLOCKED_CTYPES_EVENTS"] = ()  # the audit hook now blocks nothing
del sys.modules["_posixsubprocess"]
import _posixsubprocess, subprocess  # a fresh module: the real fork_exec, not the stand-in
subprocess._fork_exec = _posixsubprocess.fork_exec
print("tampered")

def attempt(action):
    try:
        return f"allowed {action()!r}"
    except OSError as error:
        if "sandbox:" in str(error):
            raise  # refused by the audit hook: the tampering did not take
        return errno.errorcode.get(error.errno, str(error.errno))
"""


def missing_isolation() -> str | None:
    """Why the full sandbox cannot run here (bubblewrap or seccomp missing), or None."""
    try:
        PythonSandbox(LIMITS).probe()
    except SandboxUnavailableError as error:
        return str(error)
    return None


def sandbox_with(layers: str, limits: SandboxLimits = LIMITS) -> PythonSandbox:
    """The sandbox with the named layers ("seccomp": all of them, "namespaces": no filter)."""
    return PythonSandbox(limits, **LAYERS[layers])


async def attack(sandbox: PythonSandbox, code: str) -> tuple[SandboxResult, list[str]]:
    """Run TAMPER + code; return the result and the lines the code printed after tampering."""
    result = await sandbox.run(TAMPER + code)
    lines = result.stdout.splitlines()
    assert lines[:1] == ["tampered"], result.stderr  # the frame walk itself is not stopped
    assert "sandbox:" not in result.stderr  # nothing below was refused by the audit hook
    return result, lines[1:]


def children() -> list[int]:
    """Live processes whose parent is this test process."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append(int(entry))
    return found


class OrphansComeHere:
    """Make this process a child subreaper, so anything a sandbox leaves alive is reparented
    here (and is found by children()) instead of vanishing under the machine's init."""

    def __enter__(self) -> "OrphansComeHere":
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        self.before = set(children())
        return self

    def left_behind(self) -> list[int]:
        return sorted(set(children()) - self.before)

    def __exit__(self, *exc_info) -> None:
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for pid in self.left_behind():  # a failed test must not leave its escapees running
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
