"""The sandbox's seccomp-bpf filter, assembled by hand (stdlib only; loaded by sandbox_boot.py).

It covers what the namespaces do not: process and thread creation, exec, sockets, memory that
RLIMIT_AS does not count, and kernel-wide calls. Once installed a filter cannot be removed or
loosened by the process, so what it refuses stays refused whatever the code does to Python
state. x86_64 only: any other architecture (including 32-bit syscalls made from an x86_64
process) kills the process. Refused calls fail with EPERM, which Python raises as
PermissionError.
"""

import ctypes
import errno
import os
import platform

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JGE|K
OFFSET_NR, OFFSET_ARCH, OFFSET_ARG0_LOW, OFFSET_ARG0_HIGH = 0, 4, 16, 20  # struct seccomp_data
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2

# x86_64 numbers (asm/unistd_64.h), refused whatever their arguments.
DENIED_SYSCALLS = {
    # process and thread creation: the code stays one single-threaded process
    "clone": 56, "fork": 57, "vfork": 58, "clone3": 435,
    # running programs
    "execve": 59, "execveat": 322,
    # every new socket, of any family (Unix sockets at file paths included); socketpair stays
    "socket": 41,
    # io_uring can open sockets and files without the syscalls above
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    # reaching other processes
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "pidfd_open": 434, "pidfd_getfd": 438, "pidfd_send_signal": 424, "tkill": 200,
    # namespaces and mounts
    "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155,
    "chroot": 161, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    # memory outside RLIMIT_AS: SysV shared memory, semaphores and queues (the IPC namespace
    # already hides the host's), POSIX message queues, memfd files
    "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "semget": 64, "semop": 65,
    "semctl": 66, "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71,
    "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243,
    "mq_notify": 244, "mq_getsetattr": 245, "memfd_create": 319, "memfd_secret": 447,
    # device nodes, file handles (open_by_handle_at walks around path checks)
    "mknod": 133, "mknodat": 259, "name_to_handle_at": 303, "open_by_handle_at": 304,
    # file-event watches: a watch on the read-only view reports the host's own reads of the
    # same files, and their instances count against a per-user limit
    "inotify_init": 253, "inotify_add_watch": 254, "inotify_init1": 294,
    "fanotify_init": 300, "fanotify_mark": 301,
    # kernel-wide state
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250, "add_key": 248,
    "request_key": 249, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168,
    "iopl": 172, "ioperm": 173, "settimeofday": 164, "clock_settime": 227,
    "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170, "setdomainname": 171,
    "acct": 163, "quotactl": 179, "quotactl_fd": 443, "syslog": 103, "vhangup": 153,
    "lookup_dcookie": 212, "uselib": 134,
}
# Signals only to the process itself: the first argument must be its own pid.
SELF_SIGNAL_SYSCALLS = {"kill": 62, "tgkill": 234, "rt_sigqueueinfo": 129,
                        "rt_tgsigqueueinfo": 297}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def build_program(own_pid: int) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions; jumps are forward offsets, as BPF needs."""
    program: list[tuple] = [(LD_W_ABS, 0, 0, OFFSET_ARCH), (JEQ_K, 0, "kill", AUDIT_ARCH_X86_64),
                            (LD_W_ABS, 0, 0, OFFSET_NR), (JGE_K, "deny", 0, X32_SYSCALL_BIT)]
    program += [(JEQ_K, "deny", 0, nr) for nr in sorted(DENIED_SYSCALLS.values())]
    program += [(JEQ_K, "self", 0, nr) for nr in sorted(SELF_SIGNAL_SYSCALLS.values())]
    program.append((RET_K, 0, 0, RET_ALLOW))
    labels = {"self": len(program)}
    program += [(LD_W_ABS, 0, 0, OFFSET_ARG0_LOW), (JEQ_K, 0, "deny", own_pid),
                (LD_W_ABS, 0, 0, OFFSET_ARG0_HIGH), (JEQ_K, 0, "deny", 0),
                (RET_K, 0, 0, RET_ALLOW)]
    labels["deny"] = len(program)
    program.append((RET_K, 0, 0, RET_ERRNO | errno.EPERM))
    labels["kill"] = len(program)
    program.append((RET_K, 0, 0, RET_KILL_PROCESS))

    def offset(index: int, target) -> int:
        if isinstance(target, int):
            return target
        jump = labels[target] - index - 1
        assert 0 <= jump <= 255, "BPF conditional jumps are 8-bit forward offsets"
        return jump

    return [(code, offset(i, jt), offset(i, jf), k) for i, (code, jt, jf, k) in enumerate(program)]


def install_filter(libc) -> str:
    """Install the filter on this (single-threaded) process; raise OSError when it cannot be."""
    if platform.machine() != "x86_64":
        raise OSError(errno.ENOSYS, f"the sandbox's seccomp filter is written for x86_64, "
                                    f"this machine is {platform.machine()}")
    program = build_program(os.getpid())
    instructions = (_SockFilter * len(program))(*(_SockFilter(*op) for op in program))
    fprog = _SockFprog(len(program), instructions)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP): kernel without seccomp-bpf")
    return f"bpf {len(program)} instructions, {len(DENIED_SYSCALLS)} syscalls refused"
