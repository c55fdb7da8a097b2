"""What the sandbox's seccomp filter refuses, after the stack-walk tamper (sandbox_attack.py):
process and thread creation, exec, every socket family, device nodes, raw syscalls through
ctypes. The filter program itself is checked instruction by instruction on foreign
architectures and pids. The namespaces' share of the guarantees is in test_sandbox_escape.py.
"""

from __future__ import annotations

import errno

import pytest
from sandbox_attack import LAYERS, attack, missing_isolation, sandbox_with

from tandem.tools.python_sandbox import PythonSandbox, SandboxUnavailableError, _check_setup
from tandem.tools.sandbox_seccomp import (AUDIT_ARCH_X86_64, DENIED_SYSCALLS, RET_ALLOW,
                                          RET_ERRNO, RET_KILL_PROCESS, X32_SYSCALL_BIT,
                                          build_program)

MISSING_ISOLATION = missing_isolation()
needs_sandbox = pytest.mark.skipif(MISSING_ISOLATION is not None,
                                   reason=f"sandbox unavailable: {MISSING_ISOLATION}")


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return sandbox_with("seccomp")


@needs_sandbox
async def test_every_socket_family_is_refused(sandbox):
    result, lines = await attack(sandbox, """
import socket
for family in ("AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET", "AF_VSOCK"):
    print(family, attempt(lambda: socket.socket(getattr(socket, family), socket.SOCK_DGRAM)))
print(attempt(lambda: len(socket.socketpair())))  # an anonymous pair reaches nothing: allowed
""")
    assert result.ok, result.stderr
    assert lines == [f"{family} EPERM" for family in
                     ("AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET", "AF_VSOCK")] \
        + ["allowed 2"]


@needs_sandbox
async def test_reimported_posixsubprocess_starts_no_child(sandbox):
    """The fresh module's fork_exec is the real one; the kernel refuses the fork under it,
    so preexec_fn (which would run in the child) never runs."""
    result, lines = await attack(sandbox, """
print(_posixsubprocess.fork_exec is subprocess._fork_exec, type(subprocess._fork_exec).__name__)
print(attempt(lambda: subprocess.Popen(["/bin/true"], preexec_fn=lambda: open("child_ran", "w"))))
print(os.path.exists("child_ran"))
""")
    assert result.ok, result.stderr
    assert lines == ["True builtin_function_or_method", "EPERM", "False"]


@needs_sandbox
async def test_fork_bomb_creates_no_process(sandbox):
    result, lines = await attack(sandbox, """
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


@needs_sandbox
async def test_os_system_subprocess_and_exec_run_nothing(sandbox):
    result, lines = await attack(sandbox, f"""
import subprocess
print(os.system("touch ran"))  # glibc reports a failed spawn as exit status 127
print(attempt(lambda: subprocess.run(["/bin/sh", "-c", "touch ran"])))
print(attempt(lambda: os.posix_spawn(sys.executable, ["python", "-c", "open('ran', 'w')"], {{}})))
print(attempt(lambda: os.execv(sys.executable, ["python", "-c", "open('ran', 'w')"])))
print(os.path.exists("ran"))
""")
    assert result.ok, result.stderr
    assert lines == [str(127 << 8), "EPERM", "EPERM", "EPERM", "False"]


@needs_sandbox
@pytest.mark.parametrize("layers", list(LAYERS))
async def test_device_nodes_cannot_be_made(layers):
    """As root with CAP_MKNOD a block device node in the work dir would read the raw disk:
    seccomp refuses mknod, and without it no capability is left to make one."""
    result, lines = await attack(sandbox_with(layers), """
import stat
print(attempt(lambda: os.mknod("disk", stat.S_IFBLK | 0o600, os.makedev(7, 0))))
print(attempt(lambda: os.mknod("null", stat.S_IFCHR | 0o600, os.makedev(1, 3))))
print(os.path.exists("disk") or os.path.exists("null"))
""")
    assert result.ok, result.stderr
    assert lines == ["EPERM", "EPERM", "False"]


@needs_sandbox
async def test_ctypes_raw_syscalls_are_refused(sandbox):
    """Native calls bypass every Python-level check; the seccomp filter sees them anyway."""
    result, lines = await attack(sandbox, """
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
print(raw(29, 0, 1 << 20, 0o1600))          # shmget(IPC_PRIVATE, 1 MiB, IPC_CREAT)
print(raw(319, b"x", 0))                    # memfd_create
""")
    assert result.ok, result.stderr
    assert lines == ["(-1, 'EPERM')"] * 10


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
    program = build_program(own_pid=2)
    eperm = RET_ERRNO | errno.EPERM
    assert _run_bpf(program, 0) == RET_ALLOW  # read
    assert _run_bpf(program, 0, arch=0x40000003) == RET_KILL_PROCESS  # i386 via int 0x80
    assert _run_bpf(program, 0 | X32_SYSCALL_BIT) == eperm  # the x32 ABI
    assert all(_run_bpf(program, nr) == eperm for nr in DENIED_SYSCALLS.values())
    assert _run_bpf(program, 62, arg0=2) == RET_ALLOW  # kill(self)
    assert _run_bpf(program, 62, arg0=1) == eperm  # bubblewrap's init
    assert _run_bpf(program, 62, arg0=(1 << 32) | 2) == eperm  # high word must be zero
    assert _run_bpf(program, 234, arg0=2) == RET_ALLOW  # tgkill(self, ...)
    assert _run_bpf(program, 234, arg0=0xFFFFFFFF) == eperm


def test_strict_mode_names_the_missing_layer():
    isolation = {"limits": "address space 512 MiB",
                 "seccomp": "unavailable: [Errno 38] the sandbox's seccomp filter is written "
                            "for x86_64, this machine is aarch64"}
    with pytest.raises(SandboxUnavailableError, match=r"missing: seccomp \(unavailable: .*"
                                                      r"aarch64\).*strict=False"):
        _check_setup(True, 97, isolation, "")
    _check_setup(False, 97, isolation, "")  # accepted explicitly: runs without the filter
