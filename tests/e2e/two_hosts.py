"""Two simulated hosts that share nothing a real pair would not: two network namespaces joined
by a veth pair (addresses only inside them), each with its own mount namespace and a private
tmpfs on /dev/shm, a Ray head in A and a Ray node in B (FACTS.md, "Two simulated hosts").

`TwoHosts` makes them (as root), runs a command on host A (`run_on_a`), and removes every
namespace, link, mount and process it made on close. Names carry "fleet" and this process's id.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SUBNET = "198.18"  # the benchmark range (RFC 2544): used only inside the namespaces made here


def why_not_available() -> str | None:
    """Why two namespaced hosts cannot be made here (not root, no ip/unshare/nsenter), else None."""
    if os.geteuid() != 0:
        return "needs root (network and mount namespaces); CI runs as root"
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (iproute2 / util-linux)"
    probe = f"fleetprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


class TwoHosts:
    """Hosts A (Ray head, the driver) and B (a Ray node), each with `cpus` CPUs for Ray."""

    def __init__(self, work_dir: Path, cpus: int = 1) -> None:
        tag = f"{os.getpid() % 100000}"
        self.names = {"A": f"fleetA{tag}", "B": f"fleetB{tag}"}
        self.links = {"A": f"vfa{tag}", "B": f"vfb{tag}"}
        octet = os.getpid() % 250 + 1
        self.ips = {"A": f"{SUBNET}.{octet}.1", "B": f"{SUBNET}.{octet}.2"}
        self.work_dir = work_dir
        self.cpus = cpus
        self.port = 6379
        self.shells: dict[str, subprocess.Popen] = {}
        self.logs = {side: work_dir / f"host_{side}.log" for side in "AB"}
        # short: Ray's socket paths have a length limit
        self.temp_dirs = {side: f"/tmp/rf{self.names[side][-6:]}{side}" for side in "AB"}

    def __enter__(self) -> "TwoHosts":
        try:
            self._make_network()
            self._start_host("A", ["ray", "start", "--head", f"--node-ip-address={self.ips['A']}",
                                   f"--port={self.port}", "--include-dashboard=false"])
            self._start_host("B", ["ray", "start", f"--address={self.ips['A']}:{self.port}",
                                   f"--node-ip-address={self.ips['B']}"])
            self._wait_for_nodes(2)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def _make_network(self) -> None:
        for side in "AB":
            self._ip("netns", "add", self.names[side])
        self._ip("link", "add", self.links["A"], "type", "veth", "peer", "name", self.links["B"])
        for side in "AB":
            name, link = self.names[side], self.links[side]
            self._ip("link", "set", link, "netns", name)
            self._ip("-n", name, "addr", "add", f"{self.ips[side]}/24", "dev", link)
            self._ip("-n", name, "link", "set", link, "up")
            self._ip("-n", name, "link", "set", "lo", "up")

    def _start_host(self, side: str, ray_start: list[str]) -> None:
        """A shell in the host's namespaces: private /dev/shm, its Ray process, then it waits
        (its pid is the handle `nsenter` uses to run more on this host)."""
        ray = Path(sys.executable).with_name("ray")
        temp = self.temp_dirs[side]
        start = [str(ray), *ray_start[1:], f"--num-cpus={self.cpus}", "--num-gpus=0",
                 "--object-store-memory=100000000", "--disable-usage-stats"]
        start.append(f"--temp-dir={temp}")
        script = (f"mount -t tmpfs -o size=1g tmpfs /dev/shm && "
                  f"RAY_worker_niceness=0 RAY_AUTH_MODE=disabled {' '.join(start)} >> {self.logs[side]} 2>&1 && "
                  f"echo started >> {self.logs[side]} && exec sleep 100000")
        self.shells[side] = subprocess.Popen(
            ["ip", "netns", "exec", self.names[side], "unshare", "--mount", "--propagation",
             "private", "sh", "-c", script], start_new_session=True)
        deadline = time.monotonic() + 180
        while "started" not in self.logs[side].read_text(errors="replace") \
                if self.logs[side].exists() else True:
            if self.shells[side].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"host {side}: ray start failed: "
                                   f"{self.logs[side].read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)

    def on(self, side: str, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run a command on a host (its network and mount namespaces); Ray's token
        authentication is off for this private pair, as for its Ray processes."""
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", **kwargs.pop("env", {})}
        return subprocess.run(["nsenter", "-t", str(self.shells[side].pid), "-n", "-m", *command],
                              env=env, **kwargs)

    def _wait_for_nodes(self, count: int) -> None:
        ray = Path(sys.executable).with_name("ray")
        deadline = time.monotonic() + 120
        while True:
            done = self.on("A", [str(ray), "status", f"--address={self.ips['A']}:{self.port}"],
                           capture_output=True, text=True)
            if done.stdout.count("node_") >= count:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} Ray nodes did not come up: {done.stdout[-2000:]}")
            time.sleep(1)

    @property
    def address(self) -> str:
        """The Ray cluster's address, as seen from host A."""
        return f"{self.ips['A']}:{self.port}"

    def processes(self, side: str) -> list[int]:
        """Every process running on a host: those in its shell's mount namespace (never another
        engineer's: `ray stop` would end every Ray process of the machine)."""
        shell = self.shells[side]
        try:
            namespace = os.readlink(f"/proc/{shell.pid}/ns/mnt")
        except OSError:
            return []
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != shell.pid:
                try:
                    if os.readlink(f"/proc/{entry}/ns/mnt") == namespace:
                        pids.append(int(entry))
                except OSError:
                    continue
        return pids

    def close(self) -> None:
        """End every process of both hosts, then remove the namespaces (and with them the veth
        pair and the private mounts)."""
        for side in "BA":
            shell = self.shells.get(side)
            if shell is None or shell.poll() is not None:
                continue
            for pid in self.processes(side):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shell.kill()
            shell.wait()
        for side in "AB":
            subprocess.run(["ip", "netns", "delete", self.names[side]], capture_output=True)
        subprocess.run(["ip", "link", "delete", self.links["A"]], capture_output=True)
        for directory in self.temp_dirs.values():
            shutil.rmtree(directory, ignore_errors=True)
