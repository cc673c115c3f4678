"""Gate reports as typed data (pipeline/gates/report_types.py): every recorded report of the
current schema version reads back as the same JSON, byte for byte once written, and so does every
kind of report the gates write, its keys in the order they were written; the verdict is a str Enum
that writes as its string; an aborted report round-trips; `read_report` refuses what the schema
refuses. All run on a CPU, without models."""
from __future__ import annotations

import dataclasses
import gzip
from pathlib import Path

import orjson
import pytest

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.gates import correctness, performance
from pipeline.families.cases import (DecoderCase, DecoderThresholds, EncoderCase,
                                     EncoderThresholds)
from pipeline.gates.report_types import (REPORT_VERSION, Aborted, CorrectnessSections,
                                         GateReport, NativeAlone, PerfSections, ProbeReport,
                                         TestedKernel, read_report)
from pipeline.gates.reports import aborted_report, write_reports
from pipeline.gates.roofline import Roofline
from pipeline.gates.verdict import Verdict
from tests.test_gates import OK, _failed_probe, _measurement, _region

ROOT = Path(__file__).resolve().parent.parent


def _reports_in(doc, where: str) -> list[tuple[str, dict]]:
    """(JSON path, report) of every gate report of the current schema version in `doc`, itself
    or nested (a benchmark's record holds one per mode)."""
    if isinstance(doc, list):
        return [found for i, x in enumerate(doc) for found in _reports_in(x, f"{where}[{i}]")]
    if not isinstance(doc, dict):
        return []
    if doc.get("schema_version") == REPORT_VERSION and "gate" in doc:
        return [(where, doc)]
    return [found for k, x in doc.items() for found in _reports_in(x, f"{where}.{k}")]


def _recorded() -> list[tuple[str, dict]]:
    """The raw gate reports under docs/data of the schema version the writers write now, in any
    JSON file there, by file and JSON path."""
    out = []
    for path in sorted((ROOT / "docs" / "data").rglob("*.json*")):
        if not path.name.endswith((".json", ".json.gz")):
            continue
        data = path.read_bytes()
        doc = orjson.loads(gzip.decompress(data) if path.name.endswith(".gz") else data)
        out += [(f"{path.relative_to(ROOT)}{'' if at == '$' else at[1:]}", report)
                for at, report in _reports_in(doc, "$")]
    return out


RECORDED = _recorded()


def test_there_are_recorded_reports_of_both_gates():
    assert {doc["gate"] for _, doc in RECORDED} == {"correctness", "perf"}
    assert any(doc["gate"] == "perf" and "roofline" in doc and "native_alone" in doc
               for _, doc in RECORDED)
    assert any(doc["gate"] == "correctness" and doc["probe"] is not None for _, doc in RECORDED)


@pytest.mark.parametrize("path, doc", RECORDED, ids=[p for p, _ in RECORDED])
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


def _in_order(doc):
    """`doc` with every object as its (key, value) pairs, so that comparing two says whether
    they hold the same keys in the same order."""
    if isinstance(doc, dict):
        return [(k, _in_order(v)) for k, v in doc.items()]
    return [_in_order(v) for v in doc] if isinstance(doc, list) else doc


def _written_by_the_gates() -> dict[str, dict]:
    """The quick gate tests' reports (tests/test_gates.py), each kind with every part it may
    hold: trials with and without CPU seconds, regions on CUDA (host_enqueue_s) and on a CPU, a
    wrong region, the timed outputs, the native baseline, the copy roofline; a correctness report
    with its probe (checks run, failed and not run; a coverage; a non-finite figure) and shadow."""
    perf = performance.perf_report
    roofline = Roofline(1e10, "copies", (1 << 20,), (2e-4,), 3, "perf_counter", (1 << 30,))
    alone = NativeAlone("perf_counter", (0.008, 0.009), 101.9)
    probe = _failed_probe()
    probe = ProbeReport("cpu", 5, (dataclasses.replace(
        probe.slots[0], max_abs_diff=float("inf"),
        coverage={"dims": {"range": [1, 4], "lengths": 4, "every_length": True,
                           "residues": {"128": 0.5}}, "kv_length": None}),))
    shadow = {"calls_checked": 3, "calls_failed": 0, "slots_failed": [], "first_failure": None,
              "worst": None, "per_item": [3], "passed": True}
    return {
        "perf": perf("demo", _measurement([1.0, 1.01, 0.995, 1.0, 1.0])),
        "perf, every part": perf("demo", _measurement([0.99, 0.991, 0.989, 0.99], outputs=OK),
                                 regions=[_region(), _region(binding_id="b:1", timer="perf_counter",
                                                             host_enqueue_s=None)],
                                 roofline=roofline, alone=alone, unit="texts"),
        "perf on a CPU": perf("demo", _measurement([1.0, 1.01, 0.995, 1.02], cores=3.0),
                              cpu_threads=1),
        "perf, a wrong region": perf("demo", _measurement([1.0, 1.01]), regions=[_region(
            outputs=dataclasses.replace(_region().outputs, first_wrong_call=2))]),
        "correctness": correctness.correctness_report(
            "demo", correctness.compare_decoder([[1]], [[1]], ["p"]), probe, shadow=shadow,
            drift={"item": 0, "mode": "eager", "slots": [], "notes": []}),
        "correctness without a probe": correctness.correctness_report(
            "demo", correctness.compare_decoder([[1]], [[2]], ["p"]), None),
    }


@pytest.mark.parametrize("kind", list(_written_by_the_gates()))
def test_a_report_the_gates_write_reads_back_with_its_keys_in_order(kind, tmp_path):
    """As the gate writes it (a non-finite figure null), the schema holds it, and the typed
    report gives the same document back, its keys in the order they were written; its file reads
    back as the same report."""
    doc = orjson.loads(orjson.dumps(_written_by_the_gates()[kind]))  # in order, inf as null
    jsonio.validate(doc, "gate_report", kind)
    assert _in_order(GateReport.from_json(doc).to_json()) == _in_order(doc)
    paths = write_reports(doc, tmp_path)
    assert read_report(paths["json"]) == GateReport.from_json(doc)
    assert paths["json"].read_bytes() == jsonio.dumps(doc)


def test_a_probe_section_whose_verdict_is_not_its_slots_is_refused():
    doc = orjson.loads(orjson.dumps(_failed_probe().as_dict()))
    assert ProbeReport.from_json(doc) == _failed_probe()
    with pytest.raises(ValueError, match=r"\$\.probe\.passed: True"):
        ProbeReport.from_json({**doc, "passed": True})


def _typed_parts() -> dict[str, dict]:
    """Correctness reports with every typed part filled: an encoder's cases (one compared, one
    whose shapes differ, its figures null) and thresholds, a decoder's teacher-forced run that
    parts at a near tie, a shadow whose first failing and worst calls are set (one a folded row),
    and the kernels the gate ran."""
    import torch
    a = [torch.ones(4, 8), torch.ones(4, 8)]
    encoder = correctness.compare_encoder(a, [a[0] + 1e-4, torch.ones(3, 8)], ["x", "y"],
                                          seconds=[0.25, 0.5])
    native = [torch.tensor(r, dtype=torch.bfloat16) for r in ([3.0, 1.0], [2.0, 1.984375])]
    close = [torch.tensor(r, dtype=torch.bfloat16) for r in ([3.0, 1.0], [1.984375, 2.0])]
    decoder = correctness.compare_decoder([[0, 0]], [[0, 1]], ["p"], [(native, close)])
    call = {"item": 1, "call": 2, "binding_id": "b:0", "input_shapes": [[4, 8], [4, 8]],
            "max_error_ratio": 3.5, "max_abs_diff": 0.25, "non_finite": 0, "inputs_changed": 1,
            "passed": False}
    shadow = {"calls_checked": 9, "calls_failed": 1, "slots_failed": ["b:0"],
              "first_failure": call, "worst": {**call, "calls_folded": 4, "max_abs_diff": None},
              "per_item": [4, 5], "passed": False}
    kernels = [TestedKernel("b:0", "/k/kernel.so", "run", "a" * 64, "b" * 64)]
    return {"encoder": correctness.correctness_report("demo", encoder, None, kernels, shadow),
            "decoder": correctness.correctness_report("demo", decoder, None, kernels)}


@pytest.mark.parametrize("kind", list(_typed_parts()))
def test_the_typed_parts_of_a_correctness_report_read_back_with_their_keys_in_order(kind, tmp_path):
    doc = orjson.loads(orjson.dumps(_typed_parts()[kind]))
    jsonio.validate(doc, "gate_report", kind)
    report = GateReport.from_json(doc)
    assert _in_order(report.to_json()) == _in_order(doc)
    c = report.correctness
    assert c is not None and report.kernels[0].library_sha256 == "a" * 64
    if kind == "encoder":
        assert isinstance(c.thresholds, EncoderThresholds)
        ok, shapes = c.cases
        assert isinstance(ok, EncoderCase) and ok.passed and ok.seconds == 0.25
        assert isinstance(shapes, EncoderCase) and not shapes.passed and shapes.cosine is None
        assert c.shadow is not None and c.shadow.first_failure is not None
        assert c.shadow.first_failure.input_shapes == ((4, 8), (4, 8))
        assert c.shadow.worst is not None and c.shadow.worst.calls_folded == 4
    else:
        assert c.thresholds == DecoderThresholds(4)
        (case,) = c.cases
        assert isinstance(case, DecoderCase) and case.passed and case.teacher_forced is not None
        d = case.teacher_forced.divergence
        assert d is not None and d.step == 1 and d.near_tie and d.accepted
    paths = write_reports(doc, tmp_path)
    assert read_report(paths["json"]) == report
