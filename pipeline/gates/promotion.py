"""The promotion receipt: written only when both gate reports on disk say pass, pinning by digest
every file the verdicts were reached with."""
from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.files import sha256_file
from pipeline.gates.reports import SCHEMA as REPORT_SCHEMA

SCHEMA = "promotion"
GATES = ("correctness", "perf")
VERSIONED_PACKAGES = ("trtmc", "torch", "tensorrt", "tensorrt-rtx-cu13", "apache-tvm-ffi", "doit",
                      "numpy", "transformers", "safetensors")


def pinned(path: Path) -> dict:
    return {"path": str(path), "sha256": sha256_file(path)}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in VERSIONED_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def promote(path: Path, *, name: str, spec_path: Path, spec_content: dict, dso: Path,
            function: str, bindings: Path, selection: Path, native_bundle: Path,
            slot_bundle: Path, reports: Path) -> dict:
    """Write the receipt at `path` (refused unless every gate report passed) and return it."""
    gates = {}
    for gate in GATES:
        report_path = reports / f"{gate}.json"
        report = jsonio.read_json(report_path, REPORT_SCHEMA)
        if not report["passed"]:
            raise UserError(f"{report_path}: the {gate} gate did not pass ({report['message']}); "
                            f"nothing is promoted")
        gates[gate] = {**pinned(report_path), "verdict": report["verdict"], "message": report["message"]}
    receipt = jsonio.read_json(selection, "selection")
    doc = {
        "schema_version": 1, "name": name,
        "spec": {**pinned(spec_path), "content": spec_content},
        "dso": {**pinned(dso), "function": function},
        "binding_manifest": pinned(bindings),
        "selection": {**pinned(selection), "binding_id": receipt["binding_id"],
                      "graph_fingerprint": receipt["graph_fingerprint"], "abi": receipt["abi"],
                      "abi_sha256": receipt["abi_sha256"]},
        "bundles": {"native": pinned(native_bundle / "manifest.json"),
                    "slot": pinned(slot_bundle / "manifest.json")},
        "gates": gates, "versions": versions(),
    }
    jsonio.write_json(path, doc, SCHEMA)
    return doc
