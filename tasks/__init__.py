"""doit tasks generated from the one stage table (pipeline/flow/stages.py).

Each task has file_dep, targets and ONE config_changed holding the stage's spec options and its
version; a stage whose output depends on the machine holds what it depends on there too
(pipeline/gates/environment.py), so a cache restored on another machine re-runs those stages.
Directory bundles are tracked through their manifest.json, written last. A model folder is
identified by revision plus each file's name, size and content digest (hashed once per machine,
pipeline/flow/spec.py: model_identity), so a restored cache holds on another machine. The action is a
child process (`python -m pipeline.flow`), so a killed doit loses nothing but the record of that
run.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from doit.exceptions import TaskError, TaskFailed
from doit.reporter import ConsoleReporter
from doit.tools import config_changed

from pipeline.errors import UserError
from pipeline.files import remove_stale_stages
from pipeline.flow.spec import Spec
from pipeline.flow.stages import STAGES, Stage


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


def run_stage(name: str, spec_path: str):
    """The stage in a child process (its output goes straight to doit's), its exit status
    mapped to doit's: 1 (a gate did not pass) fails the task, doit exits 1; 2 (a mistake in the
    spec or its inputs, one line already printed) is a task error, doit exits 2."""
    cmd = [sys.executable, "-m", "pipeline.flow", name, spec_path]
    rc = subprocess.call(cmd)
    if rc == 0:
        return True
    if rc == 2:
        return TaskError(f"{name}: stopped by a mistake in {spec_path} or its inputs (exit 2)")
    return TaskFailed(f"{' '.join(cmd)} returned {rc}")


def task(stage: Stage, spec: Spec) -> dict:
    """The doit task of one stage for one spec."""
    try:
        options = stage.options(spec)
    except UserError as e:  # e.g. a TRTMC_ENV_OVERRIDE that is no JSON object
        print(f"dodo.py: error: {e}", file=sys.stderr)
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


def groups(specs: list[Spec]):
    """Per stage: the group task, then one sub-task per spec (`doit build_slot:NAME`)."""
    for stage in STAGES:
        def task_fn(stage=stage):
            yield {"basename": stage.name, "name": None, "doc": stage.doc}
            for spec in specs():
                yield task(stage, spec)
        task_fn.__name__ = f"task_{stage.name}"
        task_fn.__doc__ = stage.doc
        yield stage.name, task_fn


class StageTimes(ConsoleReporter):
    """doit's console output, then a table of how long each task that ran took, so a slow main
    job shows its slow stage."""

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
            self.times.append((task.name, time.perf_counter() - self.started.pop(task.name), status))

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
            self.write("stage times:\n" + "".join(f"{name:<{width}}  {seconds:6.1f} s  {status}".rstrip()
                                                   + "\n" for name, seconds, status in rows))
