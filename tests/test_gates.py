"""Gates library without models: statistics, verdicts, comparisons, reports, spec loading."""
from __future__ import annotations

import time
import xml.etree.ElementTree as ET

import orjson
import pytest
import torch

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.gates import correctness as c
from pipeline.gates import performance as p
from pipeline.gates import reports, stats
from pipeline.flow.spec import DEFAULT_SPEC, load_spec


def _measurement(ratios):
    """Synthetic trials with the given external/native ratios (native 10 ms)."""
    trials = [{"trial": i, "first": "native" if i % 2 == 0 else "external", "native_s": 0.01,
               "external_s": 0.01 / r, "native_throughput": 100.0, "external_throughput": 100.0 * r,
               "ratio": r} for i, r in enumerate(ratios)]
    return {"timer": "perf_counter", "items_per_call": 1, "warmup": 0, "trials": trials}


def test_bootstrap_is_seeded_and_brackets_the_median():
    data = (1.0 + 0.02 * torch.randn(41, generator=torch.Generator().manual_seed(0))).tolist()
    a = stats.bootstrap_median_ci(data, seed=3)
    assert a == stats.bootstrap_median_ci(data, seed=3)
    lo, hi = a
    assert lo < sorted(data)[20] < hi


@pytest.mark.parametrize("ci,verdict", [((0.99, 1.02), "pass"), ((0.98, 0.99), "pass"),
                                        ((0.90, 0.979), "fail"), ((0.97, 1.01), "inconclusive")])
def test_verdict_needs_the_whole_interval(ci, verdict):
    assert stats.verdict(ci, 0.98) == verdict


def test_perf_report_verdicts_and_advice():
    fast = p.perf_report("x", _measurement([1.0, 1.01, 0.995, 1.02, 1.0, 0.999, 1.005, 1.01]))
    slow = p.perf_report("x", _measurement([0.5, 0.52, 0.49, 0.51, 0.5, 0.5]))
    noisy = p.perf_report("x", _measurement([0.7, 1.3, 0.8, 1.2, 0.9, 1.1, 1.0, 0.95]))
    assert (fast["verdict"], fast["passed"]) == ("pass", True)
    assert (slow["verdict"], slow["passed"]) == ("fail", False)
    assert (noisy["verdict"], noisy["passed"]) == ("inconclusive", False)
    assert "repeat on an idle machine" in noisy["message"]
    assert len(slow["trials"]) == 6 and slow["summary"]["ci_high"] < 0.98


def test_measure_alternating_records_every_trial_and_alternates():
    calls = []
    m = p.measure_alternating(lambda: calls.append("n"), lambda: (calls.append("e"), time.sleep(0.002)),
                              trials=6, warmup=2)
    assert calls[:4] == ["n", "e", "n", "e"]                          # warm-up
    assert [t["first"] for t in m["trials"]] == ["native", "external"] * 3
    assert calls[4:8] == ["n", "e", "e", "n"]
    assert len(m["trials"]) == 6 and m["timer"] == "perf_counter"
    assert all(t["ratio"] == pytest.approx(t["native_s"] / t["external_s"]) for t in m["trials"])
    assert p.perf_report("x", m)["verdict"] == "fail"                   # +2 ms on a no-op


def test_encoder_comparison_uses_max_diff_and_cosine():
    a = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    close = [t + 0.001 for t in a]
    far = [a[0], a[1] + 0.5, -a[2]]
    ok = c.correctness_report("x", c.compare_encoder(a, close, ["a", "b", "c"]), None)
    bad = c.correctness_report("x", c.compare_encoder(a, far, ["a", "b", "c"]), None)
    assert ok["passed"] and all(case["cosine"] > 0.999 for case in ok["cases"])
    assert not bad["passed"] and [x["passed"] for x in bad["cases"]] == [True, False, False]
    assert bad["cases"][2]["cosine"] == pytest.approx(-1.0)
    nan = c.compare_encoder([a[0]], [torch.full_like(a[0], float("nan"))], ["a"])
    assert not nan["cases"][0]["passed"] and "non-finite" in nan["cases"][0]["detail"]


def test_failed_probe_fails_the_gate_even_when_outputs_match():
    a = [torch.ones(2, 2)]
    probe = {"max_abs_diff": float("inf"), "tolerance": 0.01, "passed": False, "slots": []}
    rep = c.correctness_report("x", c.compare_encoder(a, a, ["t"]), probe)
    assert not rep["passed"] and "region probe failed" in rep["message"]


def test_decoder_comparison_is_exact():
    rep = c.compare_decoder([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]], ["p", "q"])
    assert [x["passed"] for x in rep["cases"]] == [True, False]
    assert "token 1" in rep["cases"][1]["detail"]
    assert not c.compare_decoder([[1, 2]], [[1, 2, 3]], ["p"])["cases"][0]["passed"]


def test_reports_are_schema_checked_and_complete(tmp_path):
    perf = p.perf_report("demo", _measurement([0.5, 0.51, 0.49, 0.5, 0.52]))
    paths = reports.write_reports(perf, tmp_path)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![trials](perf.png)" in paths["md"].read_text()
    assert len(jsonio.read_json(paths["json"], "gate_report")["trials"]) == 5
    suite = ET.parse(paths["xml"]).getroot()
    assert suite.get("failures") == "1" and suite.find("testcase/failure") is not None
    corr = c.correctness_report("demo", c.compare_decoder([[1]], [[1]], ["p"]), None)
    suite = ET.fromstring(reports.junit_xml(corr))
    assert suite.get("tests") == "1" and suite.get("failures") == "0"
    bad = dict(perf, verdict="maybe")
    with pytest.raises(UserError, match="perf.json"):
        reports.write_reports(bad, tmp_path)


def test_default_spec_loads():
    spec = load_spec(DEFAULT_SPEC)
    assert spec.name == "minilm_residual_add" and (spec.model_dir / "config.json").is_file()
    assert spec.kernel["source"].endswith("examples/byok/residual_add.cu")
    assert spec.gates["correctness"]["max_abs_diff"] == 0.02 and spec.gates["perf"]["threshold"] == 0.98


def _write_spec(tmp_path, **changes):
    raw = orjson.loads(DEFAULT_SPEC.read_bytes())
    raw["kernel"] = {"source": str(DEFAULT_SPEC.parent.parent / "byok" / "residual_add.cu")}
    raw.update(changes)
    path = tmp_path / "s.json"
    path.write_bytes(orjson.dumps(raw))
    return path


@pytest.mark.parametrize("changes,message", [
    ({"trials": 3}, r"s\.json: \$: Additional properties"),
    ({"gates": {"texts": []}}, r"s\.json: \$\.gates\.texts"),
    ({"gates": {}}, r"s\.json: \$\.gates: needs 'texts'"),
    ({"kernel": {"source": "missing.cu"}}, r"s\.json: \$\.kernel\.source: .*missing\.cu is not a file"),
    ({"model": {"package": "no_such_package_x", "path": "m"}}, r"\$\.model\.package: 'no_such_package_x'"),
    ({"model": "nowhere"}, r"\$\.model: .*nowhere has no config\.json"),
])
def test_spec_errors_name_file_and_json_path(tmp_path, changes, message):
    with pytest.raises(UserError, match=message):
        load_spec(_write_spec(tmp_path, **changes))
