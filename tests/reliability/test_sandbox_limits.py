"""The sandbox's limits after the stack-walk tamper (sandbox_attack.py): memory, CPU, file size,
open files and wall time cannot be raised or dodged; and its slots: one per run, the wait for
one counted apart from the run's wall time and bounded, so other sessions' sleeping calls never
push a call past the agent loop's tool timeout."""

from __future__ import annotations

import asyncio

import pytest
from sandbox_attack import attack, missing_isolation, sandbox_with

from tandem.tools.python_sandbox import PythonSandbox, SandboxLimits
from tandem.tools.python_tool import PythonTool
from tandem.tools.registry import ToolRegistry

MISSING_ISOLATION = missing_isolation()
pytestmark = pytest.mark.skipif(MISSING_ISOLATION is not None,
                                reason=f"sandbox unavailable: {MISSING_ISOLATION}")
SLEEP_FOREVER = "import time\ntime.sleep(1000)"


async def test_memory_blow_up_stops_at_the_limit():
    result, lines = await attack(sandbox_with("seccomp"), """
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


@pytest.mark.parametrize("ignore_sigxcpu, error", [(False, "cpu_limit"), (True, "killed")])
async def test_infinite_loop_stops_at_the_cpu_limit(ignore_sigxcpu, error):
    """SIGXCPU at the soft limit ends the loop; code that ignores it is SIGKILLed a second
    later at the hard limit. The wall limit is far past both, so a loaded machine still hits
    the CPU limit first."""
    sandbox = sandbox_with("seccomp", SandboxLimits(wall_seconds=300.0, cpu_seconds=1))
    result, lines = await attack(sandbox, f"""
import resource, signal
try:
    resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("raised")
    raise SystemExit(3)
except ValueError as error:
    print(error, flush=True)
if {ignore_sigxcpu}:
    signal.signal(signal.SIGXCPU, signal.SIG_IGN)
while True:
    pass
""")
    assert result.error == error, result.stderr
    assert "CPU time" in result.stderr
    assert lines == ["not allowed to raise maximum limit"]


async def test_file_size_and_open_files_stop_at_their_limits():
    sandbox = sandbox_with("seccomp", SandboxLimits(wall_seconds=8.0, file_bytes=1 << 20,
                                                    open_files=32))
    result, lines = await attack(sandbox, """
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
""")
    assert result.ok, result.stderr
    assert lines == ["not allowed to raise maximum limit", "EFBIG", "True", "EMFILE", "True"]


async def test_sleep_ignoring_signals_stops_at_the_wall_time_limit():
    sandbox = sandbox_with("seccomp", SandboxLimits(wall_seconds=5.0))  # room on a busy box
    result, lines = await attack(sandbox, """
import signal, time
for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(number, signal.SIG_IGN)
print("sleeping", flush=True)
time.sleep(1000)
""")
    assert result.error == "wall_time" and result.exit_code is None
    assert lines == ["sleeping"]
    assert result.duration_s >= 5.0


async def test_the_wait_for_a_slot_is_counted_apart_and_bounded():
    """One slot, held by a sleeping run: a second run waits for it and then gets its own full
    wall time; a third whose wait passes queue_seconds gets a "busy" result and never runs."""
    patient = PythonSandbox(SandboxLimits(wall_seconds=2.0, queue_seconds=60.0), max_concurrent=1)
    holder = asyncio.create_task(patient.run(SLEEP_FOREVER))
    await asyncio.sleep(0)  # the holder takes the slot first
    waiter = asyncio.create_task(patient.run(SLEEP_FOREVER))
    impatient = PythonSandbox(SandboxLimits(queue_seconds=1.0), max_concurrent=1)
    impatient._semaphores = patient._semaphores  # the same slot
    busy = await impatient.run("open('ran', 'w'); print('ran')")
    first, second = await asyncio.gather(holder, waiter)
    assert first.error == second.error == "wall_time"
    assert second.queue_s >= 2.0 and second.duration_s >= 2.0  # waited, then ran its own 2 s
    assert busy.error == "busy" and busy.stdout == "" and busy.queue_s > 0.99
    assert "no sandbox slot was free within 1 s" in busy.stderr


async def test_other_sessions_sleeping_calls_do_not_push_a_call_past_the_tool_timeout():
    """Two sessions send eight sleeping calls each to a two-slot sandbox: queued one after
    another they would hold the slots for 16 s. A third session's call, timed as the agent loop
    times it (asyncio.wait_for around ToolRegistry.call), comes back well inside its 12 s:
    run, or refused as busy after queue_seconds, but never cut off by the tool timeout."""
    tool_timeout = 12.0
    sandbox = PythonSandbox(SandboxLimits(wall_seconds=2.0, queue_seconds=2.0), max_concurrent=2)
    registry = ToolRegistry([PythonTool(sandbox, check=False)])

    async def call(code: str):
        try:
            return await asyncio.wait_for(registry.call("python", {"code": code}), tool_timeout)
        except asyncio.TimeoutError:
            return None

    sleepers = [asyncio.create_task(call(SLEEP_FOREVER)) for _ in range(16)]
    await asyncio.sleep(0)
    third = await call("print(6 * 7)")
    results = await asyncio.gather(*sleepers)
    assert third is not None and (third.text == "42\n" or third.text.startswith("Error (busy)"))
    assert None not in results  # no sleeper ran into the tool timeout either
    assert {result.text.split(":")[0] for result in results} == {"Error (wall_time)",
                                                                "Error (busy)"}
