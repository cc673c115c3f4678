"""`python -m pipeline.stage STAGE SPEC`: one stage of the doit pipeline, in its own process.

doit records a success only when its whole run ends, and SIGTERM/SIGKILL lose that record; running
each stage in a child process with atomic outputs means a killed run leaves at worst a stage that
re-runs, never a half-written file that looks up to date. Exit status: 0 done, 1 gate did not
pass (its reports are written), 2 user error (one line on stderr).
"""
from __future__ import annotations

import importlib.metadata
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.spec import Spec, load_spec

PROMOTION_SCHEMA = "promotion"
VERSIONED_PACKAGES = ("trtmc", "torch", "tensorrt-rtx-cu13", "apache-tvm-ffi", "doit", "numpy",
                      "transformers", "safetensors")


class GateNotPassed(Exception):
    """The gate ran and its reports are written, but it did not pass."""


def _log(msg: str) -> None:
    print(f"[stage] {msg}", file=sys.stderr, flush=True)


def inspect(spec: Spec) -> None:
    from pipeline.graph import snapshot
    from pipeline.graph.capture import capture_role
    if spec.synth is not None:
        from pipeline.models.synth import synthesize
        shutil.rmtree(spec.paths.model, ignore_errors=True)
        synthesize(spec.synth["config"], spec.paths.model, seed=spec.synth["seed"],
                   overrides=spec.synth["overrides"])
    cap = capture_role(str(spec.model_dir), spec.revision, spec.engine_role, spec.build)
    snapshot.save(cap.snapshot, spec.paths.graph)
    _log(f"graph {cap.snapshot['fingerprint'][:12]}: {len(cap.snapshot['nodes'])} nodes")


def _node_ids(spec: Spec, snap: dict, names: list[str]) -> list[str]:
    by_name: dict[str, list[str]] = {}
    for n in snap["nodes"]:
        by_name.setdefault(n["name"], []).append(n["id"])
    ids = []
    for i, name in enumerate(names):
        found = by_name.get(name, [])
        if len(found) != 1:
            raise UserError(f"{spec.where('selection', 'node_names', i)}: "
                            f"{'no node' if not found else f'{len(found)} nodes'} named '{name}' "
                            f"in {spec.paths.graph} (expected exactly one; see `trtmc graph list`)")
        ids.append(found[0])
    return ids


def select(spec: Spec) -> None:
    from pipeline.graph import select as sel
    from pipeline.graph import snapshot
    snap = snapshot.load(spec.paths.graph)
    s = spec.selection
    where = spec.where("selection")
    if "recipe" in s:
        receipt = sel.from_recipe(snap, s["recipe"], s["instance"], s.get("binding_id"), source=where)
    else:
        nodes = s["nodes"] if "nodes" in s else _node_ids(spec, snap, s["node_names"])
        receipt = sel.select_region(snap, nodes, binding_id=s["binding_id"],
                                    workspace_bytes=s.get("workspace_bytes", 0),
                                    extra_args=s.get("extra_args", []),
                                    output_shape_like_input=s.get("output_shape_like_input"),
                                    source=where)
    sel.save_receipt(receipt, spec.paths.selection)
    _log(f"selected {receipt['nodes']} as '{receipt['binding_id']}' (abi {receipt['abi_sha256'][:12]})")


def build_native(spec: Spec) -> None:
    from pipeline.bundle.writer import build_bundle
    build_bundle(str(spec.model_dir), spec.revision, spec.build, spec.paths.native_bundle,
                 weights=spec.bundle["weights"], build_plans=spec.bundle["plans"])


def _fresh_receipt(spec: Spec) -> dict:
    """The selection, refused unless it was made on the graph now captured."""
    from pipeline.graph import select as sel
    from pipeline.graph import snapshot
    receipt = sel.load_receipt(spec.paths.selection)
    sel.check_fresh(receipt, snapshot.load(spec.paths.graph), str(spec.paths.selection))
    return receipt


def build_slot(spec: Spec) -> None:
    from pipeline.bundle.writer import build_bundle
    build_bundle(str(spec.model_dir), spec.revision, spec.build, spec.paths.slot_bundle,
                 selection=_fresh_receipt(spec), weights=spec.bundle["weights"],
                 build_plans=spec.bundle["plans"])


def export_dso(spec: Spec) -> None:
    k, dso = spec.kernel, spec.paths.dso
    dso.parent.mkdir(parents=True, exist_ok=True)
    if "source" in k:
        from pipeline.binding.kernel_build import build_kernel
        build_kernel(k["source"], dso, cuda=k["cuda"])
        return
    tmp = dso.with_name(f".{dso.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        if "dso" in k:
            shutil.copyfile(k["dso"], tmp)
        else:
            cmd = [arg.replace("{output}", str(tmp)) for arg in k["exporter"]]
            rc = subprocess.call(cmd, cwd=spec.path.parent)
            if rc != 0 or not tmp.is_file():
                raise UserError(f"{spec.where('kernel', 'exporter')}: {' '.join(cmd)} "
                                f"{'exited with status ' + str(rc) if rc else 'wrote no DSO'}")
        tmp.replace(dso)
    finally:
        tmp.unlink(missing_ok=True)


def bind(spec: Spec) -> None:
    """Write the binding manifest next to the DSO, then bind it once to check it loads and fits."""
    from pipeline.binding.manifest import write_manifest
    from pipeline.bundle.reader import Bundle
    from pipeline.runtime.session import bind_kernels
    tmp = spec.paths.bindings.with_name(f".{spec.paths.bindings.name}.check")
    try:
        write_manifest(tmp, [_fresh_receipt(spec)], spec.paths.dso, spec.kernel["function"])
        bind_kernels(Bundle.open(spec.paths.slot_bundle), tmp)
        tmp.replace(spec.paths.bindings)
    finally:
        tmp.unlink(missing_ok=True)


def _open_both(spec: Spec):
    """Native and external pipelines; CPU timing pinned to `cpu_threads` threads, since an
    oversubscribed thread pool makes CPU timings swing by orders of magnitude."""
    import torch

    from pipeline.runtime.session import open_pipeline
    torch.set_num_threads(spec.gates["cpu_threads"])
    device = spec.gates["device"]
    native = open_pipeline(spec.paths.native_bundle, None, device=device)
    external = open_pipeline(spec.paths.slot_bundle, spec.paths.bindings, device=device)
    return native, external


def _inputs(spec: Spec, kind: str) -> list[str]:
    key = "texts" if kind == "encoder" else "prompts"
    if not spec.gates[key]:
        raise UserError(f"{spec.where('gates', key)}: missing; a {kind} is gated on {key}")
    return spec.gates[key]


def _tokens(results) -> list[list[int]]:
    """Pipeline.generate gives a record per prompt; the gate compares its generated token ids."""
    return [list(r["token_ids"]) for r in results]


def _finish(report: dict, spec: Spec) -> None:
    from pipeline.gates.reports import write_reports
    paths = write_reports(report, spec.paths.reports)
    _log(f"{report['gate']} gate {report['verdict']}: {report['message']} ({paths['md']})")
    if not report["passed"]:
        raise GateNotPassed(report["message"])


def correctness(spec: Spec) -> None:
    from pipeline.binding.probe import region_probe
    from pipeline.gates import correctness as c
    spec.paths.promotion.unlink(missing_ok=True)  # a receipt on disk always matches the gated DSO
    cfg = spec.gates["correctness"]
    probe = region_probe(spec.paths.slot_bundle, spec.paths.bindings, device=spec.gates["device"],
                         seed=cfg["probe_seed"])
    probe_summary = {"max_abs_diff": max((s["max_abs_diff"] for s in probe["slots"]), default=0.0),
                     "tolerance": min((s["tolerance"] for s in probe["slots"]), default=0.0),
                     "passed": probe["passed"]}
    native, external = _open_both(spec)
    items = _inputs(spec, native.kind)
    if native.kind == "encoder":
        comparison = c.compare_encoder(native.embed(items), external.embed(items), items,
                                       max_abs_diff=cfg["max_abs_diff"], min_cosine=cfg["min_cosine"])
    else:
        n = spec.gates["max_new_tokens"]
        comparison = c.compare_decoder(_tokens(native.generate(items, n)),
                                       _tokens(external.generate(items, n)), items)
    _finish(c.correctness_report(spec.name, comparison, probe_summary), spec)


def perf(spec: Spec) -> None:
    import torch

    from pipeline.gates import performance as p
    spec.paths.promotion.unlink(missing_ok=True)
    cfg = spec.gates["perf"]
    native, external = _open_both(spec)
    items = _inputs(spec, native.kind)
    if native.kind == "encoder":  # tokenized once: only the networks are timed
        tok = native.bundle.tokenizer()
        inputs = [native.encode_text(tok, t) for t in items]
        prog_n, prog_e = native.programs["decode"], external.programs["decode"]
        run_native = lambda: [prog_n(**x) for x in inputs]  # noqa: E731
        run_external = lambda: [prog_e(**x) for x in inputs]  # noqa: E731
        count, unit = len(items), "texts"
    else:
        n = spec.gates["max_new_tokens"]
        run_native = lambda: native.generate(items, n)  # noqa: E731
        run_external = lambda: external.generate(items, n)  # noqa: E731
        count, unit = len(items) * n, "tokens"
    cuda = native.device.type == "cuda"
    with torch.inference_mode():
        m = p.measure_alternating(run_native, run_external, cfg["trials"], cfg["warmup"],
                                  sync=torch.cuda.synchronize if cuda else None,
                                  device=native.device if cuda else None, items=count)
    _finish(p.perf_report(spec.name, m, threshold=cfg["threshold"], seed=cfg["seed"],
                          resamples=cfg["resamples"], confidence=cfg["confidence"], unit=unit), spec)


def _pinned(path: Path) -> dict:
    return {"path": str(path), "sha256": jsonio.sha256_file(path)}


def _versions() -> dict:
    from pipeline import trt
    out = {"python": platform.python_version(), trt.MODULE: trt.VERSION}
    for pkg in VERSIONED_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def promote(spec: Spec) -> None:
    """The promotion receipt: written only when both gate reports say pass."""
    from pipeline.gates.reports import SCHEMA as REPORT_SCHEMA
    p = spec.paths
    gates = {}
    for gate in ("correctness", "perf"):
        path = p.reports / f"{gate}.json"
        report = jsonio.read_json(path, REPORT_SCHEMA)
        if not report["passed"]:
            raise UserError(f"{path}: the {gate} gate did not pass ({report['message']}); "
                            f"nothing is promoted")
        gates[gate] = {**_pinned(path), "verdict": report["verdict"], "message": report["message"]}
    receipt = jsonio.read_json(p.selection, None)
    receipt_doc = {
        "schema_version": 1, "name": spec.name,
        "spec": {**_pinned(spec.path), "content": spec.raw},
        "dso": {**_pinned(p.dso), "function": spec.kernel["function"]},
        "binding_manifest": _pinned(p.bindings),
        "selection": {**_pinned(p.selection), "binding_id": receipt["binding_id"],
                      "graph_fingerprint": receipt["graph_fingerprint"], "abi": receipt["abi"],
                      "abi_sha256": receipt["abi_sha256"]},
        "bundles": {"native": _pinned(p.native_bundle / "manifest.json"),
                    "slot": _pinned(p.slot_bundle / "manifest.json")},
        "gates": gates, "versions": _versions(),
    }
    jsonio.write_json(p.promotion, receipt_doc, PROMOTION_SCHEMA)
    _log(f"promoted {spec.name}: {p.promotion}")


STAGES = {f.__name__: f for f in (inspect, select, build_native, build_slot, export_dso, bind,
                                   correctness, perf, promote)}


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)  # through Python, so temp files are removed


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _sigterm)
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in STAGES:
        print(f"usage: python -m pipeline.stage {{{','.join(STAGES)}}} SPEC", file=sys.stderr)
        return 2
    try:
        STAGES[argv[0]](load_spec(argv[1]))
    except UserError as e:
        print(f"{argv[0]}: error: {e}", file=sys.stderr)
        return 2
    except GateNotPassed:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
