"""doit entry point of the trtmc pipeline: `doit` runs the default spec, `doit spec=A.json[,B.json]`
others. Each stage is a task group with one sub-task per spec: `doit build_slot:NAME`.
The tasks come from the package (pipeline/flow/tasks.py), as `trtmc pipeline` runs them.
See docs/pipeline.md."""
from pathlib import Path

import pipeline.flow.tasks as flow_tasks
from pipeline.flow.spec import DEFAULT_SPEC

ROOT = Path(__file__).resolve().parent
flow_tasks.prepare_process()
(ROOT / "artifacts").mkdir(exist_ok=True)

DOIT_CONFIG = flow_tasks.doit_config("artifacts/.doit.db")
stages = flow_tasks.from_doit_var(DEFAULT_SPEC)  # a task creator: every stage, every spec
