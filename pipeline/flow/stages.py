"""The doit pipeline's stages: ONE table of (name, doc, version, inputs, targets, options,
action). `pipeline/flow/tasks.py` turns each row into a doit task per spec; `python -m pipeline.flow STAGE SPEC`
runs a row's action in a child process. Adding a stage is adding one row.

Every action writes its targets atomically; a gate that ran but did not pass writes its reports
and raises GateNotPassed (exit status 1).
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pipeline import jsonio
from pipeline.bundle import layout
from pipeline.errors import UserError
from pipeline.families import family_named
from pipeline.families.workloads import with_items
from pipeline.files import cached_sha256, file_problem, sha256_file, shown, staged_file
from pipeline.flow.spec import Spec, model_identity
from pipeline.gates import ledger
from pipeline.gates.correctness import run_correctness_gate
from pipeline.gates.drawn import draw
from pipeline.gates.environment import build_key, gate_environment, verdict_key
from pipeline.gates.ledger import figures
from pipeline.gates.promotion import (GATES, REPORT_FILES, PromotionInputs, environment, pin_reports, report_pins,
                                      report_problem)
from pipeline.gates.promotion import promote as write_promotion
from pipeline.gates.report_types import GateReport, read_report
from pipeline.gates.reports import aborted_report, write_reports
from pipeline.graph import snapshot
from pipeline.graph import select as sel
from pipeline.graph.select import receipts_of
from pipeline.host.client import HostSpec
from pipeline.graph.receipt import SelectionReceipt
from pipeline.isolation import KernelAborted, Limits
from pipeline.kernels.build import local_includes
from pipeline.kernels.inspect import inspect_file
from pipeline.kernels.manifest import write_manifest
from pipeline.log import get as log_topic
from pipeline.models.synth import synthesize

log = log_topic("stage")


class GateNotPassed(Exception):
    """The gate ran and its reports are written, but it did not pass."""


# -- actions ------------------------------------------------------------------------------------
def inspect_graph(spec: Spec) -> None:
    from pipeline.families.capture import capture_role
    if spec.synth is not None:
        shutil.rmtree(spec.paths.model, ignore_errors=True)
        synthesize(spec.synth["config"], spec.paths.model, seed=spec.synth["seed"],
                   overrides=spec.synth["overrides"], init=spec.synth["init"])
    cap = capture_role(str(spec.model_dir), spec.revision, spec.engine_role, spec.build)
    snapshot.save(cap.snapshot, spec.paths.graph)
    log.info("graph %s: %d nodes", cap.snapshot["fingerprint"][:12], len(cap.snapshot["nodes"]))


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


def selection_receipt(spec: Spec, snap: dict) -> SelectionReceipt | list[SelectionReceipt]:
    """What the spec's selection block yields on `snap`, through the one validator: a receipt,
    or one per instance when the block names `instances`."""
    return spec.selection.receipt(snap, spec.where("selection"),
                                  lambda names: _node_ids(spec, snap, names))


def make_selection(spec: Spec) -> None:
    selection = selection_receipt(spec, snapshot.load(spec.paths.graph))
    sel.save_selection(selection, spec.paths.selection)
    for receipt in sel.receipts_of(selection):
        log.info("selected %s as '%s' (abi %s)", list(receipt.nodes), receipt.binding_id,
                 receipt.abi_sha256[:12])


def selection_is_current(spec: Spec) -> bool:
    """The receipt on disk is exactly what the spec's selection yields on the graph on disk: a
    receipt copied in from another selection, or made on another graph, is never used."""
    try:
        return sel.load_selection(spec.paths.selection) == selection_receipt(
            spec, snapshot.load(spec.paths.graph))
    except UserError:
        return False


def build_native(spec: Spec) -> None:
    from pipeline.bundle.writer import build_bundle
    build_bundle(str(spec.model_dir), spec.revision, spec.build, spec.paths.native_bundle,
                 weights=spec.bundle.weights, build_plans=spec.bundle.plans)


def _asked_for(receipt: SelectionReceipt, request: dict) -> bool:
    """The receipt is the validator's answer to `request`: the same binding id, node set,
    workspace, extra args, shape rule and recipe (the validator orders the nodes)."""
    answer = {"binding_id": receipt.binding_id, "workspace_bytes": receipt.workspace_bytes,
              "extra_args": [a.to_json() for a in receipt.extra_args],
              "output_shape_like_input": receipt.output_shape_like_input,
              "recipe": None if receipt.recipe is None else receipt.recipe.to_json()}
    return (sorted(receipt.nodes) == sorted(request["nodes"])
            and all(answer[k] == request[k] for k in request if k != "nodes"))


def _fresh_receipt(spec: Spec) -> SelectionReceipt | list[SelectionReceipt]:
    """The selection on disk, refused unless it was made on the graph now captured (stale) and is
    what the spec's selection block asks for there (foreign).
    Verified once: only these cheap checks, which no bundle build can make; the region validator
    re-derives every receipt once, in build_bundle, on the graph it actually builds."""
    selection = sel.load_selection(spec.paths.selection)
    snap = snapshot.load(spec.paths.graph)
    receipts = sel.receipts_of(selection)
    for r in receipts:
        sel.check_fresh(r, snap, str(spec.paths.selection))
    requests = spec.selection.requests(snap, spec.where("selection"),
                                       lambda names: _node_ids(spec, snap, names))
    if (requests is None or isinstance(selection, SelectionReceipt) == spec.selection.is_set
            or len(requests) != len(receipts)
            or any(r.build.to_json() != snap["build"] or not _asked_for(r, q)
                   for r, q in zip(receipts, requests))):
        raise UserError(f"{spec.paths.selection}: not the receipt {spec.where('selection')} yields "
                        f"on {spec.paths.graph} (nodes, binding id or options differ); run the "
                        f"select stage again")
    return selection


def build_slot(spec: Spec) -> None:
    from pipeline.bundle.writer import build_bundle
    build_bundle(str(spec.model_dir), spec.revision, spec.build, spec.paths.slot_bundle,
                 selection=_fresh_receipt(spec), weights=spec.bundle.weights,
                 build_plans=spec.bundle.plans)


def _inspected(spec: Spec, path: Path) -> None:
    """The library's imports against the allow-list, with the spec's capabilities granted
    (pipeline/kernels/inspect.py), before anything loads it."""
    problem = inspect_file(path, list(spec.kernel.capabilities)).problem()
    if problem is not None:
        raise UserError(f"{spec.where('kernel')}: {problem}")


def export_dso(spec: Spec) -> None:
    """The DSO, built, copied or exported, and inspected before it takes its place; beside it,
    the digests of the sources it was built from (`built_from`), read before the build and
    refused when they changed while it ran."""
    before = _source_digests(spec)
    with staged_file(spec.paths.built_from) as record:
        _export(spec)
        changed = _changed_sources(before, _source_digests(spec))
        if changed:
            raise UserError(f"{changed[0]}: changed while the DSO was built from it; run doit again")
        jsonio.write_json(record, {"dso_sha256": sha256_file(spec.paths.dso), "sources": before,
                                   "toolchain": build_key(spec.kernel)}, None)


def _source_digests(spec: Spec) -> dict[str, str]:
    """Each kernel source and quoted header (_kernel_sources) -> its sha256 now."""
    out = {}
    for p in _kernel_sources(spec):
        problem = file_problem(p)
        if problem is not None:
            raise UserError(f"{shown(p)}: kernel source {problem}")
        out[str(p)] = sha256_file(p)
    return out


def _changed_sources(then: dict[str, str], now: dict[str, str]) -> list[str]:
    return [shown(p) for p in sorted(set(then) | set(now)) if then.get(p) != now.get(p)]


def _built_from_problem(spec: Spec) -> str | None:
    """None when the DSO is the one export_dso built, with the toolchain here, from the bytes its
    sources hold now; otherwise one line saying what changed."""
    at = spec.paths.built_from
    try:
        record = jsonio.read_json(at, None)
        recorded, sources, toolchain = record["dso_sha256"], dict(record["sources"]), record["toolchain"]
    except (UserError, KeyError, TypeError, ValueError):
        return f"{shown(at)}: no record of the sources the DSO was built from; run doit again"
    if recorded != sha256_file(spec.paths.dso):
        return f"{shown(spec.paths.dso)}: not the DSO export_dso built; run doit again"
    if toolchain != build_key(spec.kernel):
        return (f"{shown(at)}: the DSO was built with another toolchain ({toolchain}) than this "
                f"machine's ({build_key(spec.kernel)}); run doit again")
    changed = _changed_sources(sources, _source_digests(spec))
    if changed:
        return (f"{changed[0]}: changed since the DSO was built from it (the gates ran a library "
                f"built from other bytes); run doit again")
    return None


def _export(spec: Spec) -> None:
    """The DSO, made as the kernel block's form makes it, inspected before it takes its place."""
    with staged_file(spec.paths.dso) as tmp:
        spec.kernel.export(tmp, lambda field: spec.where("kernel", field), spec.path.parent)
        _inspected(spec, tmp)


def bind(spec: Spec) -> None:
    """Write the binding manifest next to the DSO, checked by binding it to the slot-ready bundle
    in a kernel host (loading the DSO runs its constructors) before it takes its place."""
    _inspected(spec, spec.paths.dso)  # the bytes bind loads, whatever wrote them
    with staged_file(spec.paths.bindings) as tmp:
        write_manifest(tmp, receipts_of(_fresh_receipt(spec))[:1],  # one id binds every instance
                       spec.paths.dso, spec.kernel.function)
        _hosted(spec, tmp, what="bind").close()


def _limits(spec: Spec) -> Limits:
    return spec.gates.limits


def _hosted(spec: Spec, bindings, *, what: str, shadow: bool = False):
    """A pipeline of the slot-ready bundle (with `bindings`) or of the native bundle (None), in a
    kernel host, as a run opens it, in the spec's device and engine mode, on `cpu_threads`
    threads (an oversubscribed thread pool makes CPU timings swing by orders of magnitude);
    `shadow`: a correctness gate's, every slot call checked there and drawn for this process."""
    from pipeline.host.hosted import HostedPipeline
    bundle = spec.paths.slot_bundle if bindings else spec.paths.native_bundle
    return HostedPipeline(HostSpec(bundle, bindings, spec.gates.device, spec.gates.mode,
                                   shadow=shadow, threads=spec.gates.cpu_threads),
                          what=what, limits=_limits(spec))


def _open_native(spec: Spec):
    """The native pipeline, opened in this process (the judge's: no kernel library loads here)."""
    import torch

    from pipeline.runtime.pipeline import open_pipeline
    torch.set_num_threads(spec.gates.cpu_threads)
    return open_pipeline(spec.paths.native_bundle, None, device=spec.gates.device,
                         mode=spec.gates.mode)


def _workload(spec: Spec, family):
    """What the gates run on the model: its family's workload (families/workloads.py), made
    from the spec's gates block."""
    workload = family.workload.of(spec.gates)
    if workload is None:
        key = family.workload.field
        raise UserError(f"{spec.where('gates', key)}: missing; a {family.kind} is gated on {key}")
    return workload


def _record(spec: Spec, event: str, verdict: str, passed: bool, figures: dict) -> None:
    """One line in the spec's ledger (pipeline/gates/ledger.py)."""
    receipt = sel.receipts_of(sel.load_selection(spec.paths.selection))[0]  # one id, one ABI
    env = environment(jsonio.read_json(spec.paths.slot_bundle / "manifest.json", None),
                      spec.gates.device, spec.gates.mode)
    ledger.append(spec.paths.out / ledger.FILE, ledger.LedgerEntry.now(
        event, name=spec.name, binding_id=receipt.binding_id, abi_sha256=receipt.abi_sha256,
        environment=env, verdict=verdict, passed=passed, figures=figures))


def _finish(report: GateReport, spec: Spec) -> None:
    paths = write_reports(report, spec.paths.reports)
    pin_reports(spec.paths.reports, report.gate, paths.values())  # what promote accepts
    _record(spec, report.gate, report.verdict.value, report.passed, figures(report))
    log.info("%s gate %s: %s (%s)", report.gate, report.verdict.value, report.message, paths["md"])
    if not report.passed:
        raise GateNotPassed(report.message)


def _gate(spec: Spec, gate: str) -> None:
    """Run `gate` and write its reports. This process is the judge: it never loads the kernel's
    library, which runs in a kernel host (pipeline/host). What an earlier run left (its reports,
    the promotion receipt) goes first: a stage that does not finish leaves no verdict behind. A
    host that ends, crashes, times out or breaks its channel is a failed gate with an `aborted`
    report."""
    for path in [*_reports(gate)(spec), *spec.paths.promotion_files, *_reports_of_another_kernel(spec)]:
        path.unlink(missing_ok=True)
    try:
        report = _gate_report(spec, gate)
        host = report.host
        if host is None:  # the judge always runs the kernel in a host
            raise KeyError("host")
        report = report.with_sections(host={**host, "capabilities": list(spec.kernel.capabilities)})
    except KernelAborted as e:
        report = aborted_report(gate, spec.name, e)
    _finish(report, spec)


def _reports_of_another_kernel(spec: Spec) -> list[Path]:
    """The report files of every gate whose report ran another library than the DSO now there:
    a verdict of an earlier kernel never stays beside a new kernel's."""
    dso = sha256_file(spec.paths.dso)
    stale = []
    for gate in GATES:
        at = spec.paths.reports / f"{gate}.json"
        try:
            ran = {k.library_sha256 for k in read_report(at).kernels}
        except UserError:  # missing, or no report a gate wrote: removed as well
            ran = set()
        if dso not in ran:
            stale += _reports(gate)(spec)
    return stale


def _gate_report(spec: Spec, gate: str) -> GateReport:
    """The gate's report, judged here from what the hosts send back, on the spec's items and
    `gates.drawn` more drawn for this run (gates/drawn.py), which the report records."""
    from pipeline.bundle.reader import Bundle
    bundle = Bundle.open(spec.paths.native_bundle)
    workload = _workload(spec, family_named(bundle.family))
    drawn = draw(tuple(workload.items), bundle.tokenizer(), spec.gates.drawn)
    workload = with_items(workload, drawn.texts)
    return _judged(spec, gate, workload).with_sections(drawn=drawn.as_dict())


def _judged(spec: Spec, gate: str, workload) -> GateReport:
    if gate == "correctness":
        native = _open_native(spec)
        with _hosted(spec, spec.paths.bindings, what="correctness gate", shadow=True) as external:
            return run_correctness_gate(spec.name, native, external, workload, spec.gates)
    from pipeline.gates.performance import native_alone, run_perf_gate
    with _hosted(spec, None, what="perf gate (native)") as native:
        with _hosted(spec, None, what="perf gate (native twin)") as twin:
            alone = native_alone(native, workload, spec.gates.perf, twin)  # no kernel host yet
        with _hosted(spec, spec.paths.bindings, what="perf gate") as external:
            return run_perf_gate(spec.name, native, external, workload, spec.gates, alone)


def correctness(spec: Spec) -> None:
    _gate(spec, "correctness")


def perf(spec: Spec) -> None:
    _gate(spec, "perf")


def promote(spec: Spec) -> None:
    """The receipt, refused for a report edited after its gate wrote it; the ledger line is
    appended once every check passed, and the receipt pins it."""
    p = spec.paths
    for path in p.promotion_files:
        path.unlink(missing_ok=True)
    problem = _built_from_problem(spec)
    if problem is not None:
        raise UserError(f"{problem}; nothing is promoted")
    figures = lambda: {g: ledger.figures(read_report(p.reports / f"{g}.json"))  # noqa: E731
                       for g in GATES}
    inputs = PromotionInputs(
        name=spec.name, spec_path=spec.path, spec_content=spec.raw,
        sources=tuple(_kernel_sources(spec)), dso=p.dso, function=spec.kernel.function,
        bindings=p.bindings, selection=p.selection, native_bundle=p.native_bundle,
        slot_bundle=p.slot_bundle, reports=p.reports, device=spec.gates.device,
        mode=spec.gates.mode, graph=p.graph)
    write_promotion(p.promotion, inputs, ledger=p.out / ledger.FILE,
                    record=lambda: _record(spec, "promote", "pass", True, figures()))
    pin_reports(p.out, "promotion", [p.promotion])  # an edited receipt makes promote run again
    log.info("promoted %s: %s", spec.name, p.promotion)


# -- the table ----------------------------------------------------------------------------------
def _graph_options(spec: Spec) -> dict:
    return {"model": model_identity(spec), "revision": spec.revision, "build": spec.build,
            "engine_role": spec.engine_role}


def _kernel_sources(spec: Spec) -> list[Path]:
    """The files the DSO is made from: the spec's, and every header they include by quotes."""
    files = spec.kernel.files()
    return files + local_includes(files)


def _kernel_options(spec: Spec) -> dict:
    """The spec's kernel block, and what the DSO depends on in this machine: the build target
    chosen here, the compiler and the tvm-ffi whose headers and library it is built on."""
    return {"kernel": spec.kernel.to_json(), "environment": build_key(spec.kernel)}


def _bundles(spec: Spec) -> list[Path]:
    return [spec.paths.native_bundle / "manifest.json", spec.paths.slot_bundle / "manifest.json"]


def _gate_options(spec: Spec, *gates: str) -> dict:
    """The gates' settings, `gates`' own blocks, and what a verdict depends on in this machine:
    the device `gates.device` resolves to, its GPU and driver, CUDA, torch, Triton, tvm-ffi and the
    engine mode."""
    g = spec.gates.to_json()
    return {**{k: g[k] for k in ("device", "mode", "cpu_threads", "texts", "prompts",
                                 "max_new_tokens", "call_timeout_s", "stall_timeout_s")},
            **{gate: g[gate] for gate in gates},
            "environment": verdict_key(gate_environment(spec.gates.device, spec.gates.mode))}


def _reports(gate: str) -> Callable[[Spec], list[Path]]:
    """Every file a gate stage writes in the reports folder: its reports and their pins."""
    return lambda s: [*(s.paths.reports / f"{gate}.{ext}" for ext in REPORT_FILES[gate]),
                      report_pins(s.paths.reports, gate)]


def _receipt_as_written(spec: Spec) -> bool:
    """The receipt is the one promote wrote (its pin): an edited receipt is written again."""
    return report_problem(spec.paths.out, "promotion") is None


def _reports_as_written(gate: str) -> Callable[[Spec], bool]:
    """The gate's report files are still those it wrote (their pins): an edited report makes the
    gate run again, so no edited verdict reaches promote."""
    def current(spec: Spec) -> bool:
        return report_problem(spec.paths.reports, gate) is None
    return current


def _bundle_as_built(folder: Callable[[Spec], Path]) -> Callable[[Spec], bool]:
    """Every file of the bundle is the one its manifest lists (by digest, remembered per file:
    files.cached_sha256) and no file lies beside them: an edited weight, network, tokenizer or
    kernel_slots.json makes its build stage run again, and what depends on the bundle after it."""
    def current(spec: Spec) -> bool:
        bundle = folder(spec)
        try:
            listed = jsonio.read_json(bundle / layout.MANIFEST, "bundle_manifest")["content_digests"]
            present = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*")
                             if p.is_symlink() or not p.is_dir())
            if present != sorted([*listed, layout.MANIFEST]):
                return False
            return cached_sha256([bundle / rel for rel in listed]) == list(listed.values())
        except (UserError, OSError):
            return False
    return current


@dataclass(frozen=True)
class Stage:
    name: str
    doc: str
    version: int                                  # bump when the action changes what it writes
    action: Callable[[Spec], None]
    inputs: Callable[[Spec], list[Path]]          # files it reads (doit file_dep)
    targets: Callable[[Spec], list[Path]]         # the file whose presence means it ran
    options: Callable[[Spec], dict]               # spec settings it depends on
    removes: Callable[[Spec], list[Path]] | None = None   # what `doit clean` removes (default targets)
    current: Callable[[Spec], bool] | None = None         # extra up-to-date check
    exclusive: bool = field(default=False)        # runs alone (timing): never beside another stage
    preload: tuple[str, ...] = ()                 # modules its action imports that take seconds


STAGES: tuple[Stage, ...] = (
    Stage("inspect", "capture the graph snapshot of the spec's model, revision and build options", 2,
          inspect_graph, lambda s: [], lambda s: [s.paths.graph], _graph_options,
          removes=lambda s: [s.paths.graph] + ([s.paths.model] if s.synth else []),
          preload=("torch",)),  # transformers only where it synthesizes the model
    Stage("select", "validate the spec's selection on the snapshot and write the selection receipt", 2,
          make_selection, lambda s: [s.paths.graph], lambda s: [s.paths.selection],
          lambda s: {"selection": s.selection.to_json()}, current=selection_is_current),
    Stage("build_native", "build the native bundle (no slots)", 1,
          build_native, lambda s: [s.paths.graph], lambda s: [s.paths.native_bundle / "manifest.json"],
          lambda s: {**_graph_options(s), "bundle": s.bundle.to_json()},
          removes=lambda s: [s.paths.native_bundle],
          current=_bundle_as_built(lambda s: s.paths.native_bundle), preload=("torch",)),
    Stage("build_slot", "build the slot-ready bundle from a selection made on the current graph", 1,
          build_slot, lambda s: [s.paths.graph, s.paths.selection],
          lambda s: [s.paths.slot_bundle / "manifest.json"],
          lambda s: {**_graph_options(s), "bundle": s.bundle.to_json()},
          removes=lambda s: [s.paths.slot_bundle],
          current=_bundle_as_built(lambda s: s.paths.slot_bundle), preload=("torch",)),
    Stage("export_dso", "compile/export the kernel DSO", 2,
          export_dso, _kernel_sources, lambda s: [s.paths.dso, s.paths.built_from], _kernel_options,
          preload=("torch",)),  # tvm-ffi imports it
    Stage("bind", "write the binding manifest and check the DSO binds to the slot", 2,
          bind, lambda s: [s.paths.dso, s.paths.graph, s.paths.selection,
                           s.paths.slot_bundle / "manifest.json"],
          lambda s: [s.paths.bindings], lambda s: {"function": s.kernel.function,
                                                   **_kernel_options(s)},
          preload=("torch",)),
    Stage("correctness", "correctness gate: native vs external end to end, every slot call "
                         "shadowed, then the region probe", 6,
          correctness, lambda s: [*_bundles(s), s.paths.dso, s.paths.bindings],
          lambda s: [s.paths.reports / "correctness.json"],
          lambda s: _gate_options(s, "correctness"),
          removes=_reports("correctness"),
          current=_reports_as_written("correctness"), preload=("torch",)),
    Stage("perf", "perf gate: alternating trials, bootstrap interval of the median ratio", 6,
          perf, lambda s: [*_bundles(s), s.paths.dso, s.paths.bindings],
          lambda s: [s.paths.reports / "perf.json"],
          lambda s: {**_gate_options(s, "perf"),
                     "max_abs_diff": s.gates.correctness.max_abs_diff},
          removes=_reports("perf"),
          current=_reports_as_written("perf"), exclusive=True, preload=("torch",)),
    Stage("promote", "write the promotion receipt (both gates passed)", 5,
          promote, lambda s: [s.path, *_kernel_sources(s), s.paths.dso, s.paths.built_from,
                              s.paths.bindings,
                              s.paths.graph, s.paths.selection, *_bundles(s),
                              *(s.paths.reports / f"{gate}.{ext}"
                                for gate, exts in REPORT_FILES.items() for ext in exts)],
          lambda s: [s.paths.promotion], lambda s: {"spec": s.raw, **_gate_options(s)},
          removes=lambda s: s.paths.promotion_files, current=_receipt_as_written),
)
BY_NAME = {stage.name: stage for stage in STAGES}
