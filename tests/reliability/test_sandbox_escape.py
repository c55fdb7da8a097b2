"""Escape attempts against the Python sandbox, one per guarantee docs/agent_loops.md claims.

Each attack first does what issue 11 reproduced: it walks up the stack to the bootstrap's
globals and empties its audit hook's blocked-event sets and path check, and re-imports
`_posixsubprocess` to get the real `fork_exec` back (TAMPER). What still
holds afterwards is the kernel's doing; the errno names the layer (seccomp answers EPERM,
Landlock EACCES). Run as root, as CI does: root is where the old process limit did not apply.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from tandem.tools.python_sandbox import PythonSandbox, SandboxLimits, SandboxUnavailableError
from tandem.tools.sandbox_seccomp import (AUDIT_ARCH_X86_64, DENIED_SYSCALLS, RET_ALLOW,
                                          RET_ERRNO, RET_KILL_PROCESS, X32_SYSCALL_BIT,
                                          build_program)

LIMITS = SandboxLimits(wall_seconds=8.0, cpu_seconds=2, memory_bytes=512 << 20)
# A wall limit far past the CPU limit, so a loaded machine still hits the CPU limit first.
CPU_LIMITS = SandboxLimits(wall_seconds=300.0, cpu_seconds=1)
HOST_DIR = Path(__file__).resolve().parent  # outside every folder the sandbox may touch or hides
# refused by Landlock, or absent: under a folder the mount namespace covers (a checkout in /tmp)
HIDDEN_OR_REFUSED = {"EACCES", "ENOENT"}

TAMPER = """
import errno, os, sys
frame = sys._getframe()
while "BLOCKED_EVENTS" not in frame.f_globals:
    frame = frame.f_back
boot = frame.f_globals  # the bootstrap's module globals, reached by walking the stack
boot["BLOCKED_EVENTS"] = boot["BLOCKED_CTYPES_EVENTS"] = ()  # the audit hook now blocks nothing
boot["isinstance"] = lambda *args: False  # and skips its open() path check
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


def _missing_isolation() -> str | None:
    try:
        PythonSandbox(LIMITS).probe()
    except SandboxUnavailableError as error:
        return str(error)
    return None


MISSING_ISOLATION = _missing_isolation()
pytestmark = pytest.mark.skipif(MISSING_ISOLATION is not None,
                                reason=f"kernel isolation unavailable: {MISSING_ISOLATION}")


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return PythonSandbox(LIMITS)


async def _attack(sandbox: PythonSandbox, code: str, limits: SandboxLimits | None = None):
    """Run TAMPER + code; return the result and the lines the code printed after tampering."""
    runner = sandbox if limits is None else PythonSandbox(limits)
    result = await runner.run(TAMPER + code)
    lines = result.stdout.splitlines()
    assert lines[:1] == ["tampered"], result.stderr  # the frame walk itself is not stopped
    assert "sandbox:" not in result.stderr  # nothing below was refused by the audit hook
    return result, lines[1:]


def _nothing_connected(listener: socket.socket) -> bool:
    listener.setblocking(False)
    try:
        listener.accept()[0].close()
    except BlockingIOError:
        return True
    return False


async def test_frame_walk_then_unix_socket_at_a_host_path(sandbox, tmp_path):
    """Ray's raylet and plasma sockets live at paths under /tmp: the mount namespace hides
    the folder and seccomp refuses socket() for every family."""
    path = str(tmp_path / "raylet.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(8)
        result, lines = await _attack(sandbox, f"""
import socket
print(os.path.exists({path!r}))
print(attempt(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect({path!r})))
""")
        assert result.ok, result.stderr
        assert lines == ["False", "EPERM"]
        assert _nothing_connected(listener)


async def test_every_socket_family_is_refused(sandbox):
    result, lines = await _attack(sandbox, """
import socket
for family in ("AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET", "AF_VSOCK"):
    print(family, attempt(lambda: socket.socket(getattr(socket, family), socket.SOCK_DGRAM)))
print(attempt(lambda: len(socket.socketpair())))  # an anonymous pair reaches nothing: allowed
""")
    assert result.ok, result.stderr
    assert lines == [f"{family} EPERM" for family in
                     ("AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET", "AF_VSOCK")] \
        + ["allowed 2"]


async def test_network_connect_to_a_loopback_listener(sandbox):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        result, lines = await _attack(sandbox, f"""
import socket
print(attempt(lambda: socket.create_connection(("127.0.0.1", {port}), 2)))
""")
        assert result.ok, result.stderr
        assert lines == ["EPERM"]
        assert _nothing_connected(listener)


async def test_reimported_posixsubprocess_starts_no_child(sandbox):
    """The fresh module's fork_exec is the real one; the kernel refuses the fork under it,
    so preexec_fn (which would run in the child) never runs."""
    result, lines = await _attack(sandbox, """
print(_posixsubprocess.fork_exec is subprocess._fork_exec, type(subprocess._fork_exec).__name__)
print(attempt(lambda: subprocess.Popen(["/bin/true"], preexec_fn=lambda: open("child_ran", "w"))))
print(os.path.exists("child_ran"))
""")
    assert result.ok, result.stderr
    assert lines == ["True builtin_function_or_method", "EPERM", "False"]


async def test_fork_bomb_creates_no_process(sandbox):
    result, lines = await _attack(sandbox, """
import threading
children, last = 0, "none"
for _ in range(100):
    try:
        if os.fork() == 0:
            os._exit(0)
        children += 1
    except OSError as error:
        last = errno.errorcode[error.errno]
print(children, last)
try:
    threading.Thread(target=print).start()
except RuntimeError as error:
    print(error)
""")
    assert result.ok, result.stderr
    assert lines == ["0 EPERM", "can't start new thread"]


async def test_os_system_subprocess_and_exec_run_nothing(sandbox):
    result, lines = await _attack(sandbox, """
import subprocess
print(os.system("touch ran"))  # glibc reports a failed spawn as exit status 127
print(attempt(lambda: subprocess.run(["/bin/sh", "-c", "touch ran"])))
print(attempt(lambda: os.posix_spawn("/bin/sh", ["sh", "-c", "touch ran"], {})))
print(attempt(lambda: os.execv("/bin/sh", ["sh", "-c", "touch ran"])))
print(os.path.exists("ran"))
""")
    assert result.ok, result.stderr
    assert lines == [str(127 << 8), "EPERM", "EPERM", "EPERM", "False"]


async def test_host_files_outside_the_allowed_dirs_are_unreadable(sandbox):
    secret = HOST_DIR / f".escape-secret-{uuid.uuid4().hex}"
    secret.write_text("hunter2")
    try:
        result, lines = await _attack(sandbox, f"""
print(attempt(lambda: open("/etc/passwd").read()))
print(attempt(lambda: open({str(secret)!r}).read()))
os.symlink({str(secret)!r}, "link")
print(attempt(lambda: open("link").read()))
print(attempt(lambda: os.listdir("/")))
""")
    finally:
        secret.unlink()
    assert result.ok, result.stderr
    # Landlock refuses (EACCES); a checkout under a covered folder (/tmp) is not even there
    assert lines[0] == lines[3] == "EACCES" and set(lines[1:3]) <= HIDDEN_OR_REFUSED
    assert "hunter2" not in result.stdout


async def test_writing_outside_the_work_dir_is_refused(sandbox):
    target = HOST_DIR / f".escape-write-{uuid.uuid4().hex}"
    result, lines = await _attack(sandbox, f"""
print(attempt(lambda: open({str(target)!r}, "w").write("x")))
print(attempt(lambda: os.mkdir({str(target)!r})))
print(attempt(lambda: os.rename("main.py", {str(target)!r})))
""")
    assert result.ok, result.stderr
    assert {lines[0], lines[1]} <= HIDDEN_OR_REFUSED
    assert lines[2] in ("EACCES", "EXDEV", "ENOENT")  # Landlock refuses moves out of the work dir
    assert not target.exists()


async def test_device_nodes_cannot_be_made(sandbox):
    """As root with CAP_MKNOD a block device node in the work dir would read the raw disk."""
    result, lines = await _attack(sandbox, """
import stat
print(attempt(lambda: os.mknod("disk", stat.S_IFBLK | 0o600, os.makedev(7, 0))))
print(attempt(lambda: os.mknod("null", stat.S_IFCHR | 0o600, os.makedev(1, 3))))
print(os.path.exists("disk") or os.path.exists("null"))
""")
    assert result.ok, result.stderr
    assert lines == ["EPERM", "EPERM", "False"]


async def test_memory_blow_up_stops_at_the_limit(sandbox):
    result, lines = await _attack(sandbox, """
import mmap, resource
try:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("raised")
    raise SystemExit(3)  # do not go on to allocate gigabytes on the host
except ValueError as error:
    print(error)
print(attempt(lambda: len(mmap.mmap(-1, 2 << 30))))
x = bytearray(10 * 2**30)
""")
    assert result.error == "memory_limit" and "MemoryError" in result.stderr, result.stderr
    assert lines == ["not allowed to raise maximum limit", "ENOMEM"]


async def test_infinite_loop_stops_at_the_cpu_limit(sandbox):
    result, lines = await _attack(sandbox, """
import resource
try:
    resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("raised")
    raise SystemExit(3)
except ValueError as error:
    print(error, flush=True)
while True:
    pass
""", CPU_LIMITS)
    assert result.error == "cpu_limit" and "CPU time" in result.stderr
    assert lines == ["not allowed to raise maximum limit"]


async def test_file_size_and_open_files_stop_at_their_limits(sandbox):
    limits = SandboxLimits(wall_seconds=8.0, file_bytes=1 << 20, open_files=32)
    result, lines = await _attack(sandbox, """
import resource
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
    print("raised")
except ValueError as error:
    print(error)
with open("big", "wb") as handle:  # Python ignores SIGXFSZ, so the write fails with EFBIG
    print(attempt(lambda: handle.write(bytes(2 << 20))))
print(os.path.getsize("big") <= 1 << 20)
handles = []
print(attempt(lambda: [handles.append(open("main.py")) for _ in range(64)]))
print(len(handles) < 32)
""", limits)
    assert result.ok, result.stderr
    assert lines == ["not allowed to raise maximum limit", "EFBIG", "True", "EMFILE", "True"]


async def test_sleep_ignoring_signals_stops_at_the_wall_time_limit(sandbox):
    result, lines = await _attack(sandbox, """
import signal, time
for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(number, signal.SIG_IGN)
print("sleeping", flush=True)
time.sleep(1000)
""", SandboxLimits(wall_seconds=5.0))  # room to start on a loaded machine
    assert result.error == "wall_time" and result.exit_code is None
    assert lines == ["sleeping"]


async def test_signals_reach_no_other_process(sandbox):
    """The code may signal itself; its parent, its process group, every process (-1), a host
    process it was told the pid of, and the test runner all stay untouched."""
    victim = subprocess.Popen(["sleep", "60"])
    try:
        result, lines = await _attack(sandbox, f"""
import signal
received = []
signal.signal(signal.SIGUSR1, lambda number, frame: received.append(number))
print(attempt(lambda: os.kill(os.getpid(), signal.SIGUSR1)), received == [signal.SIGUSR1])
for pid in ({victim.pid}, {os.getpid()}, os.getppid(), 0, -1):
    print(attempt(lambda: os.kill(pid, signal.SIGTERM)))
""")
        assert victim.poll() is None  # still running
    finally:
        victim.kill()
        victim.wait()
    assert result.ok, result.stderr
    assert lines == ["allowed None True"] + ["EPERM"] * 5


async def test_ctypes_raw_syscalls_are_refused(sandbox):
    """Native calls bypass every Python-level check; the seccomp filter sees them anyway."""
    result, lines = await _attack(sandbox, """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def raw(*args):
    value = libc.syscall(*args)
    if value == 0 and args[0] in (56, 57, 58):
        libc.syscall(231, 0)  # a child that did get made exits at once
    return value, errno.errorcode.get(ctypes.get_errno(), "0") if value < 0 else "-"
print(raw(57))                              # fork
print(raw(56, 0x11, 0, 0, 0, 0))            # clone(SIGCHLD)
print(raw(41, 1, 1, 0))                     # socket(AF_UNIX, SOCK_STREAM)
print(raw(272, 0x10000000))                 # unshare(CLONE_NEWUSER)
print(raw(101, 0, 0, 0, 0))                 # ptrace(PTRACE_TRACEME)
print(raw(310, 1, 0, 0, 0, 0, 0))           # process_vm_readv(1, ...)
print(raw(425, 8, ctypes.create_string_buffer(120)))  # io_uring_setup
print(raw(59, b"/bin/sh", None, None))      # execve
""")
    assert result.ok, result.stderr
    assert lines == ["(-1, 'EPERM')"] * 8


def _run_bpf(program: list[tuple[int, int, int, int]], nr: int, arch: int = AUDIT_ARCH_X86_64,
             arg0: int = 0) -> int:
    """Evaluate the filter's four instruction kinds on one struct seccomp_data."""
    words = {0: nr, 4: arch, 16: arg0 & 0xFFFFFFFF, 20: arg0 >> 32}
    accumulator, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x06:
            return k
        if code == 0x20:
            accumulator, pc = words[k], pc + 1
        else:
            taken = accumulator == k if code == 0x15 else accumulator >= k
            pc += 1 + (jt if taken else jf)


def test_filter_refuses_other_architectures_and_foreign_pids():
    program = build_program(own_pid=1)
    eperm = RET_ERRNO | errno.EPERM
    assert _run_bpf(program, 0) == RET_ALLOW  # read
    assert _run_bpf(program, 0, arch=0x40000003) == RET_KILL_PROCESS  # i386 via int 0x80
    assert _run_bpf(program, 0 | X32_SYSCALL_BIT) == eperm  # the x32 ABI
    assert all(_run_bpf(program, nr) == eperm for nr in DENIED_SYSCALLS.values())
    assert _run_bpf(program, 62, arg0=1) == RET_ALLOW  # kill(self)
    assert _run_bpf(program, 62, arg0=2) == eperm
    assert _run_bpf(program, 62, arg0=(1 << 32) | 1) == eperm  # high word must be zero
    assert _run_bpf(program, 234, arg0=1) == RET_ALLOW  # tgkill(self, ...)
    assert _run_bpf(program, 234, arg0=0xFFFFFFFF) == eperm


def test_strict_mode_names_the_missing_layer():
    isolation = {"namespaces": "mntns+netns+pidns", "mounts": "tmpfs over /tmp",
                 "landlock": "abi7", "capabilities": "none",
                 "seccomp": "unavailable: [Errno 38] the sandbox's seccomp filter is written "
                            "for x86_64, this machine is aarch64"}
    with pytest.raises(SandboxUnavailableError, match=r"missing: seccomp \(unavailable: .*"
                                                      r"aarch64\).*strict=False"):
        PythonSandbox(LIMITS)._check_setup(97, isolation, "")
