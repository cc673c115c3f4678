"""doit entry point of the trtmc pipeline: `doit` runs the default spec, `doit spec=A.json[,B.json]`
others. Each stage is a task group with one sub-task per spec: `doit build_slot:NAME`.
See docs/pipeline.md."""
import functools
import sys
import time
from pathlib import Path

from doit import get_var
from doit.reporter import ConsoleReporter

from pipeline.errors import UserError
from pipeline.files import hold_lock
from pipeline.flow.spec import DEFAULT_SPEC, load_specs
from tasks import groups

ROOT = Path(__file__).resolve().parent
(ROOT / "artifacts").mkdir(exist_ok=True)


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


DOIT_CONFIG = {"backend": "sqlite3", "dep_file": "artifacts/.doit.db", "verbosity": 2,
               "reporter": StageTimes}


@functools.cache
def _specs():
    """The specs, each output folder locked for this whole doit run: a second doit on the same
    folder is refused at once instead of racing this one's stages."""
    try:
        specs = load_specs(get_var("spec", str(DEFAULT_SPEC)), ROOT)
        for spec in specs:
            hold_lock(spec.paths.out / ".lock", "another doit run on this output folder")
        return specs
    except UserError as e:
        print(f"dodo.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


for _name, _task_fn in groups(_specs):
    globals()[f"task_{_name}"] = _task_fn
