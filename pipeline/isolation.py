"""Work that calls a bound kernel runs in a worker process this process owns.

A kernel is native code: it can call exit(), crash, or never return. Inside a gate that would end
the verdict with it (a stage exiting 0 with no report, or dying by a signal). So the caller here
only supervises: it starts the worker (a fresh interpreter, `spawn`; or, where the caller asks and
it is safe, a fork that starts with the modules the caller has imported), reads a heartbeat the
worker writes to shared memory, and gets the result back through a pipe. A worker that exits
without a result, is killed by a signal, stays inside one kernel call past its time limit, or
shows no progress at all for too long is one `KernelAborted` error naming what happened and where.

Inside the worker, `calling(label)` (or HEARTBEAT.enter/leave) marks a kernel call (the per-call
limit runs while it is open), `beat(where)` marks progress, and `set_call_limit(s)` raises the
per-call limit once the native region's time is known. Outside a worker they cost a check and do
nothing.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any, Callable

import orjson

from pipeline.errors import UserError

# heartbeat slots (doubles): calls started, open call depth, when the open call started, the last
# progress, the per-call limit in seconds, whether the text names a call's label (1) or a phase (0)
CALLS, DEPTH, CALL_START, LAST_BEAT, CALL_LIMIT, LABELLED = range(6)
WHERE_BYTES = 240  # what the worker is doing, as text, for the message
# the most bytes of JSON a worker's result may take: it is read as JSON, never unpickled (the
# worker runs the kernel's code, which could write anything to the pipe)
RESULT_MAX_BYTES = 64 << 20
POLL_S = 0.05
NATIVE_FACTOR = 1000  # a call may take this many times the native region's time, or the floor


@dataclass(frozen=True)
class Limits:
    """A kernel call may last `call_s` (a floor, raised to NATIVE_FACTOR x the native region's
    time once a gate has measured it); the worker may show no progress for `stall_s` (this also
    bounds a GPU kernel that never finishes, which the host sees at the next synchronisation)."""
    call_s: float = 10.0
    stall_s: float = 900.0


class KernelAborted(UserError):
    """The worker ended, was killed, or timed out before it returned a result."""
    exit_status = 1

    def __init__(self, message: str, how: str, status: int | None, where: str):
        super().__init__(message)
        self.how, self.status, self.where = how, status, where


_SIGNALS = {int(s): s.name for s in signal.Signals}


class _Heartbeat:
    """The worker's side of the shared heartbeat. A kernel call costs a few slot writes and one
    clock read (the perf gate times calls through here); its label is copied only when it
    changes."""

    def __init__(self, values, text):
        self.values, self.text, self.label = values, text, None

    def say(self, words: str) -> None:
        self.text.value = words.encode("utf-8", "replace")[:WHERE_BYTES - 1]

    def enter(self, label: str) -> None:
        v = self.values
        if v[DEPTH] == 0:
            v[CALLS] += 1
            if label is not self.label:
                self.say(label)
                self.label, v[LABELLED] = label, 1
            v[CALL_START] = v[LAST_BEAT] = time.monotonic()
        v[DEPTH] += 1

    def leave(self) -> None:
        v = self.values
        v[DEPTH] -= 1
        if v[DEPTH] == 0:
            v[LAST_BEAT] = time.monotonic()


HEARTBEAT: _Heartbeat | None = None  # set in a worker only


def in_worker() -> bool:
    return HEARTBEAT is not None


def beat(where: str | None = None) -> None:
    """Progress; `where` names the phase now under way."""
    if HEARTBEAT is None:
        return
    HEARTBEAT.values[LAST_BEAT] = time.monotonic()
    if where is not None:
        HEARTBEAT.say(where)
        HEARTBEAT.label, HEARTBEAT.values[LABELLED] = None, 0


@contextlib.contextmanager
def calling(label: str):
    """A kernel call: the per-call limit runs while the outermost `calling` is open (a hot
    caller uses HEARTBEAT.enter/leave directly)."""
    if HEARTBEAT is None:
        yield
        return
    HEARTBEAT.enter(label)
    try:
        yield
    finally:
        HEARTBEAT.leave()


def set_call_limit(native_seconds: float, values=None) -> None:
    """Raise the per-call limit to NATIVE_FACTOR x `native_seconds` (never below the floor), in
    this worker's heartbeat or in `values` (a supervisor's view of a host's)."""
    if values is None and HEARTBEAT is not None:
        values = HEARTBEAT.values
    if values is not None:
        values[CALL_LIMIT] = max(values[CALL_LIMIT], NATIVE_FACTOR * native_seconds)


PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
SWEEP_S = 10.0  # the longest `_sweep_children` waits for what it killed to be gone


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(signum: int = signal.SIGKILL) -> bool:
    """Linux sends `signum` to this process when its parent exits; False where that cannot be
    asked (elsewhere a child outlives its parent)."""
    return _prctl(PR_SET_PDEATHSIG, int(signum))


def parent_of(pid: int) -> int | None:
    """The parent pid of process `pid` (Linux /proc), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])  # the field after the state
    except (OSError, ValueError, IndexError):
        return None


def _children() -> set[int]:
    """Pids of this process's running children (Linux /proc; empty elsewhere), zombies included
    (they are reaped by the caller)."""
    me = os.getpid()
    with contextlib.suppress(OSError):
        return {int(e.name) for e in os.scandir("/proc")
                if e.name.isdigit() and parent_of(int(e.name)) == me}
    return set()


def _sweep_children(keep: set[int]) -> None:
    """Kill and reap every child of this process but `keep`: with this process a child subreaper,
    those are what a worker's kernel started and left behind (a process that forked, even one
    that called setsid(), is handed here when its parent dies), so nothing it started outlives
    the work it was part of. Processes that fork as they are killed are swept again; one stuck in the
    kernel (an uninterruptible driver call) is left to die after SWEEP_S rather than waited for."""
    deadline = time.monotonic() + SWEEP_S
    while time.monotonic() < deadline:
        left = _children() - keep
        if not left:
            return
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in left:
            with contextlib.suppress(OSError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.01)


@contextlib.contextmanager
def stop_signals_held():
    """SIGTERM and SIGINT held back while a process forks: a handler run during a fork runs in
    an at-fork hook, which drops the handler's SystemExit, so a caller told to stop would finish
    its work. Held back, the signal reaches the caller after the fork, and the child not."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def started_with_stop_signals_held(start: Callable[[set[int | signal.Signals]], int]
                                   ) -> tuple[int, set[int | signal.Signals]]:
    """`start(mask)`'s child pid (os.fork, or a spawn that gives its child `mask`), started with
    SIGTERM and SIGINT held back (as in `stop_signals_held`), and the mask that lets them through
    again. The caller restores it inside the guard that stops the child, so a stop that came
    during the start stops the child too; a forked child restores it inside the guard that ends
    it without returning into its parent's code."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return start(held), held
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        raise


def _quiet_crashes() -> None:
    """tvm-ffi prints a native backtrace of its own on SIGSEGV (a handler installed when it
    loads); a crash in the worker is the supervisor's one line, so the default action is back."""
    try:
        import tvm_ffi  # noqa: F401 - its constructor installs the handler
    except ImportError:
        return
    signal.signal(signal.SIGSEGV, signal.SIG_DFL)


def _worker(conn, values, text, fn: Callable, args: tuple, parent: int) -> None:
    global HEARTBEAT
    if die_with_parent() and os.getppid() != parent:
        os._exit(1)  # the caller died before the request held (a spawned worker imports first)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker has its caller's handlers
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # held back by stop_signals_held
    HEARTBEAT = _Heartbeat(values, text)
    beat("starting")
    _quiet_crashes()
    os.environ.pop("TRTMC_DOIT_PID", None)  # a gate's worker looks like a run's to the kernel
    try:
        result = _json(("ok", fn(*args)))
    except UserError as e:
        result = _json(("user_error", (str(e), e.param and str(e.param),
                                       [str(m) for m in e.mentions])))
    except BaseException:  # noqa: BLE001 - sent whole to the supervisor, which re-raises it
        result = _json(("error", traceback.format_exc()))
    conn.send_bytes(result)
    conn.close()


def _json(result: tuple) -> bytes:
    return orjson.dumps(result, option=orjson.OPT_SERIALIZE_NUMPY)


def fork_is_safe() -> bool:
    """A worker may be forked from this process: Linux, one Python thread (another could hold a
    lock the child needs), and no CUDA context (a forked child cannot use its parent's): torch's
    not initialised, and no CUDA driver loaded by anything else."""
    if sys.platform != "linux" or threading.active_count() != 1:
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    try:
        with open("/proc/self/maps") as f:
            return "libcuda.so" not in f.read()
    except OSError:
        return False


def run_isolated(fn: Callable, *args, what: str, limits: Limits = Limits(),
                 fork: bool = False) -> Any:
    """`fn(*args)` in a worker process; its return value, as JSON gives it back (`fn` and its
    arguments must pickle; its result must be JSON, tuples come back as lists). A UserError in the
    worker is raised here as one; anything that ends the worker without a result is
    KernelAborted, whose message starts with `what`. `fork`: fork the worker where
    `fork_is_safe()` (it then skips importing what this process has imported), else spawn it."""
    ctx = multiprocessing.get_context("fork" if fork and fork_is_safe() else "spawn")
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # what the worker's kernel starts is handed here at the end
    values = ctx.RawArray(ctypes.c_double, LABELLED + 1)
    text = ctx.RawArray(ctypes.c_char, WHERE_BYTES)
    values[CALL_LIMIT], values[LAST_BEAT] = limits.call_s, time.monotonic()
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(  # type: ignore[attr-defined]  # a fork or spawn context has Process
        target=_worker, args=(send, values, text, fn, args, os.getpid()), daemon=True)
    t0 = time.monotonic()
    before = _children()
    try:
        with stop_signals_held():  # a stop held back by the start is raised inside this guard
            proc.start()
        send.close()
        result = _supervise(proc, receive, values, text, what, limits, t0)
    finally:
        if proc.pid is not None:  # it started
            if proc.is_alive():
                proc.kill()
            proc.join()
        _sweep_children(before | _tracker())
    kind, value = _result(result, what)
    if kind == "ok":
        return value
    if kind == "user_error":
        message, param, mentions = value
        raise UserError(message, param=param, mentions=mentions)
    raise RuntimeError(f"{what}: the worker raised:\n{value}")


def _result(data: bytes, what: str) -> tuple[str, Any]:
    """(kind, value) from a worker's result bytes; anything else is the worker's error."""
    try:
        kind, value = orjson.loads(data)
    except (orjson.JSONDecodeError, TypeError, ValueError):
        kind, value = None, None
    if kind not in ("ok", "user_error", "error"):
        raise RuntimeError(f"{what}: the worker's result is not one it sends ({len(data)} bytes)")
    return kind, value


def _tracker() -> set[int]:
    """multiprocessing's resource tracker, a child a spawning process keeps for later workers."""
    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return {pid} if pid else set()


class Watch:
    """The supervisor's reading of a heartbeat: a kernel call past its limit, a worker without
    progress for `limits.stall_s`, or an end before a result, each one KernelAborted whose
    message starts with `what` and says where the worker was."""

    def __init__(self, values, text, what: str, limits: Limits, who: str = "the worker"):
        self.values, self.text, self.what, self.limits, self.who = values, text, what, limits, who
        self.t0 = time.monotonic()

    def aborted(self, how: str, status: int | None, detail: str) -> KernelAborted:
        where = self.text.value.decode("utf-8", "replace") or "starting"
        if self.values[LABELLED]:
            where = f"call {int(self.values[CALLS])} of {where}"
        return KernelAborted(f"{self.what}: {detail} (while at {where}, "
                             f"{time.monotonic() - self.t0:.1f} s in)", how, status, where)

    def overdue(self) -> KernelAborted | None:
        """What is overdue now (the caller kills the worker), or None."""
        v, now = self.values, time.monotonic()
        if v[DEPTH] > 0 and now - v[CALL_START] > v[CALL_LIMIT]:
            return self.aborted("timeout", None, f"a kernel call did not return within "
                                                 f"{v[CALL_LIMIT]:.3g} s; {self.who} was killed")
        if now - v[LAST_BEAT] > self.limits.stall_s:
            return self.aborted("stalled", None, f"no progress for {self.limits.stall_s:.3g} s; "
                                                 f"{self.who} was killed")
        return None

    def ended(self, code: int | None) -> KernelAborted:
        """The worker ended (exit status `code`, negative for a signal) with no result."""
        if code is not None and code < 0:
            name = _SIGNALS.get(-code, f"signal {-code}")
            return self.aborted("signal", -code, f"{self.who} was killed by {name}")
        return self.aborted("exit", code, f"{self.who} exited with status {code} before its work "
                                          f"ended (a kernel or library called exit?)")


# the heartbeat as one shared buffer (a host maps it from a memfd): the slots, then the text
HEARTBEAT_BYTES = 8 * (LABELLED + 1) + WHERE_BYTES


def heartbeat_views(buffer) -> tuple:
    """(slots, text) over a writable buffer of HEARTBEAT_BYTES."""
    values = (ctypes.c_double * (LABELLED + 1)).from_buffer(buffer)
    text = (ctypes.c_char * WHERE_BYTES).from_buffer(buffer, 8 * (LABELLED + 1))
    return values, text


def _supervise(proc, receive, values, text, what: str, limits: Limits, t0: float):
    watch = Watch(values, text, what, limits)
    watch.t0 = t0
    while True:
        if receive.poll(POLL_S):  # a result, or the end of the pipe: the worker is gone
            try:
                return receive.recv_bytes(RESULT_MAX_BYTES)
            except OSError as e:
                if "bad message length" in str(e):  # past the limit: none of it was read
                    raise RuntimeError(f"{what}: the worker's result is longer than "
                                       f"{RESULT_MAX_BYTES} bytes (pipeline.isolation."
                                       f"RESULT_MAX_BYTES)") from e
            except EOFError:
                pass
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
            raise watch.ended(proc.exitcode)
        late = watch.overdue()
        if late is not None:
            proc.kill()
            raise late
