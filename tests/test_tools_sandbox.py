"""The Python sandbox: hostile code comes back as an error result within its limit, the host
carries on, and the kernel layers (Landlock, seccomp) hold even without the Python audit hook.
tests/reliability/test_sandbox_escape.py has one escape attempt per claimed guarantee."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from tandem.tools.python_sandbox import PythonSandbox, SandboxLimits, SandboxUnavailableError
from tandem.tools.python_tool import PythonTool

LIMITS = SandboxLimits(wall_seconds=8.0, cpu_seconds=2, memory_bytes=512 << 20)


def _kernel_isolation() -> str | None:
    try:
        PythonSandbox(LIMITS).probe()
    except SandboxUnavailableError as error:
        return str(error)
    return None


MISSING_ISOLATION = _kernel_isolation()
needs_kernel = pytest.mark.skipif(MISSING_ISOLATION is not None,
                                  reason=f"kernel isolation unavailable: {MISSING_ISOLATION}")


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(LIMITS, strict=MISSING_ISOLATION is None)


async def test_ordinary_code_runs_in_a_fresh_scrubbed_directory(sandbox, monkeypatch):
    monkeypatch.setenv("TANDEM_TEST_SECRET", "hunter2")
    code = ("import os, json; open('f.txt', 'w').write('x'); "
            "print(json.dumps([os.getcwd(), sorted(os.listdir('.')), "
            "'TANDEM_TEST_SECRET' in os.environ]))")
    first, second = await asyncio.gather(sandbox.run(code), sandbox.run(code))
    assert first.ok and second.ok, first.stderr
    cwd, files, leaked = json.loads(first.stdout)
    assert files == ["f.txt", "main.py"] and leaked is False
    assert cwd != json.loads(second.stdout)[0] and not os.path.exists(cwd)  # fresh and removed


async def test_reading_etc_passwd_is_an_error(sandbox):
    result = await sandbox.run("print(open('/etc/passwd').read())")
    assert not result.ok and result.error == "exception"
    assert "PermissionError" in result.stderr and "root:" not in result.stdout


async def test_opening_a_socket_is_an_error(sandbox):
    result = await sandbox.run("import socket\ns = socket.create_connection(('127.0.0.1', 22), 2)")
    assert not result.ok and result.error == "exception"
    assert "PermissionError" in result.stderr


async def test_infinite_loop_hits_the_cpu_limit():
    # the wall limit is far past the CPU limit, so a loaded machine still hits the CPU limit first
    sandbox = PythonSandbox(SandboxLimits(wall_seconds=300.0, cpu_seconds=1),
                            strict=MISSING_ISOLATION is None)
    result = await sandbox.run("while True:\n    pass")
    # without namespaces the CPU kill cannot be told from other kills
    assert result.error == "cpu_limit" or (MISSING_ISOLATION and result.error == "killed")
    assert "CPU time" in result.stderr or MISSING_ISOLATION


async def test_sleeping_forever_hits_the_wall_time_limit():
    sandbox = PythonSandbox(SandboxLimits(wall_seconds=1.0), strict=MISSING_ISOLATION is None)
    start = time.monotonic()
    result = await sandbox.run("import time\ntime.sleep(1000)")
    assert not result.ok and result.error == "wall_time" and "wall time" in result.stderr
    assert time.monotonic() - start < 4


async def test_ten_gigabytes_hit_the_memory_limit(sandbox):
    result = await sandbox.run("x = bytearray(10 * 2**30)")
    assert not result.ok and result.error == "memory_limit" and "MemoryError" in result.stderr


async def test_host_carries_on_after_hostile_code(sandbox):
    hostile = ["import os\nos.system('ls')", "import subprocess\nsubprocess.run(['ls'])",
               "import _posixsubprocess\n_posixsubprocess.fork_exec(*[None] * 23)",
               "import os\nos.fork()", "import ctypes\nctypes.CDLL('libc.so.6')",
               "raise SystemExit(97)", "print('y' * 10**6)"]
    results = await asyncio.gather(*(sandbox.run(code) for code in hostile))
    for result in results[:5]:
        assert not result.ok and "PermissionError: sandbox:" in result.stderr
    assert not results[5].ok and results[5].exit_code == 97  # the setup-failure code
    assert results[6].ok and len(results[6].stdout) < LIMITS.output_bytes + 100
    assert "bytes dropped" in results[6].stdout
    assert (await sandbox.run("print(6 * 7)")).stdout == "42\n"


@needs_kernel
async def test_kernel_layers_hold_without_the_python_guards():
    bare = PythonSandbox(LIMITS, python_guards=False)
    code = """
import errno, os, socket
def attempt(action):
    try:
        action()
        return "allowed"
    except OSError as error:
        return errno.errorcode.get(error.errno, str(error.errno))
print(attempt(lambda: open('/etc/passwd').read()))
print(attempt(lambda: open('/tmp/tandem-escape.txt', 'w').write('x')))
print(attempt(lambda: socket.create_connection(('127.0.0.1', 22), 2)))
print(attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))))
print(attempt(lambda: os.execv('/bin/ls', ['ls'])))
"""
    result = await bare.run(code)
    assert result.ok, result.stderr
    # Landlock refuses the files (EACCES); seccomp refuses every socket() and execve (EPERM)
    assert result.stdout.split() == ["EACCES", "EACCES", "EPERM", "EPERM", "EPERM"]
    assert not os.path.exists("/tmp/tandem-escape.txt")
    assert "netns" in result.isolation["namespaces"]


@needs_kernel
@pytest.mark.parametrize("code, error", [
    # no child to outlive it: seccomp refuses fork (PermissionError) even without the hook
    ("import os, time\nprint(os.getpid(), flush=True)\nif os.fork() == 0:\n    time.sleep(60)",
     "exception"),
    # the code leaves the process group the wall-time kill targets: PDEATHSIG still reaches it
    ("import os, time\nprint(os.getpid(), flush=True)\nos.setsid()\ntime.sleep(60)", "wall_time"),
])
async def test_no_process_outlives_its_run(code, error):
    bare = PythonSandbox(SandboxLimits(wall_seconds=1.0), python_guards=False)
    result = await bare.run(code)
    assert result.error == error and result.stdout == "1\n"  # PID 1 of its own namespace
    await asyncio.sleep(0.3)
    assert _live_sandbox_processes() == []


def _live_sandbox_processes() -> list[int]:
    """Processes still running the sandbox bootstrap (zombies have no command line)."""
    live = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if b"sandbox_boot.py" in command:
            live.append(int(entry))
    return live


def test_strict_mode_reports_missing_isolation():
    if MISSING_ISOLATION is None:
        assert PythonSandbox(LIMITS).probe()["landlock"].startswith("abi")
    else:
        assert "PythonSandbox(strict=False)" in MISSING_ISOLATION


async def test_python_tool_shows_stdout_and_errors(sandbox):
    tool = PythonTool(sandbox)
    assert (await tool.execute({"code": "print(2 ** 10)"}, {})).text == "1024\n"
    failed = await tool.execute({"code": "print('partial')\n1 / 0"}, {})
    assert not failed.ok
    assert failed.text.startswith("partial\nError (exception):")
    assert failed.text.endswith("ZeroDivisionError: division by zero")
