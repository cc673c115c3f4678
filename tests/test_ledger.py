"""The gate ledger: one line per gate run and promotion, the history table and plot, regressions
against the last promoted run, and `trtmc gate history`'s exit status. Runs on a CPU."""
from __future__ import annotations

import orjson
import pytest

from pipeline.errors import UserError
from pipeline.gates import correctness as c
from pipeline.gates import ledger
from pipeline.gates import performance as p
from pipeline.gates.report_types import GateReport, Trial
from pipeline.gates.settings import PerfSettings

ENV = {"gpu": None, "cpu": "test cpu"}


def _perf(median: float, half_width: float = 0.01) -> dict:
    trials = tuple(Trial(i, "native", 0.01, 0.01 / r, 100.0, 100.0 * r, r)
                   for i, r in enumerate([median - half_width, median, median + half_width] * 3))
    return p.perf_report("t", p.Measurement("perf_counter", 1, 0, trials), PerfSettings(threshold=0.9))


def _correctness(same: bool) -> dict:
    return c.correctness_report("t", c.compare_decoder([[1, 2]], [[1, 2 if same else 3]], ["p"]), None)


def _record(path, event: str, report: dict | None = None, figures: dict | None = None) -> None:
    ledger.append(path, ledger.LedgerEntry.now(
        event, name="t", binding_id="b", abi_sha256="a" * 64, environment=ENV,
        verdict="pass" if report is None else report["verdict"],
        passed=True if report is None else report["passed"],
        figures=figures if figures is not None else _figures(report)))


def _figures(report: dict) -> dict:
    return ledger.figures(GateReport.from_json(report))


def test_each_run_is_one_line_with_its_key_figures(tmp_path):
    path = tmp_path / ledger.FILE
    _record(path, "perf", _perf(1.0))
    _record(path, "correctness", _correctness(True))
    lines = path.read_bytes().splitlines()
    assert len(lines) == 2 and all(orjson.loads(line)["abi_sha256"] == "a" * 64 for line in lines)
    perf, corr = ledger.read(path)
    assert perf.figures["median_ratio"] == pytest.approx(1.0) and perf.figures["threshold"] == 0.9
    assert corr.figures == {"probe_passed": None, "failed_checks": [], "cases": 1,
                               "failed_cases": 0, "max_abs_logit_diff": None, "max_kl": None,
                               "slots": [], "bisection_slot": None}
    assert perf.figures["slots"] == [r["binding_id"] for r in _perf(1.0)["regions"]]
    assert perf.time.endswith("+00:00") and perf.environment == ENV


def test_regressions_are_flagged_against_the_last_promoted_run(tmp_path):
    path = tmp_path / ledger.FILE
    promoted = _perf(1.0)
    _record(path, "perf", promoted)
    _record(path, "correctness", _correctness(True))
    _record(path, "promote", figures={"perf": _figures(promoted),
                                      "correctness": _figures(_correctness(True))})
    _record(path, "perf", _perf(0.995))   # within the promoted interval's width: no flag
    _record(path, "perf", _perf(0.95))    # lower by more than the width (0.02)
    _record(path, "correctness", _correctness(False))
    rows = ledger.load(path)
    assert [r.regression is not None for r in rows] == [False, False, False, False, True, True]
    assert rows[4].regression.startswith("perf median ratio 0.950 < promoted 1.000")
    assert "correctness fails" in rows[5].regression
    assert len(ledger.latest_regressions(rows)) == 2
    table = ledger.table(rows)
    assert table.count("\n") == 8 and "| promote |" in table and "aaaaaaaaaaaa" in table
    assert ledger.plot(rows)[:8] == b"\x89PNG\r\n\x1a\n"


def test_history_command_prints_plots_and_fails_on_a_latest_regression(tmp_path, capsys):
    from pipeline.cli import main
    path = tmp_path / ledger.FILE
    promoted = _perf(1.0)
    _record(path, "promote", figures={"perf": _figures(promoted),
                                         "correctness": _figures(_correctness(True))})
    _record(path, "perf", _perf(0.9))
    png = tmp_path / "h.png"
    assert main(["gate", "history", str(path), "--plot", str(png)]) == 1
    assert "perf median ratio 0.900" in capsys.readouterr().out and png.read_bytes()[:4] == b"\x89PNG"
    _record(path, "perf", _perf(1.0))  # the latest perf run recovered
    assert main(["gate", "history", str(path), "--json"]) == 0
    rows = orjson.loads(capsys.readouterr().out)
    assert [r["regression"] is None for r in rows] == [True, False, True]
    with pytest.raises(UserError, match="no ledger"):
        ledger.read(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("line, needle", [
    (b"[1, 2]", ":2: $: [1, 2] is not of type 'object'"),
    (b"{}", ":2: $: 'time' is a required property"),
    (b'{"passed": false, "passed": true}', ':2: duplicate key "passed"'),
    (b"{", ":2: not valid JSON"),
    (orjson.dumps({**orjson.loads(b'{}'), "time": "t", "event": "perf", "name": "t", "binding_id": "b",
                   "abi_sha256": "a" * 64, "environment": {}, "verdict": "pass", "passed": True,
                   "figures": {"median_ratio": None, "ci_low": 1.0, "ci_high": 1.0, "threshold": 0.9,
                               "trials": 3, "stopped_at": None, "outputs_match": True,
                               "kernel_roofline_fraction": []}, "previous": None}),
     ":2: $.figures.median_ratio: None is not of type 'number'"),
])
def test_a_ledger_line_is_read_as_strictly_as_a_json_file(tmp_path, line, needle):
    """Before: a wrong shape was a traceback (TypeError, KeyError), and a repeated key kept its
    last value."""
    path = tmp_path / ledger.FILE
    _record(path, "perf", _perf(1.0))
    with path.open("ab") as f:
        f.write(line + b"\n")
    with pytest.raises(UserError) as e:
        ledger.read(path)
    assert str(e.value).startswith(f"{path}{needle}") and "\n" not in str(e.value), str(e.value)


def test_a_name_or_time_with_markup_or_line_breaks_stays_in_its_cell(tmp_path, capsys):
    """Before: a `$` in a name crashed the plot after the table was printed (matplotlib math
    text), and a line break in a field added a forged table row."""
    from pipeline.cli import main
    path = tmp_path / ledger.FILE
    _record(path, "perf", _perf(1.0))
    line = orjson.loads(path.read_bytes())
    line.update(name="a$\\frac{x$", time="2026-12-01\n| 9 | forged")
    path.write_bytes(orjson.dumps(line) + b"\n")
    png = tmp_path / "h.png"
    assert main(["gate", "history", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 3 and "2026-12-01\\\\n\\| 9 \\| forged" in out, out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_ledger_is_a_chain_that_refuses_an_edited_removed_or_inserted_line(tmp_path, capsys):
    from pipeline.cli import main
    path = tmp_path / ledger.FILE
    for median in (1.0, 1.1, 1.2):
        _record(path, "perf", _perf(median))
    lines = path.read_bytes().splitlines()
    assert orjson.loads(lines[0])["previous"] is None
    assert [orjson.loads(x)["previous"] for x in lines[1:]] == [ledger.digest(x) for x in lines[:2]]
    assert len(ledger.read(path)) == 3
    edited = orjson.loads(lines[0])
    edited["figures"]["median_ratio"] = 1.005  # a failed run rewritten, still a valid line
    for forged, broken_at in ([orjson.dumps(edited), *lines[1:]], 2), (lines[1:], 1), \
            ([lines[0], lines[0], *lines[1:]], 2):
        path.write_bytes(b"\n".join(forged) + b"\n")
        with pytest.raises(UserError, match=rf"{path}:{broken_at}: \$\.previous: the chain breaks"):
            ledger.read(path)
        assert main(["gate", "history", str(path)]) == 2
        assert "the chain breaks" in capsys.readouterr().err


def test_lines_appended_at_once_chain_one_after_another(tmp_path):
    import threading
    path = tmp_path / ledger.FILE
    threads = [threading.Thread(target=_record, args=(path, "perf", _perf(1.0))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ledger.read(path)) == 8
