"""The promotion receipt: written only when both gate reports on disk say pass, pinning by digest
every file the verdicts were reached with (size and digest), the ledger line of the promotion, and
the environment they were reached in.

Paths are relative to the spec file's folder, and the receipt records where that folder lies
relative to itself, so a tree moved elsewhere (spec, sources and outputs together) still verifies:
`verify` recomputes every digest (each bundle's files too, through its manifest), re-derives the
selection from the graph, checks every cross-reference the receipt makes, and refuses a receipt
whose verdicts were reached in another environment (pipeline/gates/environment.py:
VERDICT_FIELDS) than this machine's: a verdict holds for the machine it was reached on.

A gate records the digest of every report file it wrote (`pin_reports`); a report that differs
from its pin was edited after its gate wrote it, and is never promoted (`report_problem`).

The receipt and its pins are typed (pipeline/gates/receipt_types.py), and so is what verify
finds (pipeline/gates/verification.py); JSON only in the files.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import stat
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Mapping, TypeVar

import orjson

from pipeline import jsonio
from pipeline.bundle import layout
from pipeline.errors import UserError
from pipeline.families.workloads import of_kind
from pipeline.files import atomic_write_bytes, file_problem, read_regular, sha256_file, shown
from pipeline.gates import ledger
from pipeline.gates.environment import (OVERRIDE, VERDICT_FIELDS, gate_environment, overridden,
                                        probe, verdict_key)
from pipeline.gates.ledger import MAX_LEDGER_BYTES, figures
from pipeline.gates.policy import GatePolicy
from pipeline.gates.receipt_types import SCHEMA_VERSION as SCHEMA_VERSION  # what promote writes
from pipeline.gates.receipt_types import (BundlePins, DsoPin, FilePin, GatePins, LedgerPin,
                                          PromotionReceipt, ReportPin, SelectionPin, SpecPin)
from pipeline.gates.report_types import GateReport, read_report
from pipeline.gates.settings import GateSettings
from pipeline.gates.signing import PathLike, sign, signature_checks
from pipeline.gates.verification import Check, Difference, DigestCheck, Verification
from pipeline.graph import select, snapshot
from pipeline.graph.abi import abi_sha256
from pipeline.graph.patch import slot_key
from pipeline.kernels.block import named_files
from pipeline.kernels.build import local_includes
from pipeline.kernels.inspect import build_info_file
from pipeline.graph.receipt import SelectionReceipt
from pipeline.graph.selection_block import selection_block

GATES = ("correctness", "perf")
# what write_reports (pipeline/gates/reports.py) writes for a gate that ran to its verdict
REPORT_FILES = {"correctness": ("json", "md", "xml"), "perf": ("json", "md", "xml", "png")}
VERSIONED_PACKAGES = ("trtmc", "torch", "triton", "tensorrt", "tensorrt-rtx-cu13", "apache-tvm-ffi",
                      "doit", "numpy", "transformers", "safetensors")
RERUN_GATE = "edited after its gate wrote it; run the gate again"
# the selection's fields a receipt pins beside its file (SelectionPin), compared with the file's
SELECTED = ("binding_id", "graph_fingerprint", "abi", "abi_sha256")

T = TypeVar("T")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in VERSIONED_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def environment(bundle_manifest: Mapping[str, Any], device: str, mode: str | None = None,
                dso: Path | None = None) -> dict[str, Any]:
    """Where a verdict on `device` in engine `mode` (the spec's gates.device and gates.mode) was
    reached: the gate environment (`gate_environment`: device kind, GPU, driver, CUDA, torch,
    Triton, tvm-ffi, engine mode and code), the host, and the packages. The TensorRT module and
    version come from the bundle manifest (the gates never import TensorRT); one that lacks them
    (a receipt re-verified against some other file, whose digest then differs too) gives None.
    `overridden`: the fields TRTMC_ENV_OVERRIDE replaced, where it is set. `dso`: the kernel's
    library, whose own statement of its build (an exporter's pinned library version, headers and
    flags: kernels/inspect.py BUILD_SECTION) is kept as `kernel_build`."""
    host, simulated = probe(), overridden()
    build = {} if dso is None else {"kernel_build": _readable(lambda: build_info_file(dso))}
    return {**gate_environment(device, mode), **{k: host[k] for k in ("python", "platform", "cpu")},
            **({"overridden": simulated} if simulated else {}),
            "trt_module": bundle_manifest.get("trt_module"),
            "trt_version": bundle_manifest.get("trt_version"),
            "packages": versions(), **build}


def _pinned(path: Path, base: Path, sha256: str | None = None) -> tuple[str, int, str]:
    """What a pin of `path` begins with: its path relative to `base`, its size and its sha256
    (`sha256`: the digest, where the file was hashed already)."""
    return (os.path.relpath(path, base), os.stat(path).st_size,
            sha256_file(path) if sha256 is None else sha256)


# -- report pins --------------------------------------------------------------------------------
def report_pins(reports: Path, gate: str) -> Path:
    """The file in which `gate` records the digest of each report file it wrote."""
    return Path(reports) / f".{gate}.pins.json"


def pin_reports(reports: Path, gate: str, written: Iterable[PathLike]) -> Path:
    """Record the sha256 of each report file the gate just wrote (`written`), atomically, after
    them: what promote and the gate stage's up-to-date check compare the reports against."""
    pins = {Path(p).name: sha256_file(p) for p in written}
    return atomic_write_bytes(report_pins(reports, gate),
                              jsonio.dumps({"gate": gate, "files": pins}))


def report_problem(reports: Path, gate: str) -> str | None:
    """None when every report file `gate` pinned is the file it wrote; otherwise one line naming
    the first file that is not (edited, missing, or never pinned)."""
    at = report_pins(reports, gate)
    doc = _readable(lambda: jsonio.read_json(at, None))
    files = doc.get("files") if isinstance(doc, dict) and doc.get("gate") == gate else None
    if not isinstance(files, dict) or f"{gate}.json" not in files or not all(
            "/" not in k and isinstance(v, str) for k, v in files.items()):
        return (f"{shown(Path(reports) / f'{gate}.json')}: no pins of the {gate} gate's reports "
                f"({shown(at)} is missing or not its gate's); run the gate again")
    for name, digest in sorted(files.items()):
        p = Path(reports) / name
        problem = file_problem(p)
        if problem is not None:
            return f"{shown(p)}: {problem}, though its gate wrote it; run the gate again"
        if sha256_file(p) != digest:
            return f"{shown(p)}: {RERUN_GATE}"
    return None


def _recorded_line(ledger: Path, name: str, record: Callable[[], None]) -> bytes:
    """Call `record`, which appends the promotion's line to `ledger`, and return that line."""
    start = os.stat(ledger).st_size if os.path.isfile(ledger) else 0
    record()
    data = read_regular(ledger, MAX_LEDGER_BYTES, "pipeline.gates.ledger.MAX_LEDGER_BYTES")
    for line in reversed(data[start:].splitlines()):
        entry = _readable(lambda: jsonio.parse_json(line, None, ledger))
        if isinstance(entry, dict) and (entry.get("event"), entry.get("name")) == ("promote", name):
            return line
    raise UserError(f"{shown(ledger)}: the promotion's line was not appended; nothing is promoted")


def _require_tested(report_path: Path, gate: str, report: GateReport, dso: Path,
                    digest: str) -> None:
    """A verdict stands for the bytes its gate loaded: the DSO to pin must be those bytes."""
    tested = {k.library_sha256 for k in report.kernels}
    if digest not in tested:
        ran = ", ".join(f"{k.library} (sha256 {k.library_sha256[:12]})"
                        for k in report.kernels) or "no kernel"
        raise UserError(f"{report_path}: the {gate} gate ran {ran}, not {dso} as it is now "
                        f"(sha256 {digest[:12]}); re-run the gates; nothing is promoted")


def _report_pin(reports: Path, gate: str, dso: Path, dso_sha256: str, base: Path) -> ReportPin:
    """The pin of `gate`'s report in `reports` and of its other files (relative to `base`);
    refused unless the report passed, on the DSO's bytes (`dso_sha256`), and every file is as
    its gate wrote it."""
    report_path = reports / f"{gate}.json"
    report = read_report(report_path)
    if not report.passed:
        raise UserError(f"{report_path}: the {gate} gate did not pass ({report.message}); "
                        f"nothing is promoted")
    problem = report_problem(reports, gate)
    if problem is not None:
        raise UserError(problem)
    _require_tested(report_path, gate, report, dso, dso_sha256)
    others = [reports / f"{gate}.{ext}" for ext in REPORT_FILES[gate][1:]]
    for other in others:
        if file_problem(other) is not None:
            raise UserError(f"{shown(other)}: {file_problem(other)}; the {gate} gate writes "
                            f"it; run the gate again")
    return ReportPin(*_pinned(report_path, base), report.verdict, report.message,
                     tuple(FilePin(*_pinned(o, base)) for o in others))


@dataclass(frozen=True)
class PromotionInputs:
    """What a promotion rests on, each file as the stages wrote it: the spec (its path and
    content), the kernel's sources and DSO and the function bound, the binding manifest, the
    selection and graph, both bundles, the gate reports' folder, and the device and engine mode
    the spec's gates name."""
    name: str
    spec_path: Path
    spec_content: Mapping[str, Any]
    sources: tuple[Path, ...]
    dso: Path
    function: str
    bindings: Path
    selection: Path
    native_bundle: Path
    slot_bundle: Path
    reports: Path
    device: str = "cpu"
    mode: str | None = None
    graph: Path | None = None


def promote(path: Path, inputs: PromotionInputs, *, ledger: Path | None = None,
            record: Callable[[], None] | None = None) -> PromotionReceipt:
    """Write the receipt at `path` and return it; refused unless every gate report passed, on
    the bytes `inputs.dso` holds now, and is the file its gate wrote (its pin). `record` appends
    the promotion's line to `ledger`; it is called once every check has passed, and the receipt
    pins that line."""
    i = inputs
    base = i.spec_path.parent
    dso_sha256 = sha256_file(i.dso)  # hashed once: the bytes checked against the reports are pinned
    correctness, perf = (_report_pin(i.reports, gate, i.dso, dso_sha256, base) for gate in GATES)
    receipts = _receipts(i.selection)
    receipt = receipts[0]  # many instances share the id, fingerprint and ABI
    slot_manifest = i.slot_bundle / "manifest.json"
    promoted = PromotionReceipt(
        name=i.name, spec_folder=os.path.relpath(base, path.parent),
        spec=SpecPin(*_pinned(i.spec_path, base), dict(i.spec_content)),
        kernel_sources=tuple(FilePin(*_pinned(s, base)) for s in i.sources),
        dso=DsoPin(*_pinned(i.dso, base, dso_sha256), i.function),
        binding_manifest=FilePin(*_pinned(i.bindings, base)),
        graph=None if i.graph is None else FilePin(*_pinned(i.graph, base)),
        selection=SelectionPin(*_pinned(i.selection, base), **_pinned_fields(receipt),
                               slots=tuple(_slot_keys(i.selection))),
        bundles=BundlePins(FilePin(*_pinned(i.native_bundle / "manifest.json", base)),
                           FilePin(*_pinned(slot_manifest, base))),
        gates=GatePins(correctness, perf, i.device, i.mode),
        environment=environment(jsonio.read_json(slot_manifest, None), i.device, i.mode, i.dso))
    if record is not None:
        assert ledger is not None, "`record` appends to `ledger`: both or neither"
        line = _recorded_line(ledger, i.name, record)
        promoted = replace(promoted, ledger=LedgerPin(os.path.relpath(ledger, base),
                                                      hashlib.sha256(line).hexdigest()))
    jsonio.write_json(path, promoted.to_json(), None)  # to_json checks it
    return promoted


def _flat(env: Mapping[str, Any]) -> dict[str, Any]:
    return {**{k: v for k, v in env.items() if k != "packages"},
            **{f"packages.{k}": v for k, v in env.get("packages", {}).items()}}


def _differences(recorded: Mapping[str, Any],
                 now: Mapping[str, Any]) -> tuple[list[Difference], list[Difference]]:
    """(what makes the verdict another one: VERDICT_FIELDS, notes: the rest that differs)."""
    def diff(a: Mapping[str, Any], b: Mapping[str, Any], keys: Iterable[str]) -> list[Difference]:
        return [{"key": k, "recorded": a.get(k), "now": b.get(k)} for k in keys
                if a.get(k) != b.get(k)]
    decisive = diff(verdict_key(recorded), verdict_key(now), VERDICT_FIELDS)
    if recorded.get("overridden") or now.get("overridden"):  # simulated: never this machine
        decisive.append({"key": OVERRIDE, "recorded": recorded.get("overridden"),
                         "now": now.get("overridden")})
    recorded, now = _flat(recorded), _flat(now)
    shown_already = set(VERDICT_FIELDS) | {"overridden"} | ({"gpu_driver"} if any(
        d["key"] == "gpu_driver_major" for d in decisive) else set())
    return decisive, diff(recorded, now, sorted((set(recorded) | set(now)) - shown_already))


def _readable(read: Callable[[], T]) -> T | None:
    """`read()`, or None when the pinned file cannot be read as expected (missing, a folder, too
    long a name, not valid JSON): verify reports a difference there, not an error."""
    try:
        return read()
    except (OSError, UserError):
        return None


def _check_file(what: str, p: Path, sha256: str, size: int | None = None) -> DigestCheck:
    """One file against the disk: its digest `sha256`, and its `size` where one is pinned (a
    bundle's manifest lists only digests). The size is compared first: a file of another size (a
    60 GB file where a 1 MB DSO was pinned) is a difference at once, never hashed."""
    try:
        problem = file_problem(p)
        found = None if problem else os.stat(p).st_size
    except (OSError, UserError) as e:  # a name too long, a link loop
        problem = f"cannot be read: {e}"
    if problem is None and size is not None and size != found:
        problem = f"{found} bytes, the receipt pins {size} (not hashed)"
    actual = None if problem else _readable(lambda: sha256_file(p))
    got = problem or ("missing" if actual is None else "got " + actual[:12])
    check = Check.of(what, p, actual == sha256, f"expected {sha256[:12]}, {got}")
    return DigestCheck(check.what, check.path, check.match, check.detail, sha256, actual, problem)


def _check_pin(what: str, base: Path, pin: FilePin) -> DigestCheck:
    """A file the receipt pins (`pin`, relative to the spec folder `base`) against the disk."""
    return _check_file(what, base / pin.path, pin.sha256, pin.size)


def _shown_value(value: object) -> str:
    return jsonio.excerpt(orjson.dumps(value).decode(), 60)


def _bundle_files(label: str, manifest_path: Path) -> list[Check]:
    """Every file a bundle's manifest lists (content_digests) against its digest there, and no
    file beside them: what Bundle.open checks before a bundle is used."""
    manifest = _readable(lambda: jsonio.read_json(manifest_path, None))
    if not isinstance(manifest, dict):
        return []  # the manifest's own pin is the difference
    folder, listed = manifest_path.parent, manifest.get("content_digests", {})
    if not isinstance(listed, dict):
        return [Check.of(f"{label} content_digests", manifest_path, False, "not an object")]
    checks: list[Check] = []
    for rel, digest in sorted(listed.items()):
        pure = PurePosixPath(rel)
        if not rel or pure.is_absolute() or ".." in pure.parts or pure.as_posix() != rel or \
                not isinstance(digest, str):
            checks.append(Check.of(f"{label} {jsonio.excerpt(repr(rel), 60)}", manifest_path, False,
                                   "content_digests: not a plain relative path with a digest"))
        else:
            checks.append(_check_file(f"{label} {rel}", folder / rel, digest))
    try:
        for dirpath, dirs, names in os.walk(folder):
            for name in dirs + names:
                p = Path(dirpath, name)
                rel = p.relative_to(folder).as_posix()
                mode = os.lstat(p).st_mode
                if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                    checks.append(Check.of(f"{label} {rel}", p, False, "not a regular file or "
                                           "folder; a bundle holds only regular files"))
                elif stat.S_ISREG(mode) and rel not in listed and rel != layout.MANIFEST:
                    checks.append(Check.of(f"{label} {rel}", p, False,
                                           f"not listed in {layout.MANIFEST} content_digests"))
    except OSError as e:
        checks.append(Check.of(f"{label} folder", folder, False, f"cannot be listed: {e}"))
    return checks


def _kernel_source_pins(receipt: PromotionReceipt, base: Path) -> list[Check]:
    """A pin for every file the spec's kernel block names and every header those include by
    quotes (what export_dso read): a source left out of kernel_sources is a difference."""
    files = [Path(os.path.realpath(base / n)) for n in named_files(receipt.spec.content["kernel"])]
    includes = _readable(lambda: local_includes(files)) or []
    pinned = {Path(os.path.realpath(base / s.path)) for s in receipt.kernel_sources}
    return [Check.of("kernel source pin", f, f in pinned, "read to build the DSO, but not pinned in "
                     "kernel_sources") for f in files + includes]


def _slot_keys(path: Path) -> list[str]:
    """The slots a selection file makes: its binding id, or ID:INSTANCE for each instance."""
    selection = select.load_selection(path)
    if isinstance(selection, SelectionReceipt):
        return [selection.binding_id]
    return [slot_key(r.binding_id, r.instance) for r in selection]


def _receipts(path: Path) -> list[SelectionReceipt]:
    """The selection file's receipts: one, or every instance of a selection set."""
    return select.receipts_of(select.load_selection(path))


def _pinned_fields(sel: SelectionReceipt) -> dict[str, Any]:
    """The selection's fields a promotion receipt pins beside its file's digest (SELECTED), by
    their names in SelectionPin, as it holds them (many instances share the id, fingerprint and
    ABI)."""
    return {"binding_id": sel.binding_id, "graph_fingerprint": sel.graph_fingerprint,
            "abi": sel.abi.to_json(), "abi_sha256": sel.abi_sha256}


def _selection_references(receipt: PromotionReceipt, base: Path,
                          sels: list[SelectionReceipt] | None) -> list[Check]:
    """The receipt's selection fields are the selection file's, and the file is what the region
    validator derives again on the pinned graph (every instance of a selection set)."""
    pin = receipt.selection
    at = base / pin.path
    sel = _pinned_fields(sels[0]) if sels else None
    checks = [Check.of(f"selection.{key}", at, sel is not None and sel[key] == getattr(pin, key),
                       "the selection file cannot be read" if sel is None else
                       f"receipt {_shown_value(getattr(pin, key))}, selection file "
                       f"{_shown_value(sel[key])}")
              for key in SELECTED]
    slots = _readable(lambda: _slot_keys(at))
    checks.append(Check.of("selection.slots", at, slots == list(pin.slots),
                           f"receipt {_shown_value(pin.slots)}, selection file "
                           f"{_shown_value(slots)}"))
    if receipt.graph is not None and sels:
        graph = base / receipt.graph.path
        try:
            snap = snapshot.load(graph)
            for one in sels:
                select.rederive(one, snap, str(at))
            checks.append(Check.of("selection re-derived from the graph", graph, True, ""))
        except UserError as e:
            checks.append(Check.of("selection re-derived from the graph", graph, False, str(e)))
    return checks


def _bundle_references(receipt: PromotionReceipt, base: Path, sel: SelectionReceipt | None,
                       strict: bool) -> list[Check]:
    """Both bundles were built on the selection's graph, and the slot bundle's kernel_slots.json
    holds the selection's slot with its ABI. `strict`: each must be a bundle manifest."""
    pin = receipt.selection
    checks: list[Check] = []
    for kind, bundle in receipt.bundles.by_kind().items():
        at = base / bundle.path
        manifest = _readable(lambda: jsonio.read_json(at, "bundle_manifest"))
        if manifest is None:
            if strict:
                checks.append(Check.of(f"{kind} bundle", at, False, "not a bundle manifest"))
            continue
        if sel is not None:
            role = next((r for r in manifest["roles"] if r["role"] == sel.engine_role), None)
            checks.append(Check.of(f"{kind} bundle graph_fingerprint", at, role is not None and
                                   role["graph_fingerprint"] == pin.graph_fingerprint,
                                   f"role {sel.engine_role!r} was not built on graph "
                                   f"{pin.graph_fingerprint[:12]}"))
        if kind == "slot":
            slots_at = at.parent / layout.SLOTS
            slots = _readable(lambda: jsonio.read_json(slots_at, "kernel_slots")) or {"slots": []}
            mine = [s for s in slots["slots"] if s["binding_id"] == pin.binding_id]
            checks.append(Check.of("kernel_slots.json binding_id", slots_at, bool(mine),
                                   f"no slot {pin.binding_id!r}"))
            checks += [Check.of(f"kernel_slots.json {key}", slots_at, slot[key] == getattr(pin, key),
                                f"receipt {_shown_value(getattr(pin, key))}, slot "
                                f"{_shown_value(slot[key])}") for slot in mine
                       for key in ("abi", "abi_sha256")]
    return checks


def _gate_reports(receipt: PromotionReceipt, base: Path) -> dict[str, GateReport | None]:
    """Each gate's JSON report the receipt names, read once for every check made of it (None
    where it cannot be read as a report)."""
    return {gate: _readable(lambda: read_report(base / pin.path))
            for gate, pin in receipt.gates.by_gate().items()}


def _gate_references(receipt: PromotionReceipt, base: Path,
                     reports: dict[str, GateReport | None],
                     spec_gates: GateSettings | None = None) -> tuple[list[Check], list[Check]]:
    """(each gate's other report files against their pins, each gate's pins complete and its
    report (`reports`, `_gate_reports`) the passing one the receipt names, on the pinned DSO, and
    what it says following from its own figures under `spec_gates`: the pipeline spec's
    GateSettings, None for a receipt of another kind of spec)."""
    files: list[Check] = []
    checks: list[Check] = []
    for gate, pin in receipt.gates.by_gate().items():
        at = base / pin.path
        files += [_check_pin(f"{gate} report {PurePosixPath(f.path).name}", base, f)
                  for f in pin.files]
        report = reports[gate]
        checks.append(Check.of(f"gates.{gate}", at, report is not None and report.gate == gate
                               and report.passed and report.message == pin.message,
                               "the report is not the passing one the receipt names"))
        if report is None or report.gate != gate:
            continue
        digest = receipt.dso.sha256
        checks.append(Check.of(f"gates.{gate} kernel", at, digest in {
            k.library_sha256 for k in report.kernels},
            f"the gate ran no library with the pinned DSO's sha256 {digest[:12]}"))
        checks.append((_perf_rederived if gate == "perf" else _correctness_rederived)(
            report, spec_gates, at))
        pinned = {os.path.normpath(f.path) for f in pin.files}
        for ext in REPORT_FILES[gate][1:]:
            want = os.path.normpath(os.path.join(os.path.dirname(pin.path), f"{gate}.{ext}"))
            checks.append(Check.of(f"gates.{gate}.files", base / want, want in pinned,
                                   "a report file of the gate, not pinned"))
    return files, checks


def _perf_rederived(report: GateReport, spec_gates: GateSettings | None, at: Path) -> Check:
    """The perf report's verdict and message follow from its own trials under the spec's
    `gates.perf` settings and CPU threads (`spec_gates`; None: the report's own)."""
    from pipeline.gates.performance import rederived
    try:
        again = rederived(report, *((spec_gates.perf, spec_gates.cpu_threads)
                                    if spec_gates is not None else ()))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        return Check.of("gates.perf re-derived", at, False, f"cannot be computed again ({e!r})")
    same = (again.verdict, again.message) == (report.verdict, report.message)
    return Check.of("gates.perf re-derived", at, same,
                    f"its trials under the spec's settings give {again.verdict.value!r} "
                    f"({again.message[:120]}), not {report.verdict.value!r}")


def _correctness_rederived(report: GateReport, spec_gates: GateSettings | None, at: Path) -> Check:
    """The correctness report's pass follows from its own cases, shadow and probe, and its
    thresholds are the spec's `gates.correctness` ones (`spec_gates`; None: not compared); an
    encoder's passing case is within them by its own figures (the kind's workload says what
    its report records and re-derives)."""
    c = report.correctness
    if c is None:  # an aborted report: no cases to follow from
        raise KeyError("kind")
    workload, held, problems = of_kind(c.kind), c.thresholds, []
    if spec_gates is not None:
        want = workload.thresholds(spec_gates.correctness)
        if held != want:
            problems.append(f"thresholds {held.to_json()}, the spec's {want.to_json()}")
    problems += workload.unfounded_passes(c.cases, held)
    follows = bool(c.cases) and all(case.passed for case in c.cases) and all(
        part is None or part for part in (None if c.shadow is None else c.shadow.passed,
                                          c.probe_passed))
    if report.passed != follows:
        problems.append("its pass does not follow from its cases, shadow and probe")
    return Check.of("gates.correctness re-derived", at, not problems, "; ".join(problems))


def _ledger_reference(receipt: PromotionReceipt, base: Path,
                      reports: dict[str, GateReport | None]) -> Check:
    """The promotion's ledger line is still in the ledger, byte for byte, and names this
    promotion: its binding, ABI and the gates' figures (from `reports`, `_gate_reports`)."""
    pin = receipt.ledger
    assert pin is not None  # asked only of a receipt that pins its ledger line
    at = base / pin.path
    data = _readable(lambda: read_regular(at, MAX_LEDGER_BYTES,
                                          "pipeline.gates.ledger.MAX_LEDGER_BYTES")) or b""
    line = next((x for x in data.splitlines()
                 if hashlib.sha256(x).hexdigest() == pin.sha256), None)
    if line is None:
        return Check.of("ledger line", at, False, f"no line has sha256 {pin.sha256[:12]} (the "
                                                  f"promotion's line was edited or removed)")
    entry = _readable(lambda: jsonio.parse_json(line, None, at))
    entry = entry if isinstance(entry, dict) else {}
    recorded = entry["figures"] if isinstance(entry.get("figures"), dict) else {}
    want: dict[str, Any] = {"event": "promote", "name": receipt.name,
                            "binding_id": receipt.selection.binding_id,
                            "abi_sha256": receipt.selection.abi_sha256}
    for gate, report in reports.items():
        if report is not None:
            want[f"figures.{gate}"] = figures(report)
    got = {**entry, **{f"figures.{g}": recorded.get(g) for g in GATES}}
    differ = [k for k, v in want.items() if got.get(k) != v]
    return Check.of("ledger line", at, not differ, f"its {', '.join(differ)} differ from the "
                                                   f"receipt's")


def _ledger_chain(at: Path) -> Check:
    """The whole ledger reads as a ledger: every line valid and chained to the one before it."""
    try:
        ledger.read(at)
    except (UserError, OSError) as e:
        return Check.of("ledger chain", at, False, str(e))
    return Check.of("ledger chain", at, True, "")


def _is_pipeline_spec(content: Mapping[str, Any]) -> bool:
    try:
        jsonio.validate(content, "pipeline_spec", "spec.content")
    except UserError:
        return False
    return True


def _references(receipt: PromotionReceipt, base: Path, sels: list[SelectionReceipt] | None,
                reports: dict[str, GateReport | None]) -> tuple[list[Check], list[Check]]:
    """(report files reached through the receipt, every cross-reference inside it), given the
    selection receipts and the gates' reports it names, as verify read them."""
    spec_at, content = base / receipt.spec.path, receipt.spec.content
    spec_file = _readable(lambda: jsonio.read_json(spec_at, None))
    checks = [Check.of("spec.content", spec_at, spec_file == content,
                       "is not the content of the spec file")]
    strict = _is_pipeline_spec(content)  # a pipeline's promotion pins all it was made from
    spec_gates = _spec_gates(receipt)
    if strict:
        checks += _kernel_source_pins(receipt, base)
        named = selection_block(content["selection"]).named
        checks.append(Check.of("spec selection binding_id", spec_at,
                               named == receipt.selection.binding_id,
                               f"the spec names {named!r}, the receipt "
                               f"{receipt.selection.binding_id!r}"))
        checks += [Check.of(f"{key} pin", spec_at, getattr(receipt, key) is not None,
                            f"null (a pipeline spec's promotion pins its {key})")
                   for key in ("graph", "ledger")]
    checks += _selection_references(receipt, base, sels)
    checks += _bundle_references(receipt, base, sels[0] if sels else None, strict)
    files, gate_checks = _gate_references(receipt, base, reports, spec_gates)
    checks += gate_checks
    if receipt.ledger is not None:
        checks += [_ledger_reference(receipt, base, reports), _ledger_chain(base / receipt.ledger.path)]
    return files, checks


def _spec_gates(receipt: PromotionReceipt) -> GateSettings | None:
    """The pinned pipeline spec's gate settings; None for a receipt of another kind of spec."""
    content = receipt.spec.content
    return GateSettings.from_json(content.get("gates") or {}) if _is_pipeline_spec(content) else None


def verify(path: PathLike, *, ignore_environment: bool = False, policy: GatePolicy | None = None,
           trusted_key: PathLike | None = None, envelope: PathLike | None = None) -> Verification:
    """Re-check a receipt against the files on disk: every size and digest (paths relative to
    the spec folder the receipt names; every file of both bundles through their manifests), the
    ABI hash re-derived from the selection on disk, every cross-reference of the receipt (spec
    content, kernel-source pins, selection against its file, the graph and kernel_slots.json,
    report pins, the ledger line), and the environment here against the recorded one. `ok` when
    all of them match and the verdict's environment (VERDICT_FIELDS, for the device the spec's
    gates resolve to here) is this machine's; `ignore_environment`: the differences as notes.
    `policy`: the settings the verdicts were reached under are also held to its floors.
    `trusted_key` (a public key file): the receipt must also be signed by it, over exactly the
    files it rests on now (pipeline/gates/signing.py; `envelope`: where the signature is, by
    default beside the receipt)."""
    path = Path(path)
    receipt = PromotionReceipt.read(path)
    base = Path(os.path.realpath(path.parent / receipt.spec_folder))  # a link loop: files differ
    files = [_check_pin(what, base, pin) for what, pin in receipt.pins()]
    bundle_files = [c for kind, pin in receipt.bundles.by_kind().items() for c in _bundle_files(
        f"{kind} bundle file", base / pin.path)]
    sels = _readable(lambda: _receipts(base / receipt.selection.path))
    reports = _gate_reports(receipt, base)
    report_files, references = _references(receipt, base, sels, reports)
    abi: dict[str, Any] = {"expected": receipt.selection.abi_sha256, "actual": None}
    if sels:
        abi["actual"] = abi_sha256(sels[0].derived_abi())
    abi["match"] = abi["actual"] == abi["expected"]
    manifest = _readable(lambda: jsonio.read_json(base / receipt.bundles.slot.path, None))
    now = environment(manifest if isinstance(manifest, dict) else {}, receipt.gates.device,
                      receipt.gates.mode, base / receipt.dso.path)
    differences, notes = _differences(receipt.environment, now)
    if ignore_environment:
        differences, notes = [], differences + notes
    floors = [] if policy is None else policy.checks(
        receipt.gates.device, reports["correctness"], reports["perf"], gates=_spec_gates(receipt))
    result = Verification(str(path), str(base), tuple(files), tuple(report_files),
                          tuple(bundle_files), tuple(references), tuple(floors), (), abi,
                          tuple(differences), tuple(notes))
    if trusted_key is not None:
        result = replace(result, signature=tuple(signature_checks(path, result, trusted_key,
                                                                  envelope)))
    return result


def sign_receipt(path: PathLike, key: PathLike, out: PathLike | None = None) -> Path:
    """Verify the receipt at `path` here (environment differences only as notes: a signing job
    runs on another machine) and sign it with the private key file `key` (gates/signing.py);
    refused, with the first difference, unless it verifies."""
    return sign(path, key, verify(path, ignore_environment=True), out)
