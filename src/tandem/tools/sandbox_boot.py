"""The child side of the Python sandbox: lock this process down, then run the user's code.

Run as `python -I sandbox_boot.py SETTINGS_JSON` with cwd = a fresh temp dir holding main.py.
Self-contained on purpose (stdlib only, no tandem import, its one sibling loaded by path): it
must work in any interpreter. Layers, in order: mount, network and PID namespaces (the code runs
as PID 1 of its own namespace, with empty tmpfs over the host's socket folders), Landlock
(filesystem, execute, TCP, signals, abstract sockets), resource limits, no capabilities, a
seccomp filter (sandbox_seccomp.py), then an optional Python audit hook that only words the
errors better. The first stderr line reports which layers hold.
"""

import ctypes
import errno
import importlib.util
import json
import os
import resource
import select
import signal
import sys
import traceback
import types

REPORT_PREFIX = "__tandem_sandbox__ "
EXIT_SETUP_FAILED = 97

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
SYS_CAPSET, LINUX_CAPABILITY_VERSION_3 = 126, 0x20080522
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
# Where programs keep path-named Unix sockets (Ray's raylet and plasma sockets: /tmp/ray).
HIDDEN_DIRS = ("/tmp", "/var/tmp", "/run", "/var/run", "/dev/shm")
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1

FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_MAKE_CHAR, FS_MAKE_BLOCK = 1 << 6, 1 << 11
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

# The audit hook's lists. The code can reach and change them (issue 11), so they only word the
# errors; seccomp and Landlock are what refuse.
BLOCKED_EVENTS = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                  "subprocess.Popen", "socket.__new__", "gc.get_objects", "gc.get_referrers",
                  "gc.get_referents")
BLOCKED_CTYPES_EVENTS = ("ctypes.call_function", "ctypes.dlsym", "ctypes.dlsym/handle",
                         "ctypes.cdata", "ctypes.cdata/buffer", "ctypes.string_at",
                         "ctypes.wstring_at", "ctypes.set_errno", "ctypes.set_exception")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def isolate_namespaces(libc) -> str:
    """New mount, network (no interfaces but a down loopback) and PID (for the children of this
    process) namespaces; inside a user namespace, mapping only our own ids, when not root."""
    if libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID) == 0:
        return "mntns+netns+pidns"
    uid, gid = os.getuid(), os.getgid()
    # Without CAP_SYS_ADMIN a user namespace grants it inside; the uid stays the same outside.
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID) != 0:
        return "unavailable: " + os.strerror(ctypes.get_errno())
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)
    return "userns+mntns+netns+pidns"


def _encode(text: str | None) -> bytes | None:
    return None if text is None else os.fsencode(text)


def _mount(libc, source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    if libc.mount(_encode(source), _encode(target), _encode(fstype), flags, _encode(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount({source!r}, {target!r})")


def hide_host_paths(libc, work_dir: str, read_roots: list[str]) -> str:
    """Make every mount private to this namespace, cover the folders that hold host sockets
    with empty tmpfs, and bind the work dir and any read root under a covered folder (a venv
    or checkout under /tmp) back at their own paths: only those stay visible there."""
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    folders = [f for f in HIDDEN_DIRS if not os.path.islink(f) and os.path.isdir(f)]  # /var/run: a link
    inside = [os.path.realpath(root) for root in read_roots
              if any(os.path.join(os.path.realpath(root), "").startswith(os.path.join(f, ""))
                     for f in folders) and os.path.isdir(root)]
    # descriptors first: once a folder is covered, the paths below it are gone
    keep = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
            for path in [work_dir, *inside]]
    for folder in folders:
        _mount(libc, "tandem-sandbox", folder, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               "size=64k,mode=0755")
    for path, fd in keep:
        os.makedirs(path, exist_ok=True)  # a mount point inside the fresh tmpfs when covered
        _mount(libc, f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    os.chdir(work_dir)
    rebound = f"; bound back {','.join(inside)}" if inside else ""
    return "tmpfs over " + ",".join(folders) + rebound


def fork_namespace_init(libc, cpu_seconds: int) -> None:
    """Fork; the child returns as PID 1 of the new PID namespace and runs the code, while this
    process waits and exits the way the child did. When PID 1 dies the kernel kills everything
    left in the namespace (setsid cannot escape that), and PDEATHSIG kills PID 1 when this
    process is killed, so a wall-time kill of this process group ends every process of the run."""
    alive_read, alive_write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(alive_write)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if select.select([alive_read], [], [], 0)[0]:  # EOF: the parent died before prctl
            os._exit(EXIT_SETUP_FAILED)
        os.close(alive_read)
        return
    os.close(alive_read)
    _, status, usage = os.wait4(child, 0)
    exit_code = os.waitstatus_to_exitcode(status)
    if exit_code < 0:  # die of the same signal, so the host sees what happened to the code
        signal_number = -exit_code
        # PID 1 ignores SIGXCPU, so the CPU limit arrives as SIGKILL; only it or the OOM killer
        # can kill PID 1 here. rusage lags the kernel's limit clock (seen: 1.7 s at a 2 s
        # limit on a VM), hence the loose bound.
        if signal_number == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= cpu_seconds / 2:
            signal_number = signal.SIGXCPU
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if signal_number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signal_number, signal.SIG_DFL)
        os.kill(os.getpid(), signal_number)
    os._exit(exit_code)


def set_limits(memory_bytes: int, cpu_seconds: int, file_bytes: int, open_files: int) -> None:
    """Hard and soft limits alike; without CAP_SYS_RESOURCE the code cannot raise them again."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_capabilities(libc) -> str:
    """Empty the bounding, ambient, effective, permitted and inheritable sets: root in the
    sandbox can no longer raise rlimits, make device nodes or use any other privilege."""
    capability = 0
    while libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) == 0:
        capability += 1
    if ctypes.get_errno() != errno.EINVAL:  # EINVAL: past the last capability the kernel knows
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    if libc.syscall(SYS_CAPSET, ctypes.byref(header), ctypes.byref((_CapData * 2)())) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    return f"none ({capability} dropped from the bounding set)"


def _landlock_abi(libc) -> int:
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    return max(int(abi), 0)


def _fs_rights(abi: int) -> int:
    rights = (1 << 13) - 1  # EXECUTE .. MAKE_SYM (ABI 1)
    if abi >= 2:
        rights |= 1 << 13  # REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


def _add_path_rule(libc, ruleset_fd: int, path: str, access: int) -> None:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        if not os.path.isdir(path):
            access &= FILE_RIGHTS
        rule = _PathBeneathAttr(allowed_access=access, parent_fd=fd)
        if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset_fd, LANDLOCK_RULE_PATH_BENEATH,
                        ctypes.byref(rule), 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
    finally:
        os.close(fd)


def apply_landlock(libc, read_roots: list[str], write_root: str, devices: list[str]) -> str:
    """Allow reading read_roots; under write_root everything but execute and device nodes;
    deny all TCP."""
    abi = _landlock_abi(libc)
    if abi < 1:
        return "unavailable: kernel without Landlock"
    all_fs = _fs_rights(abi)
    attr = _RulesetAttr(handled_access_fs=all_fs)
    size = 8
    if abi >= 4:
        attr.handled_access_net = NET_BIND_TCP | NET_CONNECT_TCP
        size = 16
    if abi >= 6:
        attr.scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
        size = 24
    ruleset_fd = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset_fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for root in read_roots:
            if os.path.exists(root):
                _add_path_rule(libc, ruleset_fd, root, FS_READ_FILE | FS_READ_DIR)
        for device in devices:
            if os.path.exists(device):
                _add_path_rule(libc, ruleset_fd, device, FS_READ_FILE | FS_WRITE_FILE)
        _add_path_rule(libc, ruleset_fd, write_root,
                       all_fs & ~(FS_EXECUTE | FS_MAKE_CHAR | FS_MAKE_BLOCK))
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset_fd, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset_fd)
    return f"abi{abi}" + (" +tcp" if abi >= 4 else "") + (" +scopes" if abi >= 6 else "")


def install_audit_hook(read_roots: list[str], write_root: str, devices: list[str]) -> None:
    """Clear `PermissionError: sandbox: ...` messages for what the kernel layers refuse anyway
    (processes, sockets, files outside the roots), plus ctypes and gc walks. Not a guarantee."""
    readable = tuple(os.path.join(os.path.realpath(r), "") for r in read_roots)
    writable = os.path.join(os.path.realpath(write_root), "")
    devices = tuple(devices)

    def allowed(path: str, writing: bool) -> bool:
        full = os.path.realpath(path)
        if full + os.sep == writable or full.startswith(writable):
            return True
        if full in devices:
            return True
        return not writing and (full + os.sep in readable or full.startswith(readable))

    def hook(event: str, args: tuple) -> None:
        if event in BLOCKED_EVENTS or event in BLOCKED_CTYPES_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "ctypes.dlopen" and args[0] is not None:
            raise PermissionError(f"sandbox: loading native library {args[0]!r} is not allowed")
        if event == "open" and isinstance(args[0], (str, bytes)):
            path = os.fsdecode(args[0])
            mode = args[1] if isinstance(args[1], str) else ""
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            writing = any(c in mode for c in "wax+") or bool(flags & (os.O_WRONLY | os.O_RDWR))
            if not allowed(path, writing):
                raise PermissionError(f"sandbox: no access to {path!r} outside the work directory")
        if event == "object.__setattr__" and args[1] in ("__code__", "__closure__"):
            raise PermissionError("sandbox: replacing function code is not allowed")

    sys.addaudithook(hook)
    import _posixsubprocess  # subprocess's fork+exec raises no audit event of its own

    def refuse(*args, **kwargs):
        raise PermissionError("sandbox: starting processes is not allowed")

    _posixsubprocess.fork_exec = refuse


def _layer(setup, *args) -> str:
    """Run one layer's setup; its report, or "unavailable: why" when the kernel refused it."""
    try:
        return setup(*args)
    except OSError as error:
        return f"unavailable: {error}"


def _load_sibling(name: str) -> types.ModuleType:
    """Import a module from this file's folder (not on sys.path: `python -I` and no tandem)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__),
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    settings = json.loads(sys.argv[1])
    sys.dont_write_bytecode = True
    work_dir = os.getcwd()
    with open(os.path.join(work_dir, "main.py"), encoding="utf-8") as handle:
        source = handle.read()
    seccomp = _load_sibling("sandbox_seccomp")  # before Landlock hides its folder
    libc = _libc()
    report = {"namespaces": isolate_namespaces(libc)}
    if report["namespaces"].startswith("unavailable"):
        report["mounts"] = "unavailable: no mount namespace"
    else:
        report["mounts"] = _layer(hide_host_paths, libc, work_dir, settings["read_roots"])
        fork_namespace_init(libc, settings["cpu_seconds"])
    report["landlock"] = _layer(apply_landlock, libc, settings["read_roots"], work_dir,
                                settings["devices"])
    set_limits(settings["memory_bytes"], settings["cpu_seconds"], settings["file_bytes"],
               settings["open_files"])
    report["capabilities"] = _layer(drop_capabilities, libc)
    report["seccomp"] = _layer(seccomp.install_filter, libc)
    if settings["strict"] and any(state.startswith("unavailable") for state in report.values()):
        sys.stderr.write(REPORT_PREFIX + json.dumps(report) + "\n")
        sys.exit(EXIT_SETUP_FAILED)
    if settings["python_guards"]:  # after the ctypes calls above, which it would refuse
        install_audit_hook(settings["read_roots"], work_dir, settings["devices"])
    del libc
    sys.stderr.write(REPORT_PREFIX + json.dumps(report) + "\n")
    sys.stderr.flush()
    code = compile(source, "main.py", "exec")
    module = types.ModuleType("__main__")  # the user's code must not see this module's globals
    module.__file__ = os.path.join(work_dir, "main.py")
    sys.modules["__main__"] = module
    sys.argv = ["main.py"]
    try:
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as error:  # report the user's frames only, as plain python would
        frames = [frame for frame in traceback.extract_tb(error.__traceback__)
                  if frame.filename != __file__]
        sys.stderr.write("Traceback (most recent call last):\n"
                         + "".join(traceback.format_list(frames))
                         + "".join(traceback.format_exception_only(type(error), error)))
        sys.exit(1)


if __name__ == "__main__":
    main()
