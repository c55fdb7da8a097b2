"""Escape attempts against the Python sandbox, one test per class of host resource.

Each attack first does the stack-walk tamper (sandbox_attack.TAMPER), then tries to reach the
host, and fails if it does. Every test runs twice: against the full sandbox ("seccomp", which
answers EPERM first) and against bubblewrap alone ("namespaces", where the errno shows that
the namespaces and the read-only view hold by themselves). Run as root, as CI does.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from sandbox_attack import LAYERS, OrphansComeHere, attack, missing_isolation, sandbox_with

from tandem.tools.python_sandbox import PythonSandbox, SandboxLimits
from tandem.tools.sandbox_bwrap import SANDBOX_DIR, SANDBOX_UID_BASE

HOST_DIR = Path(__file__).resolve().parent  # a host folder outside the sandbox's view
MISSING_ISOLATION = missing_isolation()
pytestmark = pytest.mark.skipif(MISSING_ISOLATION is not None,
                                reason=f"sandbox unavailable: {MISSING_ISOLATION}")


@pytest.fixture(scope="module", params=list(LAYERS))
def sandbox(request) -> PythonSandbox:
    return sandbox_with(request.param)


def _refused(sandbox: PythonSandbox, by_namespaces: str) -> str:
    """The errno an attempt gets: seccomp answers first when it is on."""
    return "EPERM" if sandbox.seccomp else by_namespaces


def _nothing_arrived(listener: socket.socket) -> bool:
    listener.setblocking(False)
    try:
        if listener.type == socket.SOCK_DGRAM:
            listener.recv(16)
        else:
            listener.accept()[0].close()
    except BlockingIOError:
        return True
    return False


async def test_no_process_outlives_the_run(sandbox):
    """Clear the parent-death signal, try to leave the session and process group, ignore
    signals, double fork (where fork is allowed): the host kills the namespace's init and
    with it every process of the run, so nothing is left alive and no pipe stays open."""
    runner = sandbox_with("seccomp" if sandbox.seccomp else "namespaces",
                          SandboxLimits(wall_seconds=5.0))
    with OrphansComeHere() as orphans:
        result, lines = await attack(runner, """
import ctypes, signal, time
libc = ctypes.CDLL(None, use_errno=True)
for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(number, signal.SIG_IGN)
print(libc.prctl(1, 0, 0, 0, 0))  # PR_SET_PDEATHSIG 0: no signal when the parent dies
print(attempt(os.setsid), attempt(lambda: os.setpgid(0, 0)))

def escape():  # the grandchild leaves the session and clears its death signal too
    if os.fork() == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                libc.prctl(1, 0, 0, 0, 0)
                time.sleep(1000)
        finally:
            os._exit(0)
    os.wait()
    return "forked"
print(attempt(escape), flush=True)
time.sleep(1000)
""")
        assert result.error == "wall_time", result.stderr
        # the code leaves bubblewrap's session (and so its process group): no help
        assert lines == ["0", "allowed None EPERM", _refused(sandbox, "allowed 'forked'")]
        assert orphans.left_behind() == []


SHM_MARKER = b"host-secret"
IPC_CREAT, IPC_EXCL, IPC_RMID, IPC_STAT = 0o1000, 0o2000, 0, 2


def _sysv_keys() -> set[int]:
    keys = set()
    for kind in ("shm", "sem", "msg"):
        with open(f"/proc/sysvipc/{kind}") as table:
            keys.update(int(line.split()[0]) for line in list(table)[1:])
    return keys


async def test_host_sysv_ipc_is_out_of_reach_and_nothing_is_left_behind(sandbox):
    """A host shared-memory segment, semaphore set and message queue (by key and by id) are
    not there for the code; what the code creates dies with its IPC namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    key = random.randrange(1 << 20, 1 << 30)
    shm_id = libc.shmget(key, 4096, IPC_CREAT | IPC_EXCL | 0o600)
    sem_id = libc.semget(key, 1, IPC_CREAT | IPC_EXCL | 0o600)
    msg_id = libc.msgget(key, IPC_CREAT | IPC_EXCL | 0o600)
    assert min(shm_id, sem_id, msg_id) >= 0
    try:
        address = libc.shmat(shm_id, None, 0)
        ctypes.memmove(address, SHM_MARKER, len(SHM_MARKER))
        libc.shmdt(ctypes.c_void_p(address))
        result, lines = await attack(sandbox, f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
buffer = ctypes.create_string_buffer(512)
def call(function, *args, failed=-1):
    return errno.errorcode[ctypes.get_errno()] if function(*args) == failed else "allowed"
print(call(libc.shmget, {key}, 0, 0), call(libc.shmat, {shm_id}, None, 0, failed=2**64 - 1),
      call(libc.shmctl, {shm_id}, {IPC_STAT}, buffer))
print(call(libc.semget, {key}, 0, 0), call(libc.semctl, {sem_id}, 0, 12))  # GETVAL
print(call(libc.msgget, {key}, 0), call(libc.msgctl, {msg_id}, {IPC_STAT}, buffer))
left = {key + 1}  # leftovers, if the host saw them
print(call(libc.shmget, left, 1 << 20, {IPC_CREAT | 0o600}),
      call(libc.semget, left, 1, {IPC_CREAT | 0o600}), call(libc.msgget, left, {IPC_CREAT | 0o600}))
""")
        assert result.ok, result.stderr
        if sandbox.seccomp:
            assert lines == ["EPERM EPERM EPERM", "EPERM EPERM", "EPERM EPERM",
                             "EPERM EPERM EPERM"]
        else:  # a fresh IPC namespace: no such key or id; its own objects die with it
            assert lines == ["ENOENT EINVAL EINVAL", "ENOENT EINVAL", "ENOENT EINVAL",
                             "allowed allowed allowed"]
        assert key + 1 not in _sysv_keys()
        address = libc.shmat(shm_id, None, 0)
        assert ctypes.string_at(address, len(SHM_MARKER)) == SHM_MARKER
        libc.shmdt(ctypes.c_void_p(address))
    finally:
        libc.shmctl(shm_id, IPC_RMID, None)
        libc.semctl(sem_id, 0, IPC_RMID)
        libc.msgctl(msg_id, IPC_RMID, None)


def _metadata(path: str) -> tuple:
    status = os.stat(path)
    try:
        attributes = tuple(os.listxattr(path))
    except OSError:
        attributes = ()
    return (status.st_mode, status.st_uid, status.st_gid, status.st_size, status.st_mtime_ns,
            attributes)


async def test_host_file_metadata_cannot_change(sandbox):
    """chmod, utime, setxattr, chown and truncate: a host file outside the view is not there,
    and a runtime file in the view sits on a read-only bind (EROFS), root in the sandbox or
    not. Applied to the view's file the calls would change nothing even if they passed."""
    hidden = HOST_DIR / f".escape-metadata-{uuid.uuid4().hex}"
    hidden.write_text("x")
    runtime_file = os.__file__  # the stdlib's os.py: the same path inside and out
    before = [_metadata(str(hidden)), _metadata(runtime_file)]
    try:
        result, lines = await attack(sandbox, f"""
for path in ({str(hidden)!r}, os.__file__):
    mode, times, owner, size = 0o777, (0, 0), (1234, 1234), 0  # for the file it cannot see
    if os.path.exists(path):
        st = os.stat(path)
        mode, times, owner, size = (st.st_mode & 0o7777, (st.st_atime_ns, st.st_mtime_ns),
                                    (st.st_uid, st.st_gid), st.st_size)
    print(attempt(lambda: os.chmod(path, mode)), attempt(lambda: os.utime(path, ns=times)),
          attempt(lambda: os.setxattr(path, "user.tandem", b"x")),
          attempt(lambda: os.chown(path, *owner)), attempt(lambda: os.truncate(path, size)))
""")
        after = [_metadata(str(hidden)), _metadata(runtime_file)]
    finally:
        hidden.unlink()
    assert result.ok, result.stderr
    # the sandbox's own uid (host root started it) owns nothing: truncate's permission check
    # (EACCES) comes before the read-only one
    truncate = "EACCES" if sandbox.command.host_root else "EROFS"
    assert lines == [" ".join(["ENOENT"] * 5), " ".join(["EROFS"] * 4 + [truncate])]
    assert after == before


async def test_host_unix_sockets_are_unreachable(sandbox, tmp_path):
    """A stream and a datagram socket in a host folder the test controls, and an abstract
    one: not visible (mount namespace) or not the same namespace (network namespace)."""
    stream_path, datagram_path = str(tmp_path / "host.sock"), str(tmp_path / "host-dgram.sock")
    abstract = f"\0tandem-escape-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stream, \
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as datagram, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hidden:
        stream.bind(stream_path)
        stream.listen(8)
        datagram.bind(datagram_path)
        hidden.bind(abstract)
        hidden.listen(8)
        result, lines = await attack(sandbox, f"""
import socket
print(os.path.exists({stream_path!r}), os.path.exists({datagram_path!r}))
print(attempt(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect({stream_path!r})))
print(attempt(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"x", {datagram_path!r})))
print(attempt(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect({abstract!r})))
""")
        assert result.ok, result.stderr
        assert lines == ["False False", _refused(sandbox, "ENOENT"), _refused(sandbox, "ENOENT"),
                         _refused(sandbox, "ECONNREFUSED")]
        assert all(_nothing_arrived(listener) for listener in (stream, datagram, hidden))


def _toward_view(path: str, view: tuple[str, ...]) -> set[str] | None:
    """The names a stub folder on the way to the view's paths holds; None if it is not one."""
    names = {os.path.relpath(target, path).split(os.sep)[0] for target in
             (*view, SANDBOX_DIR, "/dev/null") if target.startswith(os.path.join(path, ""))}
    return names or None


async def test_host_paths_cannot_even_be_stat(sandbox, tmp_path):
    """Nothing outside the view exists for the code: the test's own tmp dir, /root, /etc/shadow,
    /proc, the checkout. The folders leading to the view's paths are empty stand-ins made by
    bubblewrap, not the host's (another inode, holding only the way to the view)."""
    paths = [str(tmp_path), "/root", "/etc", "/etc/shadow", "/home", "/proc/1", "/sys/kernel",
             "/run", "/tmp", "/dev/shm", "/var", str(HOST_DIR), str(HOST_DIR.parents[1])]
    result, lines = await attack(sandbox, f"""
seen = {{}}
for path in {paths!r}:
    try:
        st = os.lstat(path)
        seen[path] = [st.st_dev, st.st_ino, sorted(os.listdir(path))]
    except OSError as error:
        seen[path] = errno.errorcode[error.errno]
print(json.dumps(seen))
""")
    assert result.ok, result.stderr
    for path, seen in json.loads(lines[0]).items():
        if seen == "ENOENT":
            continue
        stand_in = _toward_view(path, sandbox.view)
        assert stand_in is not None, f"{path} is visible in the sandbox: {seen}"
        host = os.lstat(path)
        assert (seen[0], seen[1]) != (host.st_dev, host.st_ino) and set(seen[2]) == stand_in
    assert json.loads(lines[0])["/etc/shadow"] == "ENOENT"


async def test_no_host_filesystem_can_be_filled(sandbox):
    """The only writable place is the private tmpfs, capped at work_bytes (ENOSPC); the root,
    /dev, the bootstrap and the runtime are read-only binds; host /tmp and /dev/shm are not
    there; memfd (memory outside every limit) is refused by seccomp."""
    marker = f"fill-{uuid.uuid4().hex}"
    runner = sandbox_with("seccomp" if sandbox.seccomp else "namespaces",
                          SandboxLimits(wall_seconds=8.0, work_bytes=8 << 20))
    result, lines = await attack(runner, f"""
total, last = 0, "none"
for n in range(64):
    try:
        with open("{marker}-" + str(n), "wb") as handle:
            handle.write(b"x" * (1 << 20))
        total += 1 << 20
    except OSError as error:
        last = errno.errorcode[error.errno]
        break
print(total <= 8 << 20, last)
folders = ["/", "/dev", "{SANDBOX_DIR}", "{SANDBOX_DIR}/boot", os.path.dirname(os.__file__),
           sys.prefix, "/tmp", "/dev/shm", "/var/tmp"]
print(json.dumps([attempt(lambda: open(os.path.join(f, "{marker}"), "wb").close()) for f in folders]))
print(attempt(lambda: os.memfd_create("fill") and "a memfd"))
""")
    assert result.ok, result.stderr
    assert lines[0] == "True ENOSPC"
    assert set(json.loads(lines[1])) <= {"EROFS", "ENOENT", "EACCES"}  # EACCES: not its folder
    if sandbox.seccomp:
        assert lines[2] == "EPERM"
    for folder in (tempfile.gettempdir(), "/", "/dev/shm", "/var/tmp"):
        assert not [name for name in os.listdir(folder) if name.startswith(marker)]


async def test_signals_reach_no_host_process(sandbox):
    """The code may signal itself; a host process it was told the pid of, the test runner,
    its parent, its process group and -1 leave every host process untouched."""
    victim = subprocess.Popen(["sleep", "60"])
    try:
        result, lines = await attack(sandbox, f"""
import signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # kill(0) and kill(-1) would reach the code too
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
    # without seccomp: host pids do not exist in the PID namespace; its PID 1 is bubblewrap's
    # init (which ignores the signal), the group is the code alone, and -1 finds no one else;
    # as the sandbox's own uid (host root started it) its parent, that init, is not its own
    group = "EPERM" if sandbox.command.host_root else "allowed None"
    assert lines == ["allowed None True"] + [_refused(sandbox, "ESRCH")] * 2 \
        + [_refused(sandbox, group), _refused(sandbox, "allowed None"), _refused(sandbox, "ESRCH")]


async def test_host_files_outside_the_view_are_unreadable(sandbox):
    secret = HOST_DIR / f".escape-secret-{uuid.uuid4().hex}"
    secret.write_text("hunter2")
    try:
        result, lines = await attack(sandbox, f"""
for path in ("/etc/passwd", "/etc/shadow", {str(secret)!r}, "/usr/lib/../../etc/passwd",
             "/proc/self/environ"):
    print(attempt(lambda: open(path).read()))
os.symlink({str(secret)!r}, "link")
print(attempt(lambda: open("link").read()))
print(json.dumps(sorted(os.listdir("/"))))
""")
    finally:
        secret.unlink()
    assert result.ok, result.stderr
    assert lines[:6] == ["ENOENT"] * 6 and "hunter2" not in result.stdout
    assert set(json.loads(lines[6])) == _toward_view("/", sandbox.view)


@pytest.mark.skipif(os.geteuid() != 0, reason="the host-root case: run as root, as CI does")
async def test_root_only_files_in_the_view_are_unreadable_and_the_code_owns_nothing(sandbox):
    """Started by root, the code runs as a sandbox uid of its own, not as host root mapped
    into a user namespace: a root-only (0600) file inside the read-only view cannot be read,
    no capability can be regained, and each run has another uid (its own per-user limits)."""
    folder = next((path for path in sandbox.view if os.path.isdir(path)
                   and path.startswith("/usr/")), None)
    assert folder is not None, sandbox.view
    canary = Path(folder) / f".escape-canary-{uuid.uuid4().hex}"
    canary.write_text("root-only")
    canary.chmod(0o600)
    try:
        result, lines = await attack(sandbox, f"""
print(attempt(lambda: open({str(canary)!r}).read()))
print(os.getuid(), os.getgid(), os.getgroups())
print(attempt(lambda: os.setuid(0)), attempt(lambda: os.setgroups([0])),
      attempt(lambda: os.chown({str(canary)!r}, os.getuid(), -1)))
""")
        second, _ = await attack(sandbox, "print(os.getuid())")
    finally:
        canary.unlink()
    assert result.ok, result.stderr
    uid = int(lines[1].split()[0])
    assert lines[0] == "EACCES" and "root-only" not in result.stdout
    assert lines[1] == f"{uid} {uid} []" and uid >= SANDBOX_UID_BASE
    assert lines[2] == "EPERM EPERM EROFS"  # chown: the read-only view answers first
    assert int(second.stdout.split()[-1]) != uid  # the next run: another uid


async def test_file_event_watches_are_refused_or_the_sandboxes_own(sandbox):
    """inotify on the view would report the host's reads of the same files, and its instances
    count per user: seccomp refuses inotify and fanotify; without it the instances count against
    the run's own uid (host root started it) or the host user's own limit, never root's."""
    result, lines = await attack(sandbox, """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def call(function, *args):
    value = function(*args)
    return errno.errorcode[ctypes.get_errno()] if value < 0 else "allowed"
print(call(libc.inotify_init1, 0), call(libc.fanotify_init, 0, 0), os.getuid())
""")
    assert result.ok, result.stderr
    inotify, fanotify, uid = lines[0].split()
    if sandbox.seccomp:
        assert (inotify, fanotify) == ("EPERM", "EPERM")
    else:  # fanotify needs CAP_SYS_ADMIN, which the code does not have
        assert (inotify, fanotify) == ("allowed", "EPERM")
    assert int(uid) != 0 if os.geteuid() == 0 else int(uid) == os.geteuid()


async def test_no_network_to_the_host_or_beyond(sandbox):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        result, lines = await attack(sandbox, f"""
import socket
print(attempt(lambda: socket.create_connection(("127.0.0.1", {port}), 2)))
print(attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("8.8.8.8", 53))))
""")
        assert result.ok, result.stderr
        # without seccomp: the network namespace's own loopback, and no route anywhere else
        assert lines == [_refused(sandbox, "ECONNREFUSED"), _refused(sandbox, "ENETUNREACH")]
        assert _nothing_arrived(listener)


def test_the_stand_in_rule_knows_the_view():
    view = ("/root/.pyenv/versions/3.11.7/lib/python3.11", "/usr/lib")
    assert _toward_view("/root", view) == {".pyenv"}
    assert _toward_view("/", view) == {"root", "usr", "sandbox", "dev"}
    assert _toward_view("/etc", view) is None
