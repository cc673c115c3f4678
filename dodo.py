"""doit entry point of the trtmc pipeline: `doit` runs the default spec, `doit spec=A.json[,B.json]`
others. Each stage is a task group with one sub-task per spec: `doit build_slot:NAME`.
See docs/pipeline.md."""
import functools
import sys
from pathlib import Path

from doit import get_var

from pipeline.errors import UserError
from pipeline.flow.spec import DEFAULT_SPEC, load_specs
from tasks import groups

ROOT = Path(__file__).resolve().parent
(ROOT / "artifacts").mkdir(exist_ok=True)
DOIT_CONFIG = {"backend": "sqlite3", "dep_file": "artifacts/.doit.db", "verbosity": 2}


@functools.cache
def _specs():
    try:
        return load_specs(get_var("spec", str(DEFAULT_SPEC)), ROOT)
    except UserError as e:
        print(f"dodo.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


for _name, _task_fn in groups(_specs):
    globals()[f"task_{_name}"] = _task_fn
