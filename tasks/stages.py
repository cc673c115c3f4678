"""doit task factories: one function per stage, each -> the task dict of one spec.

Every task has file_dep, targets and ONE config_changed holding its spec options and a stage
version (bump it when the stage's code changes what it writes). Directory bundles are tracked
through their manifest.json, written last. Model weights are identified by revision plus
(size, mtime_ns) of the model files, never hashed. The action is a child process
(`python -m pipeline.stage`), so a killed doit loses nothing but the record of that run.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import orjson
from doit.tools import config_changed

from pipeline.spec import Spec, model_identity

# Bump a stage's number when its code changes what it writes: it and everything after re-run.
STAGE_VERSIONS = {"inspect": 1, "select": 1, "build_native": 1, "build_slot": 1, "export_dso": 1,
                  "bind": 1, "correctness": 1, "perf": 1, "promote": 1}
DOCS = {
    "inspect": "capture the graph snapshot of the spec's model, revision and build options",
    "select": "validate the spec's selection on the snapshot and write the selection receipt",
    "build_native": "build the native bundle (no slots)",
    "build_slot": "build the slot-ready bundle from a selection made on the current graph",
    "export_dso": "compile/export the kernel DSO",
    "bind": "write the binding manifest and check the DSO binds to the slot",
    "correctness": "correctness gate: region probe, then native vs external end to end",
    "perf": "perf gate: alternating trials, bootstrap interval of the median ratio",
    "promote": "write the promotion receipt (both gates passed)",
}
ORDER = tuple(DOCS)


def _remove(paths, out: str) -> None:
    """Remove the outputs, then the folders inside the spec's output folder (itself included) that
    they leave empty: `doit clean` leaves no empty kernel/ or reports/ behind."""
    out_dir = Path(out)
    for p in map(Path, paths):
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


def _task(stage: str, spec: Spec, *, file_dep, targets, options: dict, clean=(), checks=()) -> dict:
    return {
        "basename": stage, "name": spec.name,
        "actions": [[sys.executable, "-m", "pipeline.stage", stage, str(spec.path)]],
        "file_dep": [str(p) for p in file_dep], "targets": [str(p) for p in targets],
        "uptodate": [config_changed({"stage": f"{stage}@{STAGE_VERSIONS[stage]}", **options}),
                     *checks],
        "clean": [(_remove, [[str(p) for p in (clean or targets)], str(spec.paths.out)])],
        "doc": f"{DOCS[stage]} [{spec.path.name}]",
    }


def _graph_options(spec: Spec) -> dict:
    return {"model": model_identity(spec), "revision": spec.revision, "build": spec.build,
            "engine_role": spec.engine_role}


def _bundle_manifests(spec: Spec) -> list[Path]:
    return [spec.paths.native_bundle / "manifest.json", spec.paths.slot_bundle / "manifest.json"]


def _kernel_deps(spec: Spec) -> list[str]:
    k = spec.kernel
    return [k["source"]] if "source" in k else [k["dso"]] if "dso" in k else k["sources"]


def inspect(spec: Spec) -> dict:
    p = spec.paths
    return _task("inspect", spec, file_dep=[], targets=[p.graph], options=_graph_options(spec),
                 clean=[p.graph] + ([p.model] if spec.synth else []))


def _selection_matches_graph(selection: Path, graph: Path):
    """Up to date only while the receipt on disk was made on the graph on disk: a stale or
    replaced selection.json is re-selected, never used."""
    def check() -> bool:
        try:
            fp = orjson.loads(selection.read_bytes())["graph_fingerprint"]
            return fp == orjson.loads(graph.read_bytes())["fingerprint"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
    return check


def select(spec: Spec) -> dict:
    p = spec.paths
    return _task("select", spec, file_dep=[p.graph], targets=[p.selection],
                 options={"selection": spec.selection},
                 checks=[_selection_matches_graph(p.selection, p.graph)])


def build_native(spec: Spec) -> dict:
    p = spec.paths
    return _task("build_native", spec, file_dep=[p.graph], targets=[p.native_bundle / "manifest.json"],
                 options={**_graph_options(spec), "bundle": spec.bundle}, clean=[p.native_bundle])


def build_slot(spec: Spec) -> dict:
    p = spec.paths
    return _task("build_slot", spec, file_dep=[p.graph, p.selection],
                 targets=[p.slot_bundle / "manifest.json"],
                 options={**_graph_options(spec), "bundle": spec.bundle},
                 clean=[p.slot_bundle])


def export_dso(spec: Spec) -> dict:
    p = spec.paths
    return _task("export_dso", spec, file_dep=_kernel_deps(spec), targets=[p.dso],
                 options={"kernel": spec.kernel})


def bind(spec: Spec) -> dict:
    p = spec.paths
    return _task("bind", spec, file_dep=[p.dso, p.graph, p.selection, p.slot_bundle / "manifest.json"],
                 targets=[p.bindings], options={"function": spec.kernel["function"]})


def _gate(stage: str, spec: Spec, options: dict) -> dict:
    p = spec.paths
    g = spec.gates
    inputs = {"device": g["device"], "cpu_threads": g["cpu_threads"], "texts": g["texts"], "prompts": g["prompts"],
              "max_new_tokens": g["max_new_tokens"]}
    return _task(stage, spec, file_dep=[*_bundle_manifests(spec), p.dso, p.bindings],
                 targets=[p.reports / f"{stage}.json"], options={**inputs, **options},
                 clean=[p.reports / f"{stage}.{ext}" for ext in ("json", "md", "xml", "png")])


def correctness(spec: Spec) -> dict:
    return _gate("correctness", spec, {"correctness": spec.gates["correctness"]})


def perf(spec: Spec) -> dict:
    return _gate("perf", spec, {"perf": spec.gates["perf"]})


def promote(spec: Spec) -> dict:
    p = spec.paths
    deps = [spec.path, p.dso, p.bindings, p.selection, *_bundle_manifests(spec),
            p.reports / "correctness.json", p.reports / "perf.json"]
    return _task("promote", spec, file_dep=deps, targets=[p.promotion], options={"spec": spec.raw})


FACTORIES = {name: globals()[name] for name in ORDER}
