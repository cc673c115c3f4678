"""doit entry point of the trtmc pipeline: `doit` runs the default spec, `doit spec=A.json[,B.json]`
others. Each stage is a task group with one sub-task per spec: `doit build_slot:NAME`.
See docs/pipeline.md."""
import functools
import sys
from pathlib import Path

from doit import get_var

from pipeline.errors import UserError
from pipeline.spec import DEFAULT_SPEC, load_specs
from tasks import stages

ROOT = Path(__file__).resolve().parent
(ROOT / "artifacts").mkdir(exist_ok=True)
DOIT_CONFIG = {"backend": "sqlite3", "dep_file": "artifacts/.doit.db", "verbosity": 2}


@functools.cache
def _specs(arg: str):
    try:
        return load_specs(arg, ROOT)
    except UserError as e:
        print(f"dodo.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _group(stage: str):
    def task_fn():
        yield {"basename": stage, "name": None, "doc": stages.DOCS[stage]}
        for spec in _specs(get_var("spec", str(DEFAULT_SPEC))):
            yield stages.FACTORIES[stage](spec)
    task_fn.__name__ = f"task_{stage}"
    task_fn.__doc__ = stages.DOCS[stage]
    return task_fn


for _stage in stages.ORDER:
    globals()[f"task_{_stage}"] = _group(_stage)
