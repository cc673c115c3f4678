"""Running the Python code the runtime generates (a program's step, a step's blocks): compiled
under a name of its own with its lines kept, so a traceback through it shows them. A leaf of
the runtime: the program and the blocks both use it."""
from __future__ import annotations

import linecache
from typing import Callable

PROGRAM_FILE = "<trtmc program"  # how a generated step's source is named in tracebacks


def run_make(source: str, filename: str, args: list) -> Callable:
    """`make(*args)` of our own generated `source`, its lines kept under `filename` so a
    traceback through the code it makes shows them (`_failing_layer` reads its node comments)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope: dict = {}
    exec(compile(source, filename, "exec"), scope)  # noqa: S102 - our own generated code
    return scope["make"](*args)
