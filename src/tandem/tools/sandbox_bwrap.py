"""The sandbox's outer layer: a bubblewrap command line (namespaces and a read-only view).

bubblewrap (`bwrap`, the Debian/Ubuntu/Fedora package `bubblewrap`) gives the run fresh PID,
IPC, network, UTS and mount namespaces, pivots into a new root that holds only read-only binds of
the interpreter's runtime, four device nodes and a size-capped private tmpfs at WORK_DIR, and
runs its own PID 1 (never the code): killing that init kills every process of the run, and it
dies by itself when bwrap or bwrap's parent dies. The code never runs as a host user that owns
anything: started by an ordinary user, bwrap adds a user namespace and drops every capability
(the code is that user, mapped); started by root, a user namespace would map the code to host
root, who owns every root-only file of the view, so the bootstrap instead switches to a uid of
its own (SANDBOX_UID_BASE + a rotating offset, no capabilities, no groups) before any code runs,
which also gives each run its own per-user kernel limits.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

SANDBOX_DIR = "/sandbox"  # in the view only; a host path under it cannot be shown
WORK_DIR = f"{SANDBOX_DIR}/work"  # the code's cwd, HOME and TMPDIR: the only writable path
BOOT_DIR = f"{SANDBOX_DIR}/boot"  # the bootstrap and its seccomp sibling, read-only
BOOT_FILES = ("sandbox_boot.py", "sandbox_seccomp.py")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")
NAMESPACES = ("user", "pid", "ipc", "net", "uts", "mount")
# bwrap started by root: no user namespace; the bootstrap drops to a uid of its own with what
# these capabilities allow, then holds none
ROOT_NAMESPACE_FLAGS = ("--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts",
                        "--unshare-cgroup-try")
BOOT_CAPABILITIES = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")
SANDBOX_UID_BASE = 2_100_000_000  # far above distributions' and containers' uid ranges
SANDBOX_UID_COUNT = 1 << 16
END_SECONDS = 10.0  # for bubblewrap to name its init, and for the run to end once it is killed
INSTALL_HINT = ("install it with `apt-get install -y bubblewrap` (`make test` does; other "
                "distributions call the package bubblewrap too)")

# Asked of the target interpreter itself, which may not be the one running tandem.
RUNTIME_QUERY = """
import json, sys, sysconfig
paths = sysconfig.get_paths()
shared = sysconfig.get_config_var("Py_ENABLE_SHARED")
print(json.dumps({"executable": sys.executable, "prefix": sys.prefix,
                  "base_prefix": sys.base_prefix,
                  "dirs": [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")],
                  "libdir": sysconfig.get_config_var("LIBDIR") if shared else None}))
"""


def find_bubblewrap(path: str | None) -> str | None:
    """The bwrap executable: `path` if given, else the first on PATH; None when absent."""
    found = shutil.which(path or "bwrap")
    return os.path.realpath(found) if found else None


def _symlink_hops(path: str) -> list[str]:
    """`path` and every path its symlink chain passes through (each must exist in the view)."""
    hops: list[str] = []
    while path not in hops:
        hops.append(path)
        if not os.path.islink(path):
            break
        path = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
    return hops


def _outermost(paths: list[str]) -> list[str]:
    """Existing paths, sorted, without those under another one (a parent bind shows them)."""
    kept: list[str] = []
    for path in sorted({os.path.normpath(p) for p in paths if os.path.exists(p)}):
        if not any(path.startswith(os.path.join(parent, "")) for parent in kept):
            kept.append(path)
    return kept


def runtime_view(python: str) -> tuple[str, list[str]]:
    """The interpreter's own executable (a launcher such as a pyenv shim is not run in the
    sandbox) and the host paths it needs to start and import its packages, read-only."""
    query = subprocess.run([python, "-I", "-c", RUNTIME_QUERY], capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
    if query.returncode != 0:
        raise RuntimeError(f"cannot ask {python} where its runtime lives: {query.stderr[-500:]}")
    runtime = json.loads(query.stdout)
    paths = [*_symlink_hops(runtime["executable"]), *runtime["dirs"], *LIBRARY_DIRS]
    if runtime["prefix"] != runtime["base_prefix"]:  # a venv: python reads pyvenv.cfg first
        paths.append(os.path.join(runtime["prefix"], "pyvenv.cfg"))
    if runtime["libdir"]:
        paths += [str(p) for p in Path(runtime["libdir"]).glob("libpython*")]
    view = _outermost(paths)
    clashes = [path for path in view if os.path.join(path, "").startswith(SANDBOX_DIR + "/")
               or SANDBOX_DIR.startswith(os.path.join(path, ""))]
    if clashes:
        raise RuntimeError(f"the interpreter's runtime {clashes} overlaps {SANDBOX_DIR}, where "
                           "the sandbox keeps its own files: install Python elsewhere")
    return runtime["executable"], view


def _parents(view: tuple[str, ...]) -> list[str]:
    """The folders above the view's paths, outermost first: bwrap would copy their host modes
    (/root is 0700), hiding the runtime from the sandbox's unprivileged uid."""
    parents = {str(parent) for path in view for parent in Path(path).parents if str(parent) != "/"}
    return sorted(parents, key=lambda path: (path.count("/"), path))


@dataclass(frozen=True)
class BubblewrapCommand:
    """Everything but the per-run file descriptors and uid; `argv` adds those."""

    bwrap: str
    python: str
    view: tuple[str, ...]
    work_bytes: int
    host_root: bool = False  # started by root: the bootstrap drops to a sandbox uid

    def argv(self, code_fd: int, settings: str, info_fd: int | None = None,
             uid: int = SANDBOX_UID_BASE) -> list[str]:
        """bwrap options then the bootstrap; code_fd holds main.py, info_fd gets the init's
        host pid (bubblewrap's {"child-pid": N}); uid is the run's own when host_root."""
        boot = Path(__file__).parent
        argv = [self.bwrap, "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        if self.host_root:
            argv += list(ROOT_NAMESPACE_FLAGS)
            for capability in BOOT_CAPABILITIES:
                argv += ["--cap-add", capability]
        else:
            argv += ["--unshare-all", "--unshare-user"]
        if info_fd is not None:
            argv += ["--info-fd", str(info_fd)]
        for folder in [*_parents(self.view + DEVICES), SANDBOX_DIR, BOOT_DIR]:
            argv += ["--perms", "0755", "--dir", folder]
        for path in self.view:
            argv += ["--ro-bind", path, path]
        for name in BOOT_FILES:
            argv += ["--ro-bind", str(boot / name), f"{BOOT_DIR}/{name}"]
        for device in DEVICES:
            argv += ["--dev-bind-try", device, device]
        argv += ["--size", str(self.work_bytes), "--perms", "1777", "--tmpfs", WORK_DIR,
                 "--perms", "0644", "--file", str(code_fd), f"{WORK_DIR}/main.py",
                 "--chdir", WORK_DIR, "--remount-ro", "/"]
        run_as = str(uid) if self.host_root else "-"
        return argv + ["--", self.python, "-I", "-B", f"{BOOT_DIR}/sandbox_boot.py", settings,
                       run_as]

    def report(self) -> dict[str, str]:
        """The isolation bubblewrap was asked for, for SandboxResult.isolation."""
        namespaces = NAMESPACES[1:] if self.host_root else NAMESPACES
        user = (f"a sandbox uid from {SANDBOX_UID_BASE} (host root started it)" if self.host_root
                else "the host user, in a user namespace")
        return {"namespaces": "+".join(namespaces) + f" ({self.bwrap})",
                "view": "read-only " + ",".join(self.view),
                "work_dir": f"private tmpfs {WORK_DIR}, {self.work_bytes >> 20} MiB",
                "capabilities": "all dropped", "user": user}


def code_file(code: str) -> int:
    """An anonymous in-memory file holding the code; bubblewrap copies it to WORK_DIR/main.py."""
    fd = os.memfd_create("main.py", 0)
    os.write(fd, code.encode("utf-8", "surrogatepass"))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


async def open_namespace_init(info_fd: int, bwrap_pid: int) -> int | None:
    """A pidfd for the sandbox's PID 1 (bubblewrap's child, named in its info JSON); None when
    there is none (bubblewrap failed before cloning, or the namespace is gone already)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                os.fdopen(info_fd, "rb"))
    try:
        info = await reader.read()
    finally:
        transport.close()
    if not info:
        return None
    pid = json.loads(info)["child-pid"]
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        with open(f"/proc/{pid}/stat") as handle:  # still bubblewrap's child, not a reused pid
            parent = int(handle.read().rpartition(")")[2].split()[1])
    except FileNotFoundError:
        parent = None
    if parent != bwrap_pid:
        os.close(pidfd)
        return None
    return pidfd


async def end_run(namespace_init: asyncio.Task, process: asyncio.subprocess.Process) -> None:
    """SIGKILL the namespace's init and wait for it to exit, which the kernel lets it do only
    once every process of its namespace is gone; bubblewrap then exits by itself (and is
    killed if it does not). Bounded by END_SECONDS at each step."""
    try:
        await asyncio.wait({namespace_init}, timeout=END_SECONDS)  # known ms after the start
        if namespace_init.done() and not namespace_init.cancelled() \
                and namespace_init.exception() is None and namespace_init.result() is not None:
            pidfd = namespace_init.result()
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                await _exited(pidfd)
            except ProcessLookupError:
                pass
            finally:
                os.close(pidfd)
        await asyncio.wait_for(process.wait(), END_SECONDS)  # asyncio waits for the pipes too
    except asyncio.TimeoutError:
        pass
    finally:
        namespace_init.cancel()
        if process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


async def _exited(pidfd: int) -> None:
    """Wait (at most END_SECONDS) until the process behind a pidfd has exited."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        await asyncio.wait_for(exited, END_SECONDS)
    finally:
        loop.remove_reader(pidfd)
