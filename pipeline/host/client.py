"""The side that starts a kernel host and talks to it: a gate (the judge) or a production run.

This side never loads the kernel's library. It starts `python -m pipeline.host` in `/` with an
allow-listed environment, a scratch folder as TMPDIR and only its channel, sends requests, and
reads each answer as a bounded frame with a deadline while it watches the host's heartbeat: a host
that ends, hangs, stays in one kernel call past its limit, or answers with anything but a frame
is one `KernelAborted`, never a hang or a traceback (pipeline/isolation.py).
"""
from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import isolation, jsonio
from pipeline.bundle import layout
from pipeline.confine import scrubbed_environment
from pipeline.errors import UserError
from pipeline.host import frames

class HostTraceback(Exception):
    """The traceback behind an error a host answered with, as the host formatted it: the cause
    `--debug` shows under the one-line error."""


PIPE_BYTES = 1 << 20  # the channel's pipes (the default most a user may set, fs.pipe-max-size)
HIGH_FD = 64  # where the channel's descriptors wait before the host gets them as 3, 4 and 5


@dataclass(frozen=True)
class HostSpec:
    """What a host opens: a bundle, the binding manifest of its kernels (None: a native host),
    where and how it runs, and the checks it makes of every kernel call (a gate's `shadow`; the
    probability `audit` that a call is drawn and sent back whole; with a shadow,
    runtime.shadow.GATE_AUDIT_RATE unless given)."""
    bundle: Path
    bindings: Path | None
    device: str
    mode: str | None = None
    checkpoint: Path | None = None
    shadow: bool = False
    audit: float = 0.0
    threads: int | None = None

    def __post_init__(self):
        from pipeline.runtime.pipeline import resolve_device
        from pipeline.runtime.shadow import GATE_AUDIT_RATE
        # resolved here, so a host knows before it confines itself whether it compiles for a GPU
        # (and `auto` is one device in every host of a run)
        object.__setattr__(self, "device", str(resolve_device(self.device)))
        for name in ("bundle", "bindings", "checkpoint"):  # the host runs in /: paths absolute
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)).resolve())
        if self.shadow and not self.audit:  # a gate's: every call drawn for the judge too
            object.__setattr__(self, "audit", GATE_AUDIT_RATE)

    def reads(self, libraries: list[Path]) -> list[str]:
        """The files and folders of the run the host reads besides its installation: with
        referenced weights and no `checkpoint`, the checkpoint the bundle's manifest names."""
        checkpoint = self.checkpoint or _recorded_checkpoint(self.bundle)
        paths = [self.bundle, *([self.bindings] if self.bindings else []), *libraries,
                 *([checkpoint] if checkpoint else [])]
        return [str(Path(p).resolve()) for p in paths]


def _recorded_checkpoint(bundle: Path) -> str | None:
    """The checkpoint a weight-referencing bundle was built from (None: weights embedded). An
    unreadable manifest names none here; the host's own opening of the bundle reports it."""
    try:
        return jsonio.read_json(bundle / layout.MANIFEST, "bundle_manifest").get("checkpoint")
    except (UserError, OSError):
        return None


def _cache_folder(device: str, role: str) -> Path:
    """A host's own compile cache: kernel hosts never share one with a native host, so nothing a
    kernel's process writes is compiled code a native run loads."""
    from pipeline.runtime.compiled import compile_cache_dir
    from pipeline.runtime.pipeline import resolve_device
    folder = compile_cache_dir(resolve_device(device))
    return folder.with_name(f"{folder.name}-{role}-host")


def _environment(scratch: Path, cache: Path) -> dict[str, str]:
    """The allow-listed environment, and what every host sets: its scratch as TMPDIR, its own
    compile caches, unbuffered output, OpenBLAS on one thread (a thread started before the host
    confines itself would escape Landlock), and Inductor compiling in the host itself: a compile
    worker it started would find no GPU backend (Triton's helpers are loaded in the host before
    it confines itself, never in a worker; seen on an H100)."""
    return scrubbed_environment(os.environ, {
        "TMPDIR": str(scratch), "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "TRITON_CACHE_DIR": str(cache / "triton"), "PYTHONUNBUFFERED": "1",
        "OPENBLAS_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"})


def _forward(fd: int) -> None:
    """The host's stdout and stderr, copied to ours (a kernel's own prints, the host's errors)."""
    with open(fd, "rb", buffering=0) as log:
        for chunk in iter(lambda: log.read(1 << 16), b""):
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()


class Host:
    """A running kernel host: `request` sends one request and returns its answer."""

    def __init__(self, spec: HostSpec, what: str, limits: isolation.Limits):
        # an answer's bytes, once the first has come, take no longer than a kernel call may
        self.what, self.limits = what, limits
        self.bounds = frames.Bounds(seconds=limits.call_s)
        self.scratch = Path(tempfile.mkdtemp(prefix="trtmc-host-"))
        self.cache = _cache_folder(spec.device, "kernel" if spec.bindings else "native")
        self.cache.mkdir(parents=True, exist_ok=True)
        memfd = os.memfd_create("trtmc-heartbeat")
        os.ftruncate(memfd, isolation.HEARTBEAT_BYTES)
        self._shared = mmap.mmap(memfd, isolation.HEARTBEAT_BYTES)
        values, text = isolation.heartbeat_views(self._shared)
        values[isolation.CALL_LIMIT] = limits.call_s
        values[isolation.LAST_BEAT] = time.monotonic()
        requests_r, self.requests = os.pipe()
        self.answers, answers_w = os.pipe()
        for fd in (self.requests, answers_w):  # fewer, larger writes: a probe call's caches
            with contextlib.suppress(OSError):  # are 64 MB at Qwen3-8B's 16,384 keys
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        log_r, log_w = os.pipe()
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, HIGH_FD) for fd in (requests_r, answers_w, memfd)]
        for fd in (requests_r, answers_w, memfd):
            os.close(fd)

        def child_fds() -> None:
            for target, fd in enumerate(high, start=3):
                os.dup2(fd, target)
            isolation.die_with_parent()
        try:
            with isolation.stop_signals_held():
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "pipeline.host"], cwd="/", stdin=subprocess.DEVNULL,
                    stdout=log_w, stderr=log_w, pass_fds=(3, 4, 5), preexec_fn=child_fds,
                    env=_environment(self.scratch, self.cache))
        except BaseException:  # a stop held back by the start: the host it made ends here
            if hasattr(self, "proc"):
                _kill(self.proc)
            raise
        finally:
            for fd in (*high, log_w):
                os.close(fd)
        self.watch = isolation.Watch(values, text, what, limits, "the kernel host")
        log = threading.Thread(target=_forward, args=(log_r,), daemon=True)
        log.start()
        self.pid: int | None = None
        self._cpu = 0.0  # the highest CPU time read (cpu_seconds)
        # a host nobody closed ends with its client object, or at this process's exit
        self._end = weakref.finalize(self, _shut, self.proc, self.requests, self.answers,
                                     self.scratch, log)

    def send(self, body: dict) -> None:
        try:
            frames.write_frame(self.requests, body)
        except (BrokenPipeError, OSError):
            raise self._ended() from None

    def answer(self) -> dict:
        """The next answer, supervised: a UserError the host raised is raised here."""
        sent = time.monotonic()
        while True:
            if select.select([self.answers], [], [], isolation.POLL_S)[0]:
                try:
                    body = frames.read_frame(self.answers, self.bounds)
                except frames.FrameError as e:
                    raise self.broken(str(e)) from None
                if body.get("kind") == "user_error":
                    raise UserError(str(body.get("message"))[:4000]) from HostTraceback(
                        str(body.get("cause"))[:8000])
                if body.get("kind") == "error":
                    raise RuntimeError(f"{self.what}: the kernel host raised:\n"
                                       f"{str(body.get('message'))[:8000]}")
                if body.get("kind") not in ("ok", "ready"):
                    raise self.broken(f"an answer of kind {body.get('kind')!r}")
                return body
            late = self.watch.overdue()
            if late is None and time.monotonic() - sent > self.limits.stall_s:
                late = self.watch.aborted("stalled", None, f"no answer within "
                                                           f"{self.limits.stall_s:.3g} s; the "
                                                           f"kernel host was killed")
            if late is not None:
                self.kill()
                raise late
            if self.proc.poll() is not None:
                raise self._ended()

    def request(self, kind: str, **body: Any) -> dict:
        self.send({"kind": kind, **body})
        return self.answer()

    def _ended(self) -> isolation.KernelAborted:
        """The host ended without an answer: how, and where it was."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.kill()
        return self.watch.ended(self.proc.returncode)

    def broken(self, why: str) -> isolation.KernelAborted:
        """The channel broke: the host's end if it ended, else it is killed for what it sent."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(0.5)
        if self.proc.returncode is not None:
            return self._ended()
        self.kill()
        return self.watch.aborted("channel", None, f"the kernel host sent what no host sends "
                                                   f"({why}); it was killed")

    def cpu_seconds(self) -> float:
        """CPU time the host (the keeper's one child) has used, every thread, from /proc: each
        live thread's to the nanosecond (`schedstat`), and the threads that ended by the
        process's clock ticks less its live threads' (a trial of a few milliseconds is below a
        tick: ticks alone made a tiny arm read as 0 or 3 cores). A thread that ends moves from
        the one count to the other, which can read a little lower (a trial's CPU time came out
        below zero on an H100), so the clock holds its highest reading: it never steps back."""
        if self.pid is None:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                self.pid = int(f.read().split()[0])
        ticks, precise, live_ticks = _ticks(f"/proc/{self.pid}/stat"), 0.0, 0
        for task in os.listdir(f"/proc/{self.pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that just ended
                with open(f"/proc/{self.pid}/task/{task}/schedstat", "rb") as f:
                    ns = int(f.read().split()[0])
                live_ticks += _ticks(f"/proc/{self.pid}/task/{task}/stat")
                precise += ns / 1e9
        self._cpu = max(self._cpu, precise + max(0, ticks - live_ticks) / os.sysconf("SC_CLK_TCK"))
        return self._cpu

    def kill(self) -> None:
        _kill(self.proc)

    def close(self) -> None:
        """End the host: its channel closes, it exits (or is killed), its scratch goes."""
        self._end()


def _ticks(stat: str) -> int:
    """utime + stime of a /proc stat file, in clock ticks."""
    with open(stat, "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _shut(proc: subprocess.Popen, requests: int, answers: int, scratch: Path,
          log: threading.Thread) -> None:
    with contextlib.suppress(OSError):
        os.close(requests)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    _kill(proc)
    with contextlib.suppress(OSError):
        os.close(answers)
    log.join(5)
    shutil.rmtree(scratch, ignore_errors=True)


def start(spec: HostSpec, libraries: list[Path], *, what: str,
          limits: isolation.Limits = isolation.Limits()) -> tuple[Host, dict]:
    """A host opened on `spec` (`libraries`: the DSOs its manifest names, which it may read) and
    its `ready` answer: the confinement that applied and the kernels it bound."""
    host = Host(spec, what, limits)
    try:
        ready = host.request("open", bundle=str(spec.bundle),
                             bindings=None if spec.bindings is None else str(spec.bindings),
                             device=spec.device, mode=spec.mode,
                             checkpoint=None if spec.checkpoint is None else str(spec.checkpoint),
                             shadow=spec.shadow, audit=spec.audit, threads=spec.threads,
                             read=spec.reads(libraries), scratch=str(host.scratch),
                             cache=str(host.cache))
    except BaseException:
        host.close()
        raise
    return host, ready


@dataclass
class HostedKernel:
    """A kernel bound in a host, as the host reported it; `library_sha256` is checked against the
    bytes this side read (`HostedPipeline`)."""
    binding_id: str
    library: str
    function: str
    library_sha256: str
    abi_sha256: str


@dataclass
class Audited:
    """The host's audit counts over a run, and the calls this side computed again."""
    calls: int = 0
    drawn: int = 0
    over_budget: int = 0
    judged: list = field(default_factory=list)  # one `judge_call` result per drawn call

    @property
    def failed(self) -> list[dict]:
        return [c for c in self.judged if not c["passed"]]
