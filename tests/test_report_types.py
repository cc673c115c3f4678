"""Gate reports as typed data (pipeline/gates/report_types.py): every recorded report of the
current schema version reads back as the same JSON, byte for byte once written; the verdict is a
str Enum that writes as its string; an aborted report round-trips; `read_report` refuses what the
schema refuses. All run on a CPU, without models."""
from __future__ import annotations

import gzip
from pathlib import Path

import orjson
import pytest

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.gates.report_types import (REPORT_VERSION, Aborted, CorrectnessSections,
                                         GateReport, PerfSections, read_report)
from pipeline.gates.reports import aborted_report, write_reports
from pipeline.gates.verdict import Verdict

ROOT = Path(__file__).resolve().parent.parent


def _recorded() -> list[tuple[Path, dict]]:
    """The raw gate reports under docs/data of the schema version the writers write now."""
    out = []
    for path in sorted((ROOT / "docs" / "data").rglob("*.json*")):
        if not path.name.startswith(("correctness", "perf")) or \
                path.name.endswith(".md") or not path.name.endswith((".json", ".json.gz")):
            continue
        data = path.read_bytes()
        doc = orjson.loads(gzip.decompress(data) if path.name.endswith(".gz") else data)
        if isinstance(doc, dict) and doc.get("schema_version") == REPORT_VERSION:
            out.append((path, doc))
    return out


RECORDED = _recorded()


def test_there_are_recorded_reports_of_both_gates():
    assert {doc["gate"] for _, doc in RECORDED} == {"correctness", "perf"}


@pytest.mark.parametrize("path, doc", RECORDED, ids=[str(p.relative_to(ROOT)) for p, _ in RECORDED])
def test_a_recorded_report_reads_back_as_the_same_json(path, doc):
    jsonio.validate(doc, "gate_report", path)
    report = GateReport.from_json(doc)
    assert isinstance(report.sections, PerfSections if doc["gate"] == "perf" else CorrectnessSections)
    assert report.to_json() == doc
    assert jsonio.dumps(report.to_json()) == jsonio.dumps(doc)
    assert report.passed is doc["passed"] and report.verdict == doc["verdict"]


def test_read_report_reads_a_written_report(tmp_path):
    path, doc = next((p, d) for p, d in RECORDED if d["gate"] == "perf")
    at = jsonio.write_json(tmp_path / "perf.json", doc, "gate_report")
    report = read_report(at)
    assert report.perf is not None and report.correctness is None and report.aborted is None
    assert report.perf.summary.median_ratio == doc["summary"]["median_ratio"]
    assert report.perf.settings.threshold == doc["settings"]["threshold"]
    assert report.to_json() == doc


def test_read_report_refuses_what_the_schema_refuses(tmp_path):
    _, doc = next((p, d) for p, d in RECORDED if d["gate"] == "correctness")
    at = tmp_path / "correctness.json"
    at.write_bytes(orjson.dumps({**doc, "verdict": "PASS"}))
    with pytest.raises(UserError, match=r"correctness.json: .*expected a valid gate_report"):
        read_report(at)
    # schema-valid, but passed says otherwise than the verdict
    at.write_bytes(orjson.dumps({**doc, "verdict": "fail"}))
    with pytest.raises(UserError, match=r"correctness.json: \$\.passed"):
        read_report(at)


def test_the_verdict_writes_as_its_string():
    assert [v.value for v in Verdict] == ["pass", "fail", "inconclusive"]
    assert orjson.dumps({"v": Verdict.INCONCLUSIVE}) == b'{"v":"inconclusive"}'
    assert jsonio.dumps([Verdict.PASS]) == jsonio.dumps(["pass"])
    assert f"{Verdict.FAIL}" == "fail" and Verdict.PASS.upper() == "PASS"
    assert Verdict("fail") is Verdict.FAIL


class _Aborted(Exception):
    how, status, where = "signal", 9, "perf gate"


def test_an_aborted_report_round_trips(tmp_path):
    report = aborted_report("perf", "demo", _Aborted("killed by signal 9"))
    assert report.aborted == Aborted("signal", 9, "perf gate")
    doc = report.to_json()
    assert doc == {"schema_version": REPORT_VERSION, "gate": "perf", "name": "demo",
                   "passed": False, "verdict": "fail", "message": "killed by signal 9",
                   "kernels": [], "aborted": {"how": "signal", "status": 9, "where": "perf gate"}}
    assert GateReport.from_json(doc) == report
    paths = write_reports(report, tmp_path)
    assert "png" not in paths
    assert read_report(paths["json"]) == report
