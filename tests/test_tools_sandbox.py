"""The Python sandbox: ordinary code runs (numpy included) in a fresh private work dir, hostile
code comes back as an error result within its limit, the host carries on, and the sandbox
refuses to run, naming the fix, when bubblewrap is missing or fails.
tests/reliability/test_sandbox_*.py have one escape attempt per claimed guarantee."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import stat
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tandem.tools.python_sandbox import PythonSandbox, SandboxLimits, SandboxUnavailableError
from tandem.tools.python_tool import PythonTool
from tandem.tools.sandbox_bwrap import WORK_DIR, runtime_view

LIMITS = SandboxLimits(wall_seconds=8.0, cpu_seconds=2, memory_bytes=512 << 20)


def _missing_isolation() -> str | None:
    try:
        PythonSandbox(LIMITS).probe()
    except SandboxUnavailableError as error:
        return str(error)
    return None


MISSING_ISOLATION = _missing_isolation()
needs_sandbox = pytest.mark.skipif(MISSING_ISOLATION is not None,
                                   reason=f"sandbox unavailable: {MISSING_ISOLATION}")


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(LIMITS)


@needs_sandbox
async def test_ordinary_code_runs_in_a_fresh_private_directory(sandbox, monkeypatch):
    """Each run has its own empty tmpfs: two concurrent runs do not see each other's files,
    a later run does not see an earlier one's, the host's environment is not passed on, and no
    host folder (such as the temp dir) gets a work dir."""
    monkeypatch.setenv("TANDEM_TEST_SECRET", "hunter2")
    name = f"tandem-{uuid.uuid4().hex}"
    code = (f"import os, json; open({name!r} + str(os.urandom(4).hex()), 'w').write('x'); "
            "print(json.dumps([os.getcwd(), len(os.listdir('.')), "
            "'TANDEM_TEST_SECRET' in os.environ]))")
    first, second = await asyncio.gather(sandbox.run(code), sandbox.run(code))
    third = await sandbox.run(code)
    for result in (first, second, third):
        assert result.ok, result.stderr
        assert json.loads(result.stdout) == [WORK_DIR, 2, False]  # main.py and its own file
    temp = Path(tempfile.gettempdir())
    assert not [*temp.glob(f"{name}*"), *temp.glob(f"*/{name}*")]


@needs_sandbox
async def test_the_standard_library_and_numpy_import(sandbox):
    code = "import math, json, re, fractions, decimal, statistics, sqlite3\nprint(math.comb(5, 2))"
    if importlib.util.find_spec("numpy"):
        code += "\nimport numpy\nprint(int(numpy.arange(5).sum()))"
    result = await sandbox.run(code)
    assert result.ok, result.stderr
    assert result.stdout.split()[0] == "10" and result.stdout.split()[1:] in ([], ["10"])


@needs_sandbox
async def test_reading_etc_passwd_is_an_error(sandbox):
    result = await sandbox.run("print(open('/etc/passwd').read())")
    assert not result.ok and result.error == "exception"
    assert "FileNotFoundError" in result.stderr and "root:" not in result.stdout


@needs_sandbox
async def test_opening_a_socket_is_an_error(sandbox):
    result = await sandbox.run("import socket\ns = socket.create_connection(('127.0.0.1', 22), 2)")
    assert not result.ok and result.error == "exception"
    assert "PermissionError" in result.stderr


@needs_sandbox
async def test_infinite_loop_hits_the_cpu_limit():
    # the wall limit is far past the CPU limit, so a loaded machine still hits the CPU limit first
    sandbox = PythonSandbox(SandboxLimits(wall_seconds=300.0, cpu_seconds=1))
    result = await sandbox.run("while True:\n    pass")
    assert result.error == "cpu_limit" and "CPU time" in result.stderr


@needs_sandbox
async def test_sleeping_forever_hits_the_wall_time_limit():
    sandbox = PythonSandbox(SandboxLimits(wall_seconds=1.0))
    result = await sandbox.run("import time\ntime.sleep(1000)")
    assert not result.ok and result.error == "wall_time" and "wall time" in result.stderr
    assert 1.0 <= result.duration_s and result.queue_s < 1.0


@needs_sandbox
async def test_ten_gigabytes_hit_the_memory_limit(sandbox):
    result = await sandbox.run("x = bytearray(10 * 2**30)")
    assert not result.ok and result.error == "memory_limit" and "MemoryError" in result.stderr


@needs_sandbox
async def test_host_carries_on_after_hostile_code(sandbox):
    hostile = ["import os\nos.system('ls')", "import subprocess\nsubprocess.run(['ls'])",
               "import _posixsubprocess\n_posixsubprocess.fork_exec(*[None] * 23)",
               "import os\nos.fork()", "import ctypes\nctypes.CDLL('libc.so.6')",
               "raise SystemExit(97)", "print('y' * 10**6)", "def f(:\n    pass",
               "print('\ud800')"]
    results = await asyncio.gather(*(sandbox.run(code) for code in hostile))
    for result in results[:5]:
        assert not result.ok and "PermissionError: sandbox:" in result.stderr
    assert not results[5].ok and results[5].exit_code == 97  # the setup-failure code
    assert results[6].ok and len(results[6].stdout) < LIMITS.output_bytes + 100
    assert "bytes dropped" in results[6].stdout
    assert results[7].error == "exception" and results[7].stderr.startswith(
        '  File "main.py", line 1') and "SyntaxError" in results[7].stderr
    # a lone surrogate from the model: the code's own error, not a failed session
    assert results[8].error == "exception" and "SyntaxError" in results[8].stderr
    assert (await sandbox.run("print(6 * 7)")).stdout == "42\n"


@needs_sandbox
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
print(attempt(lambda: open(os.__file__, 'a').write('x')))
print(attempt(lambda: socket.create_connection(('127.0.0.1', 22), 2)))
print(attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))))
print(attempt(lambda: os.execv('/bin/ls', ['ls'])))
"""
    result = await bare.run(code)
    assert result.ok, result.stderr
    # not in the view (ENOENT), a read-only bind (EROFS; EACCES first for the sandbox's own uid,
    # which owns nothing there, when the file exists); seccomp refuses socket() and execve. /tmp
    # is in the view only as the read-only parent of a runtime that lives under it (a checkout in
    # /tmp): then creating a file there is EROFS (the mount is checked before the folder's
    # permissions) instead of ENOENT
    _, view = runtime_view(sys.executable)
    own_uid = bare.command.host_root
    read_only = "EACCES" if own_uid else "EROFS"
    tmp_write = "EROFS" if any(path.startswith("/tmp/") for path in view) else "ENOENT"
    assert result.stdout.split() == ["ENOENT", tmp_write, read_only, "EPERM", "EPERM", "EPERM"]
    assert not os.path.exists("/tmp/tandem-escape.txt")
    namespaces = "pid+ipc+net+uts+mount" if own_uid else "user+pid+ipc+net+uts+mount"
    assert result.isolation["namespaces"].startswith(namespaces)
    assert result.isolation["user"].startswith("uid 21" if own_uid else "the host user")


@needs_sandbox
def test_strict_mode_reports_every_layer():
    isolation = PythonSandbox(LIMITS).probe()
    assert isolation["seccomp"].startswith("bpf ") and isolation["capabilities"] == "all dropped"
    assert isolation["work_dir"] == f"private tmpfs {WORK_DIR}, 64 MiB"


def test_seccomp_off_needs_strict_off():
    with pytest.raises(ValueError, match=r"seccomp=False.*pass strict=False as well"):
        PythonSandbox(LIMITS, seccomp=False)


def test_without_bubblewrap_nothing_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    for strict in (True, False):
        with pytest.raises(SandboxUnavailableError,
                           match=r"'bwrap' is not on PATH: install it with `apt-get install -y "
                                 r"bubblewrap` \(`make test` does"):
            PythonSandbox(LIMITS, strict=strict)
    with pytest.raises(SandboxUnavailableError, match=r"'/nowhere/bwrap' is not there"):
        PythonSandbox(LIMITS, bubblewrap="/nowhere/bwrap")


def test_a_bubblewrap_that_cannot_build_the_sandbox_is_reported(tmp_path):
    """A kernel without user namespaces, for instance: bwrap's own words, before any code."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\n"
                    "exit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    sandbox = PythonSandbox(LIMITS, bubblewrap=str(fake))
    with pytest.raises(SandboxUnavailableError,
                       match="bubblewrap could not build the sandbox: bwrap: No permissions"):
        sandbox.probe()
    with pytest.raises(SandboxUnavailableError, match="No permissions"):
        asyncio.run(sandbox.run("print(1)"))


@needs_sandbox
async def test_python_tool_shows_stdout_and_errors(sandbox):
    tool = PythonTool(sandbox)
    assert (await tool.execute({"code": "print(2 ** 10)"}, {})).text == "1024\n"
    failed = await tool.execute({"code": "print('partial')\n1 / 0"}, {})
    assert not failed.ok
    assert failed.text.startswith("partial\nError (exception):")
    assert failed.text.endswith("ZeroDivisionError: division by zero")
