"""History of gate runs: one JSON line per gate run and per promotion in `<spec output>/ledger.jsonl`,
rendered as a table and a trend plot, each run checked against the last promoted one.

A regression: the perf median ratio lower than the promoted run's by more than the promoted
interval's width (a shift the promoted measurement itself could not explain), or correctness
failing where the promoted run passed.

The lines are a chain: each carries the sha256 of the line before it (`previous`, null on the
first), and a promotion receipt pins its own line, so a line edited, removed or inserted before a
promotion breaks the chain or the pin, and `read` (every reader: `gate history`, `gate verify`)
refuses a broken chain. Lines cut off after the last promotion leave an intact chain; a signed
receipt (pipeline/gates/signing.py) is what ties a ledger to the job that wrote it.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
from dataclasses import dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.families.workloads import of_kind
from pipeline.files import read_regular, shown
from pipeline.gates.report_types import GateReport
from pipeline.gates.reports import figure, png

FILE = "ledger.jsonl"
SCHEMA = "ledger_entry"
# history reads every line (about 0.2 ms each): two lines a gated run, so years of CI runs fit
MAX_LEDGER_LINES = 20_000
MAX_LEDGER_BYTES = 32 << 20


def figures(report: GateReport) -> dict:
    """The key figures of a gate report, what a trend needs."""
    if report.aborted is not None:
        return {"aborted": report.aborted.how}
    if report.perf is not None:
        p = report.perf
        s, cfg = p.summary, p.settings
        return {"median_ratio": s.median_ratio, "ci_low": s.ci_low, "ci_high": s.ci_high,
                "threshold": cfg.threshold, "trials": cfg.trials, "stopped_at": cfg.stopped_at,
                "outputs_match": None if p.outputs is None else p.outputs.passed,
                "kernel_roofline_fraction": [r.kernel_roofline_fraction for r in p.regions],
                "slots": [r.binding_id for r in p.regions],
                "predicted_ratio": s.predicted_ratio}
    c = report.correctness
    assert c is not None
    cases = c.cases
    out = {"probe_passed": c.probe_passed,
           "failed_checks": [f for s in c.probe_slots for f in s.failed_checks],
           "cases": len(cases), "failed_cases": sum(not case.passed for case in cases),
           "slots": [s.binding_id for s in c.probe_slots],
           "bisection_slot": None if c.bisection is None else c.bisection.get("slot")}
    return out | of_kind(c.kind).ledger_figures(cases)


@dataclass(frozen=True)
class LedgerEntry:
    """One line: a gate run (`event` correctness or perf) or a promotion, with the key figures
    (`figures`: a gate's, or a promotion's per gate) and where it ran; `previous` chains it to
    the line before (set by `append`)."""
    time: str
    event: str
    name: str
    binding_id: str
    abi_sha256: str
    environment: Mapping[str, Any]
    verdict: str
    passed: bool
    figures: Mapping[str, Any]
    previous: str | None = None

    @classmethod
    def now(cls, event: str, *, name: str, binding_id: str, abi_sha256: str,
            environment: Mapping[str, Any], verdict: str, passed: bool,
            figures: Mapping[str, Any]) -> LedgerEntry:
        return cls(datetime.now(timezone.utc).isoformat(timespec="seconds"), event, name,
                   binding_id, abi_sha256, environment, verdict, passed, figures)

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> LedgerEntry:
        """A line already read as schema `ledger_entry`."""
        return cls(**{f.name: record[f.name] for f in fields(cls)})

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def perf(self) -> Mapping[str, Any] | None:
        """The perf figures it holds (its own, or a promotion's), or None."""
        return self.figures.get("perf") if self.event == "promote" else \
            self.figures if self.event == "perf" else None


@dataclass(frozen=True)
class HistoryRow:
    """A line of the history, with why it regresses against the last promotion before it."""
    entry: LedgerEntry
    regression: str | None

    def to_json(self) -> dict[str, Any]:
        return {**self.entry.to_json(), "regression": self.regression}


def digest(line: bytes) -> str:
    """What the next line's `previous` holds: the sha256 of a line's bytes, without its newline."""
    return hashlib.sha256(line).hexdigest()


def _last_line(fd: int) -> bytes | None:
    """The file's last non-blank line, read backwards from its end in blocks."""
    end = os.fstat(fd).st_size
    tail, at = b"", end
    while at > 0:
        step = min(1 << 16, at)
        at -= step
        tail = os.pread(fd, step, at) + tail
        lines = [line for line in tail.splitlines() if line.strip()]
        if len(lines) > 1 or (lines and at == 0):
            return lines[-1]
        if end - at > MAX_LEDGER_BYTES:
            break
    return None


def append(path, record: LedgerEntry) -> None:
    """One line chained to the last one, written with a single O_APPEND write under an exclusive
    lock of the file, so stages appending at once neither mix lines nor chain to the same one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        last = _last_line(fd)
        line = replace(record, previous=None if last is None else digest(last)).to_json()
        jsonio.validate(line, SCHEMA, path)
        os.write(fd, jsonio.dumps(line, human=False) + b"\n")
    finally:
        os.close(fd)  # the lock goes with it


def read(path) -> list[LedgerEntry]:
    """Every line, each read as strictly as a JSON file (schema `ledger_entry`), the chain
    checked: a line whose `previous` is not the digest of the line before it is refused."""
    path = Path(path)
    if not os.path.lexists(path):
        raise UserError(f"{shown(path)}: no ledger (a gate run appends to {FILE} in the spec's "
                        f"output folder)")
    data = read_regular(path, MAX_LEDGER_BYTES, "pipeline.gates.ledger.MAX_LEDGER_BYTES")
    lines = data.splitlines()
    if len(lines) > MAX_LEDGER_LINES:
        raise UserError(f"{shown(path)}: {len(lines)} lines, more than the limit of "
                        f"{MAX_LEDGER_LINES} (pipeline.gates.ledger.MAX_LEDGER_LINES); move the "
                        f"older lines to another file")
    records, before = [], None
    for i, line in enumerate(lines, 1):
        if line.strip():
            where = f"{shown(path)}:{i}"
            records.append(LedgerEntry.from_json(jsonio.parse_json(line, SCHEMA, where)))
            _check_link(records[-1], before, where)
            _check_interval(records[-1], where)
            before = line
    return records


def _check_link(record: LedgerEntry, before: bytes | None, where: str) -> None:
    want = None if before is None else digest(before)
    if record.previous != want:
        raise UserError(f"{where}: $.previous: the chain breaks here: "
                        + (f"expected the sha256 of the line before ({want[:12]})" if want else
                           "expected null on the first line")
                        + f", found {str(record.previous)[:12]} (a line before it was edited, "
                          f"removed or inserted)")


def _check_interval(record: LedgerEntry, where: str) -> None:
    """A perf interval holds its median (what the table and the plot's error bars assume)."""
    perf, at = record.perf, "$.figures.perf" if record.event == "promote" else "$.figures"
    if perf is None or "aborted" in perf:  # an aborted run has no interval
        return
    if not perf["ci_low"] <= perf["median_ratio"] <= perf["ci_high"]:
        raise UserError(f"{where}: {at}: the interval [{perf['ci_low']}, {perf['ci_high']}] "
                        f"does not hold median_ratio {perf['median_ratio']} (expected ci_low <= "
                        f"median_ratio <= ci_high)")


def regression(record: LedgerEntry, promoted: LedgerEntry) -> str | None:
    """Why `record` regresses against the `promoted` entry, or None."""
    if record.event in ("perf", "correctness") and "aborted" in record.figures:
        return f"{record.event} gate aborted ({record.figures['aborted']})"
    if record.event == "perf":
        p, f = promoted.figures["perf"], record.figures
        width = p["ci_high"] - p["ci_low"]
        if f["median_ratio"] < p["median_ratio"] - width:
            return (f"perf median ratio {f['median_ratio']:.3f} < promoted {p['median_ratio']:.3f} "
                    f"- its interval width {width:.3f}")
    if record.event == "correctness" and not record.passed:
        return "correctness fails (it passed when promoted)"
    return None


def history(records: list[LedgerEntry]) -> list[HistoryRow]:
    """Every record with why it regresses (or None) against the last promotion before it."""
    promoted: LedgerEntry | None = None
    rows = []
    for r in records:
        flag = regression(r, promoted) if promoted is not None and r.event != "promote" else None
        promoted = r if r.event == "promote" else promoted
        rows.append(HistoryRow(r, flag))
    return rows


def _summary(r: LedgerEntry) -> str:
    f = r.figures
    if "aborted" in f:
        return f"aborted ({f['aborted']})"
    if r.event == "perf":
        return f"ratio {f['median_ratio']:.3f} [{f['ci_low']:.3f}, {f['ci_high']:.3f}] n={f['trials']}"
    if r.event == "promote":
        return f"perf ratio {f['perf']['median_ratio']:.3f}"
    checks = ",".join(f["failed_checks"]) or "probe ok"
    return f"{f['cases'] - f['failed_cases']}/{f['cases']} cases, {checks}"


def _cell(value) -> str:
    """A table cell from a ledger's text: one line of printable characters (escaped as repr
    writes them otherwise: a line break, a terminal escape), no column break of its own."""
    text = str(value)
    text = text if text.isprintable() else repr(text)[1:-1]
    return text.replace("\\", "\\\\").replace("|", "\\|")


def table(rows: list[HistoryRow]) -> str:
    """Markdown table: one row per record, newest last."""
    lines = ["| # | time | event | verdict | figures | abi | device | regression |",
             "| - | - | - | - | - | - | - | - |"]
    for i, row in enumerate(rows):
        r, env = row.entry, row.entry.environment
        cells = [i, r.time, r.event, r.verdict, _summary(r), r.abi_sha256[:12],
                 env.get("gpu") or env.get("cpu"), row.regression or ""]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[HistoryRow]) -> bytes:
    """PNG: perf median ratio and interval per run (promotions starred, regressions red), the
    threshold, and correctness pass/fail."""
    fig = figure(figsize=(7, 5))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    perf = [(i, row) for i, row in enumerate(rows)
            if row.entry.event == "perf" and "aborted" not in row.entry.figures]
    for i, row in perf:
        f = row.entry.figures
        top.errorbar([i], [f["median_ratio"]], [[f["median_ratio"] - f["ci_low"]],
                                                [f["ci_high"] - f["median_ratio"]]],
                     fmt="o", color="red" if row.regression else "C0", capsize=3)
    if perf:
        top.axhline(perf[-1][1].entry.figures["threshold"], color="red", ls="--", label="threshold")
    promoted = [(i, row.entry.figures["perf"]["median_ratio"]) for i, row in enumerate(rows)
                if row.entry.event == "promote"]
    if promoted:
        top.plot(*zip(*promoted), "*", ms=12, color="gold", label="promoted")
    top.set_ylabel("external / native")
    if perf or promoted:
        top.legend(loc="best")
    corr = [(i, 1 if row.entry.passed else 0) for i, row in enumerate(rows)
            if row.entry.event == "correctness"]
    if corr:
        bottom.plot(*zip(*corr), "s", color="C2")
    bottom.set_yticks([0, 1], ["fail", "pass"])
    bottom.set_xlabel("run")
    bottom.set_ylabel("correctness")
    # a name is shown as written: `$` would start matplotlib's math text
    fig.suptitle(f"gate history: {shown(rows[-1].entry.name) if rows else ''}", parse_math=False)
    return png(fig)


def load(path) -> list[HistoryRow]:
    """The ledger at `path` as history rows."""
    return history(read(path))


def latest_regressions(rows: list[HistoryRow]) -> list[str]:
    """The regressions of the latest run of each gate (what a CI job fails on)."""
    latest = {row.entry.event: row for row in rows if row.entry.event != "promote"}
    return [row.regression for row in latest.values() if row.regression]
