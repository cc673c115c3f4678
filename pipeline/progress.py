"""Progress lines on stderr for steps that take more than a few seconds (plan builds, kernel
compiles, probe cases, perf trials), so a long step never looks hung.

Shown when stderr is a terminal, or when asked (`trtmc --progress`, `TRTMC_PROGRESS=1`; `0` turns
it off); stdout, which carries data, is never written. Stdlib only, so every layer may use it:

    with progress.bar(len(cases), "probe") as p:      # `probe  3/36  slot x  4.2s`
        for case in cases:
            ...
            p.update(1, note=case.name)
    with progress.spinner("compiling k.cu"):          # elapsed time while a blocking call runs
        subprocess.run(...)
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time

TERMINAL_INTERVAL = 0.1  # seconds between redraws in place
LOG_INTERVAL = 5.0       # seconds between lines where stderr is a file or pipe
_asked: bool | None = None   # the CLI's --progress; None: decide by the environment and stderr
_drawn: list["Progress"] = []  # the line a terminal currently shows, for `interrupt`


def ask(on: bool | None) -> None:
    """Force progress on (True) or off (False); None restores the default."""
    global _asked
    _asked = on


def enabled() -> bool:
    if _asked is not None:
        return _asked
    env = os.environ.get("TRTMC_PROGRESS")
    if env is not None:
        return env not in ("", "0")
    return sys.stderr.isatty()


def interrupt() -> None:
    """Erase a drawn terminal line before someone else writes to stderr (the log handler); the
    line comes back at its next redraw."""
    if _drawn:
        sys.stderr.write("\r\x1b[K")
        _drawn.clear()


class Progress:
    """One status line: `label  done/total  note  elapsed`. On a terminal it is redrawn in place;
    elsewhere, when asked for, it is a plain line now and then, so logs stay short. The final line
    is always written. `total=None` is a spinner: a thread redraws the elapsed time while the
    caller blocks."""

    def __init__(self, total: int | None, label: str):
        self.total, self.label, self.done, self.note = total, label, 0, ""
        self.on = enabled()
        self.tty = self.on and sys.stderr.isatty()
        self.interval = TERMINAL_INTERVAL if self.tty else LOG_INTERVAL
        self.start = self.last = time.monotonic()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._ticker = None
        if self.on and total is None:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self._draw()

    def _text(self) -> str:
        count = f"  {self.done}/{self.total}" if self.total is not None else ""
        note = f"  {self.note}" if self.note else ""
        return f"{self.label}{count}{note}  {time.monotonic() - self.start:.1f}s"

    def _draw(self, final: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            if not self.on or (not final and now - self.last < self.interval):
                return
            self.last = now
            if self.tty:
                width = shutil.get_terminal_size().columns - 1  # a wrapped line cannot be redrawn
                sys.stderr.write("\r\x1b[K" + self._text()[:width] + ("\n" if final else ""))
                _drawn[:] = [] if final else [self]
            else:
                sys.stderr.write(self._text() + "\n")
            sys.stderr.flush()

    def update(self, n: int = 1, note: str | None = None) -> None:
        """`n` more steps done (0: only a new note); thread-safe."""
        with self._lock:
            self.done += n
            if note is not None:
                self.note = note
            self._draw()

    def close(self, note: str | None = None) -> None:
        """The final line (always printed when progress is on)."""
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()
        if note is not None:
            self.note = note
        self._draw(final=True)
        self.on = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # a run stopped from outside (SIGTERM ends it with SystemExit, Ctrl-C) must not read as a
        # step that failed: a log cut off by a timeout would blame the step it was on
        if exc_type is not None:
            self.close("stopped" if issubclass(exc_type, (SystemExit, KeyboardInterrupt)) else "failed")
        else:
            self.close()


def bar(total: int, label: str) -> Progress:
    return Progress(total, label)


def spinner(label: str) -> Progress:
    return Progress(None, label)
