"""doit entry point of the trtmc pipeline: `doit` runs the default spec, `doit spec=A.json[,B.json]`
others. Each stage is a task group with one sub-task per spec: `doit build_slot:NAME`.
See docs/pipeline.md."""
import functools
import os
import sys
from pathlib import Path

from doit import get_var

from pipeline.errors import UserError
from pipeline.files import hold_lock
from pipeline.flow.spec import DEFAULT_SPEC, load_specs
from tasks import StageTimes, groups

ROOT = Path(__file__).resolve().parent
os.environ["TRTMC_DOIT_PID"] = str(os.getpid())  # stages die with this doit (pipeline/flow/__main__.py)
if sys.stderr.isatty():  # doit pipes a stage's output, so the stage cannot see the terminal itself
    os.environ.setdefault("TRTMC_PROGRESS", "1")
(ROOT / "artifacts").mkdir(exist_ok=True)


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
