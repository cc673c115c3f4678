"""`python -m pipeline.flow STAGE SPEC`: one stage of the doit pipeline, in its own process.

doit writes its record of the stages that succeeded only when its run ends: a SIGTERM ends the run
through Python (pipeline/flow/tasks.py: `_stop_run`), so the stages that finished are recorded; a
SIGKILL loses the record. Running each stage in a child process with atomic outputs means a killed
run leaves at worst a stage that re-runs, never a half-written file that looks up to date.
Exit status: 0 done, 1 gate did not pass (its reports are written), 2 user error (one line on
stderr).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from pipeline import isolation, log
from pipeline.errors import UserError
from pipeline.flow.spec import load_spec
from pipeline.flow.stages import BY_NAME, GateNotPassed


# Every stage holds this machine-wide lock shared; a timing stage holds it exclusively, so with
# `doit -n N` no other stage runs while a perf gate measures (and a perf gate waits for them).
# Runs that must not wait on each other (each on a GPU of its own, whose timing the other's
# stages do not disturb) name a lock file of their own in TRTMC_STAGE_LOCK.
LOCK = Path(tempfile.gettempdir()) / "trtmc-stages.lock"
LOCK_ENV = "TRTMC_STAGE_LOCK"


def _lock_path() -> Path:
    return Path(os.environ.get(LOCK_ENV) or LOCK)


def _holders_dir() -> Path:
    """Beside the lock, one note per stage holding it: who, since when."""
    lock = _lock_path()
    return lock.with_name(lock.name + ".holders")


def _holders() -> str:
    """The stages holding the lock now, as their notes say (a note whose process is gone is
    skipped)."""
    notes, folder = [], _holders_dir()
    for note in sorted(folder.glob("*")) if folder.is_dir() else ():
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(note.name), 0)
            notes.append(note.read_text().strip())
    return "; ".join(notes) or "a stage that left no note"


@contextlib.contextmanager
def _stage_lock(exclusive: bool, what: str):
    """Every user of the machine can open the lock (its mode is set past the umask). A stage
    that has to wait says so once, naming who holds the lock and since when."""
    lock = _lock_path()
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    note = _holders_dir() / str(os.getpid())
    try:
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            log.get("stage").info("%s waits for the stage lock %s (%s): held by %s", what, lock,
                                  "a timing stage runs alone" if exclusive else
                                  "a timing stage is running", _holders())
            fcntl.flock(fd, mode)
        with contextlib.suppress(OSError):
            note.parent.mkdir(mode=0o1777, exist_ok=True)
            note.write_text(f"{what} (pid {os.getpid()}) since "
                            f"{time.strftime('%H:%M:%S')}\n")
        yield
    finally:
        with contextlib.suppress(OSError):
            note.unlink()
        os.close(fd)


def _sigterm(signum, frame):
    # one stop is enough: a second SIGTERM (doit's, then the one its exit sends) would cut the
    # unwinding short, before the staged files are removed and a compiler's or exporter's
    # process group is killed
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)  # through Python, so staged files are removed


DOIT_PID = "TRTMC_DOIT_PID"  # set by dodo.py: the process a stage must not outlive


def _die_with_parent() -> None:
    """A SIGTERM (or SIGKILL) to doit alone must stop its stage too: without this, an orphaned
    perf gate would go on timing itself against the re-run. Linux delivers SIGTERM to this
    process when its parent (doit, or under `doit -n N` one of its workers) exits; elsewhere a
    stage outlives a killed doit."""
    doit = int(os.environ.get(DOIT_PID, os.getppid()))
    if not isolation.die_with_parent(signal.SIGTERM):
        return
    parent = os.getppid()
    if doit not in (parent, isolation.parent_of(parent)):  # doit died before the request took effect
        raise SystemExit(128 + int(signal.SIGTERM))


# library parameters a stage's error may name -> the spec's JSON path (build options: $.build.X)
SPEC_FIELDS = {"engine_role": "$.engine_role", "device": "$.gates.device",
               **{f: f"$.selection.{f}" for f in ("binding_id", "workspace_bytes",
                                                  "output_shape_like_input")}}


def _in_spec_terms(e: UserError, spec) -> str:
    """A stage's error after its spec's path, the library parameters it names as the spec's
    JSON paths (`precision` -> `$.build.precision`); a spec that did not load names itself."""
    if spec is None:
        return str(e)
    names = {**SPEC_FIELDS, **{key: f"$.build.{key}" for key in spec.build}}
    text = e.naming(names)
    return text if text.startswith(f"{spec.path}: ") else f"{spec.path}: {text}"


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _sigterm)
    _die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in BY_NAME:
        print(f"usage: python -m pipeline.flow {{{','.join(BY_NAME)}}} SPEC", file=sys.stderr)
        return 2
    log.configure()
    spec = None
    try:
        stage = BY_NAME[argv[0]]
        spec = load_spec(argv[1])
        with _stage_lock(stage.exclusive, f"{argv[0]} {spec.name}"):
            start = time.perf_counter()
            stage.action(spec)
        log.get("stage").info("%s done in %.1f s", argv[0], time.perf_counter() - start)
    except UserError as e:
        print(f"{argv[0]}: error: {_in_spec_terms(e, spec)}", file=sys.stderr)
        if os.environ.get("TRTMC_DEBUG") == "1":  # the cause behind the one line
            traceback.print_exc()
        return 2
    except GateNotPassed:
        return 1
    except RuntimeError as e:  # torch.OutOfMemoryError, raised here or in the kernel host
        said = next((line for line in str(e).splitlines() if "CUDA out of memory" in line), None)
        if said is None:
            raise
        print(f"{argv[0]}: error: {spec.path if spec else argv[1]}: the GPU ran out of memory "
              f"({said.split('. Including')[0].strip()}): a gate holds the model twice, once in "
              f"the judge and once in the kernel host, each with its caches; lower "
              f"build.max_cache_length or use a GPU with more memory", file=sys.stderr)
        if os.environ.get("TRTMC_DEBUG") == "1":
            traceback.print_exc()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
