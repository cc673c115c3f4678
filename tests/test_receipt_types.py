"""Promotion receipts as typed data (pipeline/gates/receipt_types.py) and what verify finds
(pipeline/gates/verification.py): every recorded receipt of the current schema version reads back
as the same file, byte for byte, its pins typed; a receipt of an earlier version is refused; a
check writes the JSON `gate verify --json` has always printed. All run on a CPU, without models."""
from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.gates.receipt_types import SCHEMA_VERSION, FilePin, PromotionReceipt, ReportPin
from pipeline.gates.verdict import Verdict
from pipeline.gates.verification import Check, DigestCheck, Verification

ROOT = Path(__file__).resolve().parent.parent
RECORDED = sorted((ROOT / "docs" / "data").rglob("promotion*.json"))
CURRENT = [p for p in RECORDED if orjson.loads(p.read_bytes())["schema_version"] == SCHEMA_VERSION]
EARLIER = [p for p in RECORDED if p not in CURRENT]


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def test_there_are_recorded_receipts_of_the_current_version():
    assert len(CURRENT) >= 2, RECORDED


@pytest.mark.parametrize("path", CURRENT, ids=_ids(CURRENT))
def test_a_recorded_receipt_reads_back_as_the_same_file(path):
    receipt = PromotionReceipt.read(path)
    assert jsonio.dumps(receipt.to_json()) == path.read_bytes()  # as the promote stage wrote it
    assert receipt.to_json() == orjson.loads(path.read_bytes())
    assert PromotionReceipt.from_json(receipt.to_json()) == receipt
    pins = receipt.pins()
    assert all(isinstance(pin, FilePin) for _, pin in pins)
    assert [what for what, _ in pins][-4:] == ["native bundle manifest", "slot bundle manifest",
                                               "correctness report", "perf report"]
    for gate, pin in receipt.gates.by_gate().items():
        assert isinstance(pin, ReportPin) and pin.verdict is Verdict.PASS, gate
        assert pin.files and all(isinstance(f, FilePin) for f in pin.files), gate
    assert receipt.selection.slots and receipt.ledger is not None and receipt.graph is not None


@pytest.mark.parametrize("path", EARLIER, ids=_ids(EARLIER))
def test_a_receipt_of_an_earlier_version_is_refused(path):
    with pytest.raises(UserError, match="expected a valid promotion file"):
        PromotionReceipt.read(path)


def test_a_receipt_writes_its_keys_in_the_order_promote_makes_them():
    doc = PromotionReceipt.read(CURRENT[0]).to_json()
    assert list(doc) == ["schema_version", "name", "spec_folder", "spec", "kernel_sources", "dso",
                         "binding_manifest", "graph", "selection", "bundles", "gates",
                         "environment", "ledger"]
    assert list(doc["spec"]) == ["path", "size", "sha256", "content"]
    assert list(doc["dso"]) == ["path", "size", "sha256", "function"]
    assert list(doc["selection"]) == ["path", "size", "sha256", "binding_id", "graph_fingerprint",
                                      "abi", "abi_sha256", "slots"]
    assert list(doc["bundles"]) == ["native", "slot"]
    assert list(doc["gates"]) == ["correctness", "perf", "device", "mode"]
    assert list(doc["gates"]["perf"]) == ["path", "size", "sha256", "verdict", "message", "files"]
    assert list(doc["ledger"]) == ["path", "sha256"]


def test_a_check_writes_the_json_verify_has_always_printed():
    same = Check.of("dso", Path("/t/k.so"), True, "expected 0123456789ab, got ba9876543210")
    assert same.to_json() == {"what": "dso", "path": "/t/k.so", "match": True, "detail": None}
    differs = Check.of("ledger chain", "/t/ledger.jsonl", False, "line 2: not chained")
    assert differs.detail == "line 2: not chained" and differs.match is False
    digest = DigestCheck("dso", "/t/k.so", False, "expected aaaaaaaaaaaa, missing", "a" * 64, None,
                         "missing")
    assert list(digest.to_json().items()) == [
        ("what", "dso"), ("path", "/t/k.so"), ("match", False),
        ("detail", "expected aaaaaaaaaaaa, missing"), ("expected", "a" * 64), ("actual", None),
        ("problem", "missing")]
    result = Verification("r.json", "/t", (digest,), (), (), (same,), (), (), {
        "expected": "a" * 64, "actual": "a" * 64, "match": True}, (), (
            {"key": "cpu", "recorded": "A", "now": "B"},))
    assert not result.ok and result.first_difference() == \
        "dso (/t/k.so): expected aaaaaaaaaaaa, missing"
    doc = result.to_json()
    assert list(doc) == ["receipt", "spec_folder", "files", "report_files", "bundle_files",
                         "references", "policy", "signature", "environment_differences",
                         "environment_notes", "abi", "ok"]
    assert doc["files"] == [digest.to_json()] and doc["references"] == [same.to_json()]
    assert doc["environment_notes"] == [{"key": "cpu", "recorded": "A", "now": "B"}]
