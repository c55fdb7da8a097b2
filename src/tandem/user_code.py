"""Load the user's own objects (reward functions, tool classes) named in a config entry:
`path/to/file.py:Name` (a file, relative to the working directory) or `package.module:Name`;
every error names the config field and the entry. And call them (call_user_code): off the event
loop, on copies of their arguments, within a deadline that always holds."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import importlib
import importlib.util
import inspect
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Callable


class UserCodeError(ValueError):
    """A config entry does not name a loadable object; the message names the field and the entry."""


def split_entry(entry: str, field: str) -> tuple[str, str]:
    """("file.py" or "package.module", "Name") of an entry "where:Name"."""
    where, sep, name = entry.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise UserCodeError(f"{field}: {entry!r} is not of the form 'path/to/file.py:Name' or "
                            "'package.module:Name'")
    return where, name


def load_module(where: str, field: str, entry: str) -> Any:
    """The module of a file path (ends in .py) or a dotted module name."""
    if not where.endswith(".py"):
        try:
            return importlib.import_module(where)
        except ImportError as error:
            raise UserCodeError(f"{field}: {entry!r}: cannot import module {where!r} ({error}); "
                                "check the name and that it is on PYTHONPATH (or give a .py file "
                                "path)") from None
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise UserCodeError(f"{field}: {entry!r}: no file {path}; give the path of a .py file "
                            "(relative to the working directory) or a module name")
    # one module per file, keyed by its path, so a second lookup reuses the first import
    name = f"tandem_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise UserCodeError(f"{field}: {entry!r}: importing {path} raised "
                            f"{type(error).__name__}: {error}") from error
    return module


def load_object(entry: str, field: str) -> Any:
    """The object an entry names, e.g. load_object("rewards.py:compute_score", "reward.custom_function")."""
    where, name = split_entry(entry, field)
    module = load_module(where, field, entry)
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise UserCodeError(f"{field}: {entry!r}: {where} defines no {name!r} (it defines "
                            f"{', '.join(public) or 'nothing public'})")
    return getattr(module, name)


# ---- calling the user's code ----------------------------------------------------------------
# Rewards and tools run where a deadline always holds (docs/api.md, "Rewards"; docs/agent_loops.md,
# "Tool calls"): a sync function in a daemon thread of its own, a coroutine function on a daemon
# thread's event loop shared by user code. On the deadline the call is abandoned, never joined,
# so neither a stuck thread nor a coroutine that swallows its cancellation holds a session or
# the process's exit; a user loop that does not take the cancellation within RETIRE_SECONDS is
# replaced for later calls (something blocks it, e.g. time.sleep in a coroutine).

RETIRE_SECONDS = 1.0
SYNC_THREADS = 32  # sync user calls running at once per event loop; more wait for a thread


class UserCodeFailed(RuntimeError):
    """User code raised what would end the run (SystemExit, KeyboardInterrupt, CancelledError,
    GeneratorExit...); the caller fails that one sample."""


class UserCodeTimeout(TimeoutError):
    """User code did not return within its deadline; it was abandoned."""


_user_loop: asyncio.AbstractEventLoop | None = None
_user_loop_lock = threading.Lock()
_thread_slots: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = \
    weakref.WeakKeyDictionary()


def _shared_user_loop() -> asyncio.AbstractEventLoop:
    global _user_loop
    with _user_loop_lock:
        if _user_loop is None:
            _user_loop = asyncio.new_event_loop()
            threading.Thread(target=_user_loop.run_forever, name="tandem-user-code",
                             daemon=True).start()
        return _user_loop


def _retire(loop: asyncio.AbstractEventLoop) -> None:
    """Later calls get a fresh loop; this one keeps running what it holds (the other calls on
    it end by themselves or at their deadlines), its daemon thread never joined."""
    global _user_loop
    with _user_loop_lock:
        if _user_loop is loop:
            _user_loop = None


def is_coroutine_function(fn: Any) -> bool:
    """Whether calling fn gives a coroutine (async def functions, partials, async __call__)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


async def _awaited(value: Any) -> Any:
    return await value


async def call_user_code(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
                         *, name: str, timeout: float, field: str) -> Any:
    """fn(*args, **kwargs) on deep copies of the arguments (user code cannot change the rows
    other sessions see), off the caller's event loop, within `timeout` seconds (config `field`).
    An Exception from fn propagates as itself; SystemExit, KeyboardInterrupt, CancelledError and
    the like become UserCodeFailed naming `name`; past the deadline, UserCodeTimeout. A
    cancellation of the caller still cancels it (and is passed on to a coroutine)."""
    kwargs = kwargs or {}
    loop = asyncio.get_running_loop()
    finished = threading.Event()
    if is_coroutine_function(fn):
        user_loop = _shared_user_loop()

        async def run() -> tuple[bool, Any]:
            try:
                copied_args, copied_kwargs = copy.deepcopy((args, kwargs))
                return True, await fn(*copied_args, **copied_kwargs)
            except BaseException as error:  # whatever it raises is the call's outcome
                return False, error
            finally:
                finished.set()

        outcome = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), user_loop))
        slots = None
    else:
        user_loop = None
        outcome = loop.create_future()
        slots = _thread_slots.setdefault(loop, asyncio.Semaphore(SYNC_THREADS))
        await slots.acquire()

        def report(result: tuple[bool, Any]) -> None:
            if not outcome.done():
                outcome.set_result(result)

        def work() -> None:
            try:
                copied_args, copied_kwargs = copy.deepcopy((args, kwargs))
                value = fn(*copied_args, **copied_kwargs)
                if inspect.isawaitable(value):  # a sync callable that returned an awaitable
                    with asyncio.Runner() as runner:
                        value = runner.run(_awaited(value))
                result: tuple[bool, Any] = (True, value)
            except BaseException as error:  # whatever it raises is the call's outcome
                result = (False, error)
            finished.set()
            try:
                loop.call_soon_threadsafe(report, result)
            except RuntimeError:  # the caller's loop has closed: nobody waits any more
                pass

        threading.Thread(target=work, name=f"tandem-user-code:{name}", daemon=True).start()
    try:
        ok, value = await asyncio.wait_for(outcome, timeout)
    except asyncio.TimeoutError:
        if user_loop is not None:  # wait_for cancelled it; a loop that cannot take that is retired
            for _ in range(int(RETIRE_SECONDS / 0.05)):
                if finished.is_set():
                    break
                await asyncio.sleep(0.05)
            else:
                _retire(user_loop)
        raise UserCodeTimeout(f"{name} returned nothing within {field}={timeout:g} s; it was "
                              "abandoned (make it faster, or raise the limit)") from None
    finally:
        if slots is not None:
            slots.release()
    if ok:
        return value
    if isinstance(value, Exception):
        raise value
    raise UserCodeFailed(f"{name} raised {type(value).__name__}{f': {value}' if str(value) else ''}"
                         "; user code fails its sample with an Exception, never "
                         f"{type(value).__name__} (it would end the run)") from None
