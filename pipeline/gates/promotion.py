"""The promotion receipt: written only when both gate reports on disk say pass, pinning by digest
every file the verdicts were reached with, and the environment they were reached in.

Paths are relative to the spec file's folder, and the receipt records where that folder lies
relative to itself, so a tree moved elsewhere (spec, sources and outputs together) still verifies:
`verify` recomputes every digest and the ABI hash and states how the environment differs.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.files import sha256_file
from pipeline.gates.reports import SCHEMA as REPORT_SCHEMA

SCHEMA = "promotion"
SCHEMA_VERSION = 2
GATES = ("correctness", "perf")
VERSIONED_PACKAGES = ("trtmc", "torch", "tensorrt", "tensorrt-rtx-cu13", "apache-tvm-ffi", "doit",
                      "numpy", "transformers", "safetensors")


def versions() -> dict:
    out = {}
    for pkg in VERSIONED_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _cpu() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        model = None
    return model or platform.processor() or None


def _gpu() -> tuple[str | None, str | None]:
    """(name, driver version) of GPU 0, or (None, None) without one."""
    import torch
    if not torch.cuda.is_available():
        return None, None
    driver = None
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                               "-i", "0"], capture_output=True, text=True, timeout=30)
        if proc.returncode == 0 and proc.stdout.strip():
            driver = proc.stdout.strip()
    return torch.cuda.get_device_name(0), driver


def environment(bundle_manifest: dict) -> dict:
    """Where a verdict was reached. The TensorRT module and version come from the bundle manifest
    (the gates never import TensorRT); one that lacks them (a receipt re-verified against some
    other file, whose digest then differs too) gives None."""
    import torch
    gpu, driver = _gpu()
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": _cpu(),
            "gpu": gpu, "gpu_driver": driver, "cuda": torch.version.cuda, "torch": torch.__version__,
            "apache_tvm_ffi": versions()["apache-tvm-ffi"],
            "trt_module": bundle_manifest.get("trt_module"),
            "trt_version": bundle_manifest.get("trt_version"),
            "packages": versions()}


def _pinned(path: Path, base: Path) -> dict:
    return {"path": os.path.relpath(path, base), "sha256": sha256_file(path)}


def _require_tested(report_path: Path, gate: str, report: dict, dso: Path, digest: str) -> None:
    """A verdict stands for the bytes its gate loaded: the DSO to pin must be those bytes."""
    tested = {k["library_sha256"] for k in report["kernels"]}
    if digest not in tested:
        ran = ", ".join(f"{k['library']} (sha256 {k['library_sha256'][:12]})"
                        for k in report["kernels"]) or "no kernel"
        raise UserError(f"{report_path}: the {gate} gate ran {ran}, not {dso} as it is now "
                        f"(sha256 {digest[:12]}); re-run the gates; nothing is promoted")


def promote(path: Path, *, name: str, spec_path: Path, spec_content: dict, sources: list[Path],
            dso: Path, function: str, bindings: Path, selection: Path, native_bundle: Path,
            slot_bundle: Path, reports: Path) -> dict:
    """Write the receipt at `path` and return it; refused unless every gate report passed, on
    the bytes `dso` holds now."""
    base = spec_path.parent
    dso_sha256 = sha256_file(dso)  # hashed once: the bytes checked against the reports are pinned
    gates = {}
    for gate in GATES:
        report_path = reports / f"{gate}.json"
        report = jsonio.read_json(report_path, REPORT_SCHEMA)
        if not report["passed"]:
            raise UserError(f"{report_path}: the {gate} gate did not pass ({report['message']}); "
                            f"nothing is promoted")
        _require_tested(report_path, gate, report, dso, dso_sha256)
        gates[gate] = {**_pinned(report_path, base), "verdict": report["verdict"],
                       "message": report["message"]}
    receipt = jsonio.read_json(selection, "selection")
    slot_manifest = slot_bundle / "manifest.json"
    doc = {
        "schema_version": SCHEMA_VERSION, "name": name,
        "spec_folder": os.path.relpath(base, path.parent),
        "spec": {**_pinned(spec_path, base), "content": spec_content},
        "kernel_sources": [_pinned(s, base) for s in sources],
        "dso": {"path": os.path.relpath(dso, base), "sha256": dso_sha256, "function": function},
        "binding_manifest": _pinned(bindings, base),
        "selection": {**_pinned(selection, base), "binding_id": receipt["binding_id"],
                      "graph_fingerprint": receipt["graph_fingerprint"], "abi": receipt["abi"],
                      "abi_sha256": receipt["abi_sha256"]},
        "bundles": {"native": _pinned(native_bundle / "manifest.json", base),
                    "slot": _pinned(slot_manifest, base)},
        "gates": gates, "environment": environment(jsonio.read_json(slot_manifest, None)),
    }
    jsonio.write_json(path, doc, SCHEMA)
    return doc


def _files(doc: dict) -> list[tuple[str, dict]]:
    return [("spec", doc["spec"]), *((f"kernel source {i}", s) for i, s in enumerate(doc["kernel_sources"])),
            ("dso", doc["dso"]), ("binding manifest", doc["binding_manifest"]),
            ("selection", doc["selection"]), ("native bundle manifest", doc["bundles"]["native"]),
            ("slot bundle manifest", doc["bundles"]["slot"]),
            *((f"{g} report", doc["gates"][g]) for g in GATES)]


def _flat(env: dict) -> dict:
    return {**{k: v for k, v in env.items() if k != "packages"},
            **{f"packages.{k}": v for k, v in env.get("packages", {}).items()}}


def _readable(read):
    """`read()`, or None when the pinned file cannot be read as expected (missing, a folder, too
    long a name, not valid JSON): verify reports a difference there, not an error."""
    try:
        return read()
    except (OSError, UserError):
        return None


def verify(path) -> dict:
    """Re-check a receipt against the files on disk: every digest (paths relative to the spec
    folder the receipt names), the ABI hash re-derived from the selection on disk, and the
    environment now against the recorded one. `ok` when every digest and the ABI match."""
    from pipeline.graph.abi import abi_of, abi_sha256
    path = Path(path)
    doc = jsonio.read_json(path, SCHEMA)
    base = Path(os.path.realpath(path.parent / doc["spec_folder"]))  # a link loop: files differ
    files = []
    for what, pin in _files(doc):
        p = base / pin["path"]
        actual = _readable(lambda: sha256_file(p))
        files.append({"what": what, "path": str(p), "expected": pin["sha256"], "actual": actual,
                      "match": actual == pin["sha256"]})
    abi = {"expected": doc["selection"]["abi_sha256"], "actual": None}
    s = _readable(lambda: jsonio.read_json(base / doc["selection"]["path"], "selection"))
    if s is not None:
        abi["actual"] = abi_sha256(abi_of(s["inputs"], s["outputs"], s["workspace_bytes"],
                                          s["extra_args"], s["output_shape_like_input"]))
    abi["match"] = abi["actual"] == abi["expected"]
    manifest = _readable(lambda: jsonio.read_json(base / doc["bundles"]["slot"]["path"], None))
    now = {} if manifest is None else environment(manifest if isinstance(manifest, dict) else {})
    recorded, now = _flat(doc["environment"]), _flat(now)
    differences = [{"key": k, "recorded": recorded.get(k), "now": now.get(k)}
                   for k in sorted(set(recorded) | set(now)) if recorded.get(k) != now.get(k)]
    return {"receipt": str(path), "spec_folder": str(base), "files": files, "abi": abi,
            "environment_differences": differences,
            "ok": abi["match"] and all(f["match"] for f in files)}
