"""The inner side of the Python sandbox: set the limits and the seccomp filter, then run main.py.

Run as `python -I -B /sandbox/boot/sandbox_boot.py SETTINGS_JSON UID` inside bubblewrap
(sandbox_bwrap.py), with cwd = the private tmpfs holding main.py. Self-contained on purpose
(stdlib only, no tandem import, its one sibling loaded by path): it must work in any
interpreter. When UID is a number (bubblewrap started by host root, no user namespace), first
become that unprivileged uid with no groups, no capabilities and no way back; then resource
limits, the seccomp filter (sandbox_seccomp.py), and an optional Python audit hook that only
words the errors better. The first stderr line reports which of these layers hold.
"""

import ctypes
import importlib.util
import json
import os
import resource
import sys
import traceback
import types

REPORT_PREFIX = "__tandem_sandbox__ "
EXIT_SETUP_FAILED = 97

# The audit hook's lists. The code can reach and change them (issue 11), so they only word the
# errors; the seccomp filter and the namespaces are what refuse.
BLOCKED_EVENTS = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                  "subprocess.Popen", "socket.__new__", "gc.get_objects", "gc.get_referrers",
                  "gc.get_referents")
BLOCKED_CTYPES_EVENTS = ("ctypes.call_function", "ctypes.dlsym", "ctypes.dlsym/handle",
                         "ctypes.cdata", "ctypes.cdata/buffer", "ctypes.string_at",
                         "ctypes.wstring_at", "ctypes.set_errno", "ctypes.set_exception")


PR_SET_NO_NEW_PRIVS, PR_CAPBSET_READ, PR_CAPBSET_DROP = 38, 23, 24
CAPABILITY_VERSION_3, CAPABILITY_SLOTS = 0x20080522, 64  # no /proc in the view: ask the kernel


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _capabilities_held(libc) -> list[str]:
    """Which of this process's capability sets are not empty (bounding set included)."""
    header, data = _CapHeader(CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    held = [name for name in ("effective", "permitted") if any(getattr(d, name) for d in data)]
    if any(libc.prctl(PR_CAPBSET_READ, cap, 0, 0, 0) == 1 for cap in range(CAPABILITY_SLOTS)):
        held.append("bounding")
    return held


def become(uid: int) -> str:
    """Drop from host root to `uid` (and gid `uid`): no supplementary groups, an empty
    capability bounding set, no_new_privs (no setuid program gives root back); raise OSError
    when any of it did not hold, or the runtime is not readable as that uid."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    for capability in range(CAPABILITY_SLOTS):  # past the kernel's last one: EINVAL, nothing held
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # every uid non-zero: the kernel clears the capabilities
    held = _capabilities_held(libc)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid) \
            or os.getgroups() or held:
        raise OSError(f"still uid {os.getresuid()}, gid {os.getresgid()}, groups "
                      f"{os.getgroups()}, capabilities {held}")
    runtime = os.path.dirname(os.__file__)
    if not os.access(runtime, os.R_OK | os.X_OK):
        raise OSError(f"the interpreter's runtime {runtime} is not readable by an unprivileged "
                      "user (the sandbox's uid): make it world-readable (chmod -R o+rX)")
    return f"uid {uid}, no groups, no capabilities, no_new_privs"


def set_limits(memory_bytes: int, cpu_seconds: int, file_bytes: int, open_files: int) -> str:
    """Soft limits the code cannot raise past the hard ones (no CAP_SYS_RESOURCE). The CPU hard
    limit is one second later, so the soft one's SIGXCPU is what ends a busy loop."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return (f"address space {memory_bytes >> 20} MiB, cpu {cpu_seconds} s, file "
            f"{file_bytes >> 20} MiB, {open_files} open files, no core")


def install_audit_hook() -> None:
    """Clear `PermissionError: sandbox: ...` messages for what seccomp refuses anyway (processes,
    sockets), plus ctypes and gc walks. Not a guarantee: the code can undo it."""

    def hook(event: str, args: tuple) -> None:
        if event in BLOCKED_EVENTS or event in BLOCKED_CTYPES_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "ctypes.dlopen" and args[0] is not None:
            raise PermissionError(f"sandbox: loading native library {args[0]!r} is not allowed")

    sys.addaudithook(hook)
    import _posixsubprocess  # subprocess's fork+exec raises no audit event of its own

    def refuse(*args, **kwargs):
        raise PermissionError("sandbox: starting processes is not allowed")

    _posixsubprocess.fork_exec = refuse


def _load_sibling(name: str) -> types.ModuleType:
    """Import a module from this file's folder (not on sys.path: `python -I` and no tandem)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__),
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _seccomp_layer(wanted: bool) -> str:
    """Install the filter; its report, or "unavailable: why" / "off" when it is not there."""
    if not wanted:
        return "off: PythonSandbox(seccomp=False)"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return _load_sibling("sandbox_seccomp").install_filter(libc)
    except OSError as error:
        return f"unavailable: {error}"


def main() -> None:
    settings = json.loads(sys.argv[1])
    sys.dont_write_bytecode = True
    user = "the host user, in a user namespace"
    if sys.argv[2] != "-":
        try:
            user = become(int(sys.argv[2]))
        except OSError as error:  # never run the code as host root
            sys.stderr.write(REPORT_PREFIX + json.dumps({"user": f"unavailable: {error}"}) + "\n")
            sys.exit(EXIT_SETUP_FAILED)
    work_dir = os.getcwd()
    with open(os.path.join(work_dir, "main.py"), "rb") as handle:
        source = handle.read()  # bytes: invalid UTF-8 is the code's SyntaxError, not ours
    report = {"user": user, "limits": set_limits(settings["memory_bytes"], settings["cpu_seconds"],
                                   settings["file_bytes"], settings["open_files"]),
              "seccomp": _seccomp_layer(settings["seccomp"])}
    if settings["strict"] and report["seccomp"].startswith("unavailable"):
        sys.stderr.write(REPORT_PREFIX + json.dumps(report) + "\n")
        sys.exit(EXIT_SETUP_FAILED)
    if settings["python_guards"]:  # after the ctypes calls above, which it would refuse
        install_audit_hook()
    sys.stderr.write(REPORT_PREFIX + json.dumps(report) + "\n")
    sys.stderr.flush()
    module = types.ModuleType("__main__")  # the user's code must not see this module's globals
    module.__file__ = os.path.join(work_dir, "main.py")
    sys.modules["__main__"] = module
    sys.argv = ["main.py"]
    try:
        exec(compile(source, "main.py", "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as error:  # report the user's frames only, as plain python would
        frames = [frame for frame in traceback.extract_tb(error.__traceback__)
                  if frame.filename != __file__]
        header = "Traceback (most recent call last):\n" if frames else ""  # none: SyntaxError
        sys.stderr.write(header + "".join(traceback.format_list(frames))
                         + "".join(traceback.format_exception_only(type(error), error)))
        sys.exit(1)


if __name__ == "__main__":
    main()
