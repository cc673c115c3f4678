"""doit tasks generated from the one stage table (pipeline/flow/stages.py), and the runner that
runs them through doit's API (`trtmc pipeline`, `trtmc matrix`).

Each task has file_dep, targets and ONE config_changed holding the stage's spec options and its
version; a stage whose output depends on the machine holds what it depends on there too
(pipeline/gates/environment.py), so a cache restored on another machine re-runs those stages.
Directory bundles are tracked through their manifest.json, written last. A model folder is
identified by revision plus each file's name, size and content digest (hashed once per machine,
pipeline/flow/spec.py: model_identity), so a restored cache holds on another machine. The action is a
child process, so a killed doit loses nothing but the record of that run: forked from doit's
process, which imports each stage's heavy modules (torch) once for all its stages, or where that
is not safe a fresh interpreter (`python -m pipeline.flow`).

Two ways in, one set of tasks (`StageTasks`, a doit task creator through `create_doit_tasks`):
the repository's `dodo.py` (`doit`, `doit spec=A.json,B.json`: one doit database,
`artifacts/.doit.db`) and `run_pipeline` (one doit run per spec, its database
`OUTPUT/.doit.db` inside the spec's own output folder). doit is imported only when tasks are
made or run.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import pipeline.flow.__main__ as stage_main
from pipeline import files, isolation, progress
from pipeline.errors import UserError
from pipeline.files import hold_lock, keep_bytecode, remove_stale_stages
from pipeline.flow.spec import Spec, load_specs
from pipeline.flow.stages import BY_NAME, STAGES, Stage

DB_FILE = ".doit.db"     # `trtmc pipeline`: the doit database, inside the spec's output folder
LOCK_FILE = ".lock"      # held by the doit run that owns the output folder
DOIT_PID = "TRTMC_DOIT_PID"  # the process a stage must not outlive (pipeline/flow/__main__.py)
MATRIX_WORKER = "TRTMC_MATRIX_WORKER"  # the Ray worker a matrix's pipeline run must not outlive


def prepare_process() -> None:
    """What every doit run of the stages needs in its process: the stages die with this process
    (pipeline/flow/__main__.py reads TRTMC_DOIT_PID), this process dies with the Ray worker that
    started it for a matrix (SIGTERM, so its stages stop too), and progress lines when stderr is
    a terminal (doit pipes a stage's output, so the stage cannot see the terminal itself), and
    Python's bytecode kept where it would not be (`keep_bytecode`)."""
    keep_bytecode()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_run)
    worker = os.environ.pop(MATRIX_WORKER, None)
    if worker is not None:
        if isolation.die_with_parent(signal.SIGTERM) and os.getppid() != int(worker):
            raise SystemExit(128 + int(signal.SIGTERM))  # the worker died before the request held
    os.environ[DOIT_PID] = str(os.getpid())
    if sys.stderr is not None and sys.stderr.isatty():
        os.environ.setdefault("TRTMC_PROGRESS", "1")


def _stop_run(signum, frame):
    """SIGTERM ends a doit run as Ctrl-C does, through Python: the running stage is stopped
    (`_wait_stage`) and doit, which writes its database only as a run ends, still records the
    stages that finished, so a CI job cut by its time limit does not run them again. A second
    SIGTERM is ignored, so that the unwinding completes."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _remove(paths, out: str) -> None:
    """Remove the outputs, then the folders inside the spec's output folder (itself included) that
    they leave empty: `doit clean` leaves no empty kernel/ or reports/ behind."""
    out_dir = Path(out)
    for p in map(Path, paths):
        remove_stale_stages(p)  # what a killed write of p left behind
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
        for parent in p.parents:
            if not parent.is_relative_to(out_dir):
                break
            try:
                parent.rmdir()  # only succeeds on an empty folder
            except OSError:
                break


def _forkable() -> bool:
    """A stage may be forked from this process where `isolation.fork_is_safe()` (Linux, no other
    Python thread, no CUDA context). A Ray worker runs stages as fresh interpreters."""
    return isolation.fork_is_safe() and "ray" not in sys.modules


def _fork_stage(stage: Stage, spec_path: str) -> int | None:
    """The stage in a child forked from this process, which imports the stage's heavy modules
    once (`Stage.preload`) so that each stage does not import them again in a fresh interpreter.
    The child is what `python -m pipeline.flow` would be: its own standard streams, none of this
    process's output-folder locks, and it stops when this process ends (as any stage does,
    pipeline/flow/__main__.py). Its exit status, or minus the signal that killed it; None when
    the imports left this process unsafe to fork (a thread or a CUDA context)."""
    for module in stage.preload:
        with contextlib.suppress(ImportError):  # the stage reports it, as it would unforked
            importlib.import_module(module)
    if not _forkable():
        return None
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    pid, held = isolation.started_with_stop_signals_held(lambda _: os.fork())
    if pid == 0:
        code = 1
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            code = _in_forked_stage(stage_main, stage.name, spec_path)
        finally:
            while True:  # a signal handler may raise here too: the child never returns to doit
                try:
                    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
                    os._exit(code)
                except BaseException:  # noqa: BLE001
                    continue
    return _wait_stage(pid, held)


def _wait_stage(pid: int, held: set[int | signal.Signals]) -> int:
    """The stage's exit status, or minus the signal that killed it; when this run is stopped
    meanwhile, the stage is stopped first (`_stop`). `held`: the signal mask to restore first
    (the stage was started with stops held back), where a stop that came as it started stops it
    too."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        _, status = os.waitpid(pid, 0)
    except BaseException:
        _stop(pid)
        raise
    return os.waitstatus_to_exitcode(status)


STAGE_STOP_S = 10.0  # a stage told to stop has this long to remove its staged files and commands


def _stop(pid: int) -> None:
    """Stop a forked stage as a stage stops on SIGTERM (its staged files removed, and the commands
    it started, a compiler or an exporter in a process group of their own, killed); SIGKILL
    after STAGE_STOP_S."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STAGE_STOP_S
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _in_forked_stage(stage_main, name: str, spec_path: str) -> int:
    """The forked stage's exit status (`python -m pipeline.flow NAME SPEC` in this process)."""
    code = 1
    try:
        files.release_inherited_locks()  # the output-folder locks stay doit's
        progress.ask(None)
        sys.stdout, sys.stderr = sys.__stdout__ or sys.stdout, sys.__stderr__ or sys.stderr
        sys.argv = [stage_main.__file__, name, spec_path]
        sys.modules["__main__"] = stage_main  # a worker it spawns imports the stage's main
        code = stage_main.main([name, spec_path])
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:  # noqa: BLE001 - as an interpreter shows an uncaught error: exit 1
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def run_stage(name: str, spec_path: str):
    """The stage in a child process (its output goes straight to doit's), its exit status
    mapped to doit's: 1 (a gate did not pass) fails the task, doit exits 1; 2 (a mistake in the
    spec or its inputs, one line already printed) is a task error, doit exits 2."""
    from doit.exceptions import TaskError, TaskFailed
    cmd = [sys.executable, "-m", "pipeline.flow", name, spec_path]
    rc = _fork_stage(BY_NAME[name], spec_path) if _forkable() else None
    if rc is None:
        rc = _wait_stage(*isolation.started_with_stop_signals_held(
            lambda mask: os.posix_spawn(sys.executable, cmd, os.environ, setsigmask=mask)))
    if rc == 0:
        return True
    if rc == 2:
        return TaskError(f"{name}: stopped by a mistake in {spec_path} or its inputs (exit 2)")
    return TaskFailed(f"{' '.join(cmd)} returned {rc}")


def task(stage: Stage, spec: Spec, where: str = "dodo.py") -> dict:
    """The doit task of one stage for one spec."""
    from doit.tools import config_changed
    try:
        options = stage.options(spec)
    except UserError as e:  # e.g. a TRTMC_ENV_OVERRIDE that is no JSON object
        print(f"{where}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    checks = [config_changed({"stage": f"{stage.name}@{stage.version}", **options})]
    if stage.current is not None:
        checks.append(lambda: stage.current(spec))
    removes = stage.removes(spec) if stage.removes else stage.targets(spec)
    return {
        "basename": stage.name, "name": spec.name,
        "actions": [(run_stage, [stage.name, str(spec.path)])],
        "file_dep": [str(p) for p in stage.inputs(spec)],
        "targets": [str(p) for p in stage.targets(spec)],
        "uptodate": checks,
        "clean": [(_remove, [[str(p) for p in removes], str(spec.paths.out)])],
        "doc": f"{stage.doc} [{spec.path.name}]",
    }


class StageTasks:
    """A doit task creator (doit calls `create_doit_tasks`): per stage the group task, then one
    sub-task per spec (`doit build_slot:NAME`). `specs` is called once, when doit loads the tasks
    (after it has read `spec=`); a UserError there is one line and exit 2."""

    def __init__(self, specs: Callable[[], list[Spec]], where: str = "dodo.py"):
        self._load, self.where = specs, where
        self._specs: list[Spec] | None = None

    def specs(self) -> list[Spec]:
        if self._specs is None:
            try:
                specs = self._load()
                for spec in specs:  # a second doit on the same folder is refused at once
                    hold_lock(spec.paths.out / LOCK_FILE, "another doit run on this output folder")
            except UserError as e:
                print(f"{self.where}: error: {e}", file=sys.stderr)
                raise SystemExit(2) from None
            self._specs = specs
        return self._specs

    def create_doit_tasks(self):
        for stage in STAGES:
            yield {"basename": stage.name, "name": None, "doc": stage.doc}
            for spec in self.specs():
                yield task(stage, spec, self.where)


def from_doit_var(default: Path) -> StageTasks:
    """dodo.py's tasks: the specs doit's `spec=` variable names (default: `default`), each
    resolved as its stages resolve it (`spec.default_root`), so a task's targets are where its
    stage writes."""
    def specs() -> list[Spec]:
        from doit import get_var
        return load_specs(get_var("spec", str(default)))
    return StageTasks(specs)


def stage_times():
    """doit's console reporter, then a table of how long each task that ran took, so a slow main
    job shows its slow stage."""
    from doit.reporter import ConsoleReporter

    class StageTimes(ConsoleReporter):
        def __init__(self, outstream, options):
            super().__init__(outstream, options)
            self.started, self.times = {}, []
            self.t0 = time.perf_counter()

        def execute_task(self, task):
            super().execute_task(task)
            if task.actions:
                self.started[task.name] = time.perf_counter()

        def _finished(self, task, status):
            if task.name in self.started:
                self.times.append((task.name, time.perf_counter() - self.started.pop(task.name),
                                   status))

        def add_success(self, task):
            super().add_success(task)
            self._finished(task, "ok")

        def add_failure(self, task, fail):
            super().add_failure(task, fail)
            self._finished(task, "failed")

        def complete_run(self):
            super().complete_run()
            if self.times:
                rows = self.times + [("doit run (wall)", time.perf_counter() - self.t0, "")]
                width = max(len(name) for name, _, _ in rows)
                self.write("stage times:\n" + "".join(
                    f"{name:<{width}}  {seconds:6.1f} s  {status}".rstrip() + "\n"
                    for name, seconds, status in rows))
    return StageTimes


def doit_config(dep_file: str | os.PathLike) -> dict:
    """DOIT_CONFIG of a pipeline run: sqlite3 database at `dep_file`, doit's verbosity 2 (a
    stage's output as it comes), the stage-times table at the end."""
    return {"backend": "sqlite3", "dep_file": str(dep_file), "verbosity": 2,
            "reporter": stage_times()}


# -- `trtmc pipeline` -----------------------------------------------------------------------------
def load_pipeline_specs(paths: list[str]) -> list[Spec]:
    """The specs as `trtmc pipeline` runs them: each resolved exactly as its stages resolve it
    (the spec's `$.output`, relative to the spec file; without one, `artifacts/pipelines/NAME`
    under the project root of a source checkout, or beside the spec for an installed package)."""
    if any("," in p for p in paths):
        bad = next(p for p in paths if "," in p)
        raise UserError(f"{bad}: a spec path with a comma (give each spec as its own argument)")
    return load_specs(",".join(paths))


def _owned_args(doit_args: list[str], spec: Spec, names: set[str]) -> list[str] | None:
    """`doit_args` for `spec`'s run: a task given as `STAGE:NAME` goes only to the spec named
    NAME; None when every task given names another spec (that spec's run is skipped)."""
    out, tasks, mine = [], 0, 0
    for arg in doit_args:
        stage, _, name = arg.partition(":")
        if not arg.startswith("-") and name and name in names and stage in {s.name for s in STAGES}:
            tasks += 1
            if name != spec.name:
                continue
            mine += 1
        out.append(arg)
    return None if tasks and not mine else out


def run_spec(spec: Spec, doit_args: list[str]) -> int:
    """One doit run of `spec`'s stages in this process, its database `OUTPUT/.doit.db`; doit's exit
    status (0 done, 1 a gate did not pass, 2 a mistake in the spec or its inputs, 3 a doit usage
    error)."""
    from doit.cmd_base import ModuleTaskLoader
    from doit.doit_cmd import DoitMain
    prepare_process()
    spec.paths.out.mkdir(parents=True, exist_ok=True)
    namespace = {"DOIT_CONFIG": doit_config(spec.paths.out / DB_FILE),
                 "stages": StageTasks(lambda: [spec], where="trtmc pipeline")}
    # config_filenames=(): no pyproject.toml or doit.cfg of the current folder applies
    return DoitMain(ModuleTaskLoader(namespace), config_filenames=()).run(list(doit_args))


def run_pipeline(spec_paths: list[str], doit_args: list[str]) -> int:
    """`trtmc pipeline`: every spec checked first (a mistake: a UserError, nothing run), then one
    doit run per spec, one after another; the highest exit status."""
    specs = load_pipeline_specs(spec_paths)
    names = {s.name for s in specs}
    rc = 0
    for spec in specs:
        args = _owned_args(doit_args, spec, names)
        if args is not None:
            rc = max(rc, run_spec(spec, args))
    return rc
