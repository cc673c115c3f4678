"""One logger tree, `trtmc.<topic>`, printed as `[topic] message` on stderr (never stdout, which
carries data). The CLI and the doit stage processes call `configure`; a program that imports the
library configures logging its own way. TensorRT's own logger follows the same verbosity."""
from __future__ import annotations

import logging
import sys

from pipeline import progress

ROOT = "trtmc"


def get(topic: str) -> logging.Logger:
    return logging.getLogger(f"{ROOT}.{topic}")


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test's capture, a redirected stream)."""

    def __init__(self):
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass

    def emit(self, record):
        progress.interrupt()  # a log line never lands in the middle of a progress line
        super().emit(record)


class _Topic(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        topic = record.name.removeprefix(ROOT + ".") if record.name != ROOT else ROOT
        return f"[{topic}] {record.getMessage()}"


def level(verbosity: int) -> int:
    """-q -> WARNING, default INFO, -v -> DEBUG, -vv -> everything (TensorRT's verbose too)."""
    return (logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else
            logging.DEBUG if verbosity == 1 else logging.DEBUG - 5)


def configure(verbosity: int = 0) -> None:
    root = logging.getLogger(ROOT)
    root.setLevel(level(verbosity))
    if not any(isinstance(h, _Stderr) for h in root.handlers):
        handler = _Stderr()
        handler.setFormatter(_Topic())
        root.addHandler(handler)


def trt_severity_name() -> str:
    """TensorRT logger severity for the current verbosity: errors by default, warnings at -v,
    everything at -vv and beyond (a level below DEBUG)."""
    lvl = logging.getLogger(ROOT).getEffectiveLevel()
    return "ERROR" if lvl > logging.DEBUG else "WARNING" if lvl == logging.DEBUG else "VERBOSE"
