"""A promotion receipt as typed data: what `promote` writes, and what `verify` and `sign` read
(pipeline/gates/promotion.py, signing.py).

`PromotionReceipt` holds the receipt's fields as the promotion schema
(schemas/promotion.schema.json) names them, each file it pins by digest a `FilePin` or one that
says more of that file: `SpecPin` (the spec as read), `DsoPin` (the function bound),
`SelectionPin` (the selection's fields), `ReportPin` (a gate's verdict and its other report
files); `GatePins` and `BundlePins` group them as the schema does, and `LedgerPin` pins the
promotion's ledger line. `to_json` gives the document the receipt file holds, its keys in the
order `promote` has always made them; `from_json` reads one back from a document already checked
against the schema (`PromotionReceipt.read` reads and checks a file), so that a receipt written
again is the same bytes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from pipeline import jsonio
from pipeline.gates.verdict import Verdict

SCHEMA = "promotion"
SCHEMA_VERSION = 5  # 5: the environment names the engine's code

Json = Mapping[str, Any]


def _file(doc: Json) -> tuple[str, int, str]:
    """The path, size and sha256 of a pin's document: what every pin of a file begins with."""
    return doc["path"], doc["size"], doc["sha256"]


@dataclass(frozen=True)
class FilePin:
    """A file pinned by its size and sha256; `path` is relative to the spec folder. verify
    compares the size first, so a file of another size is never hashed."""
    path: str
    size: int
    sha256: str

    @classmethod
    def from_json(cls, doc: Json) -> FilePin:
        return cls(*_file(doc))

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class SpecPin(FilePin):
    """The spec file and its content as the stages read it: verify holds the file to it, and
    the gate settings verify re-derives the verdicts under come from it."""
    content: Json

    @classmethod
    def from_json(cls, doc: Json) -> SpecPin:
        return cls(*_file(doc), doc["content"])

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "content": dict(self.content)}


@dataclass(frozen=True)
class DsoPin(FilePin):
    """The kernel's library and the function bound in it: the binding manifest does not pin the
    library's bytes, this does (the bytes both gates ran)."""
    function: str

    @classmethod
    def from_json(cls, doc: Json) -> DsoPin:
        return cls(*_file(doc), doc["function"])

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "function": self.function}


@dataclass(frozen=True)
class SelectionPin(FilePin):
    """The selection file and the fields of it the verdicts rest on, which verify compares with
    the file's: the binding id, the graph it was made on, its ABI and that ABI's hash, and every
    slot the verdicts cover (ID, or ID:INSTANCE for many instances of one recipe)."""
    binding_id: str
    graph_fingerprint: str
    abi: Json
    abi_sha256: str
    slots: tuple[str, ...]

    @classmethod
    def from_json(cls, doc: Json) -> SelectionPin:
        return cls(*_file(doc), doc["binding_id"], doc["graph_fingerprint"], doc["abi"],
                   doc["abi_sha256"], tuple(doc["slots"]))

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "binding_id": self.binding_id,
                "graph_fingerprint": self.graph_fingerprint, "abi": dict(self.abi),
                "abi_sha256": self.abi_sha256, "slots": list(self.slots)}


@dataclass(frozen=True)
class ReportPin(FilePin):
    """A gate's JSON report, its verdict and message (a receipt holds only passes), and the
    gate's other report files (Markdown, JUnit XML, the perf plot), each as its gate pinned
    it."""
    verdict: Verdict
    message: str
    files: tuple[FilePin, ...]

    @classmethod
    def from_json(cls, doc: Json) -> ReportPin:
        return cls(*_file(doc), Verdict(doc["verdict"]), doc["message"],
                   tuple(FilePin.from_json(f) for f in doc["files"]))

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "verdict": self.verdict.value, "message": self.message,
                "files": [f.to_json() for f in self.files]}


@dataclass(frozen=True)
class GatePins:
    """Both gates' reports, and the device and engine mode the spec's gates name (`mode` None:
    the device's default, also for a receipt that does not say); verify resolves both on the
    machine it runs on."""
    correctness: ReportPin
    perf: ReportPin
    device: str
    mode: str | None

    def by_gate(self) -> dict[str, ReportPin]:
        """Each gate's report pin by the gate's name, correctness first."""
        return {"correctness": self.correctness, "perf": self.perf}

    @classmethod
    def from_json(cls, doc: Json) -> GatePins:
        return cls(ReportPin.from_json(doc["correctness"]), ReportPin.from_json(doc["perf"]),
                   doc["device"], doc.get("mode"))

    def to_json(self) -> dict[str, Any]:
        return {**{gate: pin.to_json() for gate, pin in self.by_gate().items()},
                "device": self.device, "mode": self.mode}


@dataclass(frozen=True)
class BundlePins:
    """The manifests of both bundles (each file of a bundle is reached through its manifest's
    content digests)."""
    native: FilePin
    slot: FilePin

    def by_kind(self) -> dict[str, FilePin]:
        """Each bundle's manifest pin by the bundle's kind, native first."""
        return {"native": self.native, "slot": self.slot}

    @classmethod
    def from_json(cls, doc: Json) -> BundlePins:
        return cls(FilePin.from_json(doc["native"]), FilePin.from_json(doc["slot"]))

    def to_json(self) -> dict[str, Any]:
        return {kind: pin.to_json() for kind, pin in self.by_kind().items()}


@dataclass(frozen=True)
class LedgerPin:
    """The promotion's line in the spec's ledger: the ledger's path and the line's sha256
    (without its newline). The ledger grows after the promotion, so the file has no size or
    digest to pin."""
    path: str
    sha256: str

    @classmethod
    def from_json(cls, doc: Json) -> LedgerPin:
        return cls(doc["path"], doc["sha256"])

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256}


@dataclass(frozen=True)
class PromotionReceipt:
    """A promotion receipt's fields as the promotion schema names them; every path is relative
    to the spec folder, which `spec_folder` names relative to the receipt's own folder. `graph`
    and `ledger` are None only for a receipt made outside the pipeline. The environment stays the
    JSON record it is (pipeline/gates/environment.py writes it): verify compares it field by
    field with this machine's, whatever fields either holds."""
    name: str
    spec_folder: str
    spec: SpecPin
    kernel_sources: tuple[FilePin, ...]
    dso: DsoPin
    binding_manifest: FilePin
    graph: FilePin | None
    selection: SelectionPin
    bundles: BundlePins
    gates: GatePins
    environment: Json
    ledger: LedgerPin | None = None

    @classmethod
    def from_json(cls, doc: Json) -> PromotionReceipt:
        """The receipt a schema-valid document (`read`) holds."""
        graph, ledger = doc["graph"], doc["ledger"]
        return cls(name=doc["name"], spec_folder=doc["spec_folder"],
                   spec=SpecPin.from_json(doc["spec"]),
                   kernel_sources=tuple(FilePin.from_json(s) for s in doc["kernel_sources"]),
                   dso=DsoPin.from_json(doc["dso"]),
                   binding_manifest=FilePin.from_json(doc["binding_manifest"]),
                   graph=None if graph is None else FilePin.from_json(graph),
                   selection=SelectionPin.from_json(doc["selection"]),
                   bundles=BundlePins.from_json(doc["bundles"]), gates=GatePins.from_json(doc["gates"]),
                   environment=doc["environment"],
                   ledger=None if ledger is None else LedgerPin.from_json(ledger))

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> PromotionReceipt:
        return cls.from_json(jsonio.read_json(path, SCHEMA))

    def to_json(self) -> dict[str, Any]:
        """The receipt as its file holds it, checked against the promotion schema: a UserError
        names the field at fault."""
        doc = {"schema_version": SCHEMA_VERSION, "name": self.name, "spec_folder": self.spec_folder,
               "spec": self.spec.to_json(), "kernel_sources": [s.to_json() for s in self.kernel_sources],
               "dso": self.dso.to_json(), "binding_manifest": self.binding_manifest.to_json(),
               "graph": None if self.graph is None else self.graph.to_json(),
               "selection": self.selection.to_json(), "bundles": self.bundles.to_json(),
               "gates": self.gates.to_json(), "environment": dict(self.environment),
               "ledger": None if self.ledger is None else self.ledger.to_json()}
        jsonio.validate(doc, SCHEMA, f"promotion receipt of {self.name}")
        return doc

    def pins(self) -> list[tuple[str, FilePin]]:
        """(what, pin) of every file the receipt pins by digest itself (bundle contents and the
        gates' other report files are reached through these)."""
        return [("spec", self.spec),
                *((f"kernel source {i}", s) for i, s in enumerate(self.kernel_sources)),
                ("dso", self.dso), ("binding manifest", self.binding_manifest),
                *([("graph", self.graph)] if self.graph is not None else []),
                ("selection", self.selection),
                *((f"{kind} bundle manifest", pin) for kind, pin in self.bundles.by_kind().items()),
                *((f"{gate} report", pin) for gate, pin in self.gates.by_gate().items())]

