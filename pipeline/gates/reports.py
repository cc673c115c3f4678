"""Gate reports: JSON (schema'd, every trial and probe call), a Markdown summary (+ PNG plot for
perf), JUnit XML that CI tools show: one classname per spec (`trtmc.NAME`), a `time` per case, and
the reason with its figures as the text of each <failure>.

`write_reports` writes the JSON last, so a report JSON on disk means the whole set is there. The
files hold the report as JSON reads it back (a non-finite figure is null).
"""
from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Mapping, Sequence

import orjson

from pipeline import jsonio
from pipeline.families.workloads import of_kind
from pipeline.files import atomic_write_bytes
from pipeline.gates.report_types import REPORT_VERSION as REPORT_VERSION
from pipeline.gates.report_types import (SCHEMA, Aborted, CorrectnessSections, GateReport,
                                         PerfSections, ProbeReport, RegionTiming, Shadow,
                                         ShadowCall, TestedKernel)
from pipeline.gates.roofline import Roofline
from pipeline.gates.verdict import Verdict


def figure(**kwargs):
    """A matplotlib Figure drawn by the Agg canvas: no display, no pyplot (whose import and
    global figure registry a PNG written once does not need)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _verdict(passed) -> str:
    return "not run" if passed is None else "pass" if passed else "FAIL"


# -- Markdown -----------------------------------------------------------------------------------
def _probe_md(probe: ProbeReport) -> list[str]:
    lines = [f"## Region probe ({probe.device}, seed {probe.seed})", ""]
    for s in probe.slots:
        lines += [f"### {s.binding_id} ({s.engine_role}, {s.dtype}): {_verdict(s.passed)}", "",
                  f"Per element |got - expected| <= atol + rtol * |expected| with atol {s.atol:g}, "
                  f"rtol {s.rtol:g}; {len(s.calls)} calls over cases "
                  f"{sorted({c['case'] for c in s.calls})} in a drawn order, fresh seeded "
                  f"inputs each, the output filled before each call with a drawn fill (a NaN "
                  f"payload, random values or the previous output).", ""]
        lines += [f"Note: {n}" for n in s.notes] + ([""] if s.notes else [])
        lines += ["| check | result | evidence |", "| - | - | - |"]
        lines += [f"| {c.name} | {_verdict(c.passed)} | {c.evidence} |" for c in s.checks]
        lines.append("")
    return lines


def describe(call: ShadowCall) -> str:
    """One failing shadowed slot call (runtime/shadow.py) in words."""
    parts, ratio = [], call.max_error_ratio  # None: infinite (an exact dtype differed)
    if ratio is None or ratio > 1.0:
        parts.append(f"max |diff| {_fmt(call.max_abs_diff)} ("
                     f"{'infinitely' if ratio is None else f'{ratio:.3g}x'} the allowed error)")
    if call.non_finite:
        parts.append(f"{call.non_finite} NaN/Inf where native is finite")
    if call.inputs_changed:
        parts.append(f"{call.inputs_changed} input elements changed")
    shapes = ", ".join(str(list(s)) for s in call.input_shapes)
    return (f"item {call.item}, slot call {call.call} of '{call.binding_id}' (inputs "
            f"{shapes}): " + "; ".join(parts))


def _shadow_md(shadow: Shadow) -> list[str]:
    worst = shadow.worst
    lines = ["## Shadow execution", "",
             f"Every slot call of the end-to-end runs was also computed by the native region on a "
             f"copy of its inputs and compared: {shadow.calls_checked} calls checked "
             f"({', '.join(map(str, shadow.per_item))} per item), {shadow.calls_failed} "
             f"failed: {_verdict(shadow.passed)}.", ""]
    if shadow.first_failure:
        lines += [f"First failing call: {describe(shadow.first_failure)}", ""]
    if worst:
        lines += [f"Worst call: item {worst.item}, call {worst.call}, max |diff| "
                  f"{_fmt(worst.max_abs_diff)}, {_fmt(worst.max_error_ratio)} of the allowed "
                  f"error.", ""]
    return lines


def _drift_md(drift: Mapping) -> list[str]:
    lines = ["## Drift per instance", "",
             f"Item {drift['item']} teacher-forced in the {drift['mode']} mode, once with every slot "
             f"on its native region and once with every slot on its kernel: each slot's outputs "
             f"against the same calls' native outputs (errors of earlier slots compound here).", "",
             "| slot | calls | max abs diff | relative | worst call | non-finite calls |",
             "| - | - | - | - | - | - |"]
    lines += [f"| {s['slot']} | {s['calls']} | {_fmt(s['max_abs_diff'])} | {_fmt(s['relative'])} | "
              f"{s['worst_call']} | {s['non_finite_calls']} |" for s in drift["slots"]]
    return lines + [f"Note: {n}" for n in drift["notes"]] + [""]


def _correctness_md(c: CorrectnessSections) -> list[str]:
    lines = _shadow_md(c.shadow) if c.shadow is not None else []
    lines += _probe_md(c.probe) if c.probe is not None else []
    lines += _drift_md(c.instance_drift) if c.instance_drift is not None else []
    lines += ["## End to end", ""]
    return lines + of_kind(c.kind).markdown(c.thresholds, c.cases, _fmt)


def roofline_share(region: RegionTiming) -> str:
    """A region's share of its memory roofline: GPU timings only (a CPU runs the region
    cache-resident, so a DRAM roofline share would read as nonsense, over 100%)."""
    if region.timer != "cuda_events":
        return "no roofline on a CPU"
    return f"{region.kernel_roofline_fraction:.1%} of roofline"


def _roofline_md(roofline: Roofline | None) -> list[str]:
    """The copy roofline's figure and method, printed once (nothing for a report without one)."""
    if roofline is None:
        return []
    return [f"Copy roofline: {roofline.bytes_per_s / 1e9:.1f} GB/s ({roofline.method}).", ""]


def _perf_md(p: PerfSections, plot_name: str | None) -> list[str]:
    s, cfg, out = p.summary, p.settings, p.outputs
    lines = ["| quantity | value |", "| - | - |",
             f"| median external/native throughput ratio | {s.median_ratio:.4f} |",
             f"| {cfg.confidence:.0%} bootstrap interval | [{s.ci_low:.4f}, {s.ci_high:.4f}] |",
             f"| threshold | {cfg.threshold} |",
             f"| predicted from the region timings (Amdahl) | "
             f"{'n/a' if s.predicted_ratio is None else format(s.predicted_ratio, '.4f')} |",
             f"| native median throughput | {s.native_median_throughput:.4g} {cfg.unit}/s |",
             f"| external median throughput | {s.external_median_throughput:.4g} {cfg.unit}/s |",
             *([f"| native median throughput before the kernel's library was loaded; native and "
                f"external beside it over that | {s.native_alone_median_throughput:.4g} "
                f"{cfg.unit}/s; {s.native_beside_over_alone:.4f}, "
                f"{s.external_over_alone:.4f} |"] if s.native_alone_median_throughput is not None
               else []),
             *([f"| CPU cores kept busy, native / external (threads given: "
                f"{cfg.cpu_threads}) | {s.native_cpu_cores:.2f} / "
                f"{s.external_cpu_cores:.2f} |"] if cfg.cpu_threads is not None
               and s.external_cpu_cores is not None else []),
             f"| trials run / cap / warm-up / timer | {cfg.trials} / {cfg.max_trials} / "
             f"{cfg.warmup} / {cfg.timer} |",
             f"| early stop | {cfg.stop_reason} |",
             f"| bootstrap resamples / seed | {cfg.resamples} / {cfg.seed} |",
             f"| timed outputs vs native | {'n/a' if out is None else _verdict(out.passed)}"
             f"{'' if out is None else ': ' + out.detail} |", "",
             f"Early stop: from trial {cfg.min_trials}, every {cfg.check_every} trials, the "
             f"trials end once the interval lies wholly at or above the threshold (pass) or wholly "
             f"below it (fail); at most {cfg.max_trials} trials.", ""]
    if p.regions:
        lines += ["## The region alone", "",
                  "Native region vs bound kernel at the typical shapes, each run as the engine "
                  "runs it (eager, or compiled and replayed from a CUDA graph), inputs re-randomized "
                  "every trial; bytes = every boundary input and the output once; floor = bytes / "
                  "the bandwidth of a large copy measured in the same run.", "",
                  *_roofline_md(p.roofline),
                  "| slot | case | engine | bytes | native median | kernel median | kernel speedup | "
                  "bandwidth | floor | kernel % of roofline |", "| - | - | - | - | - | - | - | - | - | - |"]
        lines += [f"| {r.binding_id} | {r.case} | {r.engine} | {r.bytes} | "
                  f"{r.native_median_s * 1e6:.2f} us | "
                  f"{r.kernel_median_s * 1e6:.2f} us | {r.kernel_speedup:.3f}x | "
                  f"{r.bandwidth_bytes_per_s / 1e9:.1f} GB/s | {r.floor_s * 1e6:.2f} us | "
                  f"{roofline_share(r)} |" for r in p.regions]
        lines.append("")
    if plot_name:
        lines += [f"![trials]({plot_name})", ""]
    return lines


def markdown(report: GateReport, plot_name: str | None = None) -> str:
    lines = [f"# {report.gate} gate: {report.name}", "",
             f"**Verdict: {report.verdict.upper()}**: {report.message}", ""]
    if isinstance(report.sections, Aborted):
        lines += ["The gate's worker did not finish, so no figure was measured.", ""]
    elif isinstance(report.sections, CorrectnessSections):
        lines += _correctness_md(report.sections)
    else:
        lines += _perf_md(report.sections, plot_name)
    return "\n".join(lines) + "\n"


# -- JUnit --------------------------------------------------------------------------------------
def _cases(report: GateReport) -> list[tuple[str, bool, str, str, float]]:
    """(name, passed, failure message, failure text, seconds) per testcase."""
    sections = report.sections
    if isinstance(sections, Aborted):
        return [("worker", False, report.message, report.message, 0.0)]
    if isinstance(sections, PerfSections):
        s, cfg, out = sections.summary, sections.settings, sections.outputs
        figures = "\n".join([f"median ratio {s.median_ratio:.4f}, {cfg.confidence:.0%} interval "
                             f"[{s.ci_low:.4f}, {s.ci_high:.4f}], threshold {cfg.threshold}",
                             f"trials {cfg.trials} of at most {cfg.max_trials} ({cfg.stop_reason})",
                             *(f"region {r.binding_id}: kernel {r.kernel_median_s * 1e6:.2f} us, "
                               f"native {r.native_median_s * 1e6:.2f} us, {roofline_share(r)}"
                               for r in sections.regions)])
        seconds = sum(t.native_s + t.external_s for t in sections.trials)
        cases = [("perf_ratio", s.interval_verdict == Verdict.PASS, report.message, figures, seconds)]
        if out is not None:
            cases.append(("timed_outputs_match", out.passed, out.detail, out.detail, 0.0))
        return cases
    cases = []
    shadow = sections.shadow
    if shadow is not None:
        first = shadow.first_failure
        cases.append(("shadow_execution", shadow.passed,
                      f"{shadow.calls_failed} of {shadow.calls_checked} slot calls differ",
                      "" if first is None else describe(first), 0.0))
    for slot in sections.probe_slots:
        failed = [c for c in slot.checks if c.passed is False]
        cases.append((f"region_probe[{slot.binding_id}]", slot.passed,
                      f"failed checks: {', '.join(c.name for c in failed)}",
                      "\n".join([f"{c.name}: {c.evidence}" for c in failed] +
                                [f"tolerance: atol {slot.atol:g} + rtol {slot.rtol:g} * |expected|"]),
                      slot.seconds))
    workload = of_kind(sections.kind)
    for c in sections.cases:
        cases.append((f"case_{c.index}", c.passed, c.detail or "outside thresholds",
                      workload.junit_text(c, sections.thresholds, _fmt), c.seconds))
    return cases


def junit_xml(report: GateReport) -> bytes:
    """One testsuite per gate report; testcases of classname trtmc.NAME."""
    cases = _cases(report)
    suite = ET.Element("testsuite", name=f"trtmc.{report.name}.{report.gate}",
                       tests=str(len(cases)), failures=str(sum(1 for c in cases if not c[1])),
                       time=f"{sum(c[4] for c in cases):.3f}")
    for name, passed, message, text, seconds in cases:
        case = ET.SubElement(suite, "testcase", classname=f"trtmc.{report.name}",
                             name=f"{report.gate}.{name}", time=f"{seconds:.3f}")
        if not passed:
            ET.SubElement(case, "failure", message=message, type=report.verdict.value).text = text
    buf = io.BytesIO()
    ET.ElementTree(suite).write(buf, encoding="utf-8", xml_declaration=True)
    return buf.getvalue()


# -- plot and files -----------------------------------------------------------------------------
def plot_trials(report: GateReport, perf: PerfSections) -> bytes:
    """PNG: per-trial throughput of both sides (`perf`: the report's sections) and the ratio
    against the threshold."""
    from matplotlib.ticker import MaxNLocator
    trials = perf.trials
    x = [t.trial for t in trials]
    fig = figure(figsize=(7, 5))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(x, [t.native_throughput for t in trials], "o-", ms=3, label="native")
    top.plot(x, [t.external_throughput for t in trials], "s-", ms=3, label="external")
    top.set_ylabel(f"{perf.settings.unit}/s")
    top.legend()
    bottom.plot(x, [t.ratio for t in trials], "o", ms=3, label="ratio")
    s = perf.summary
    bottom.axhspan(s.ci_low, s.ci_high, alpha=0.3,
                   label=f"{perf.settings.confidence:.0%} interval of the median")
    bottom.axhline(perf.settings.threshold, color="red", ls="--", label="threshold")
    bottom.set_xlabel("trial")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))  # trials are counted, not measured
    bottom.set_ylabel("external / native")
    bottom.legend()
    fig.suptitle(f"perf gate {report.name}: {report.verdict}")
    return png(fig)


def aborted_report(gate: str, name: str, error,
                   kernels: Sequence[TestedKernel] = ()) -> GateReport:
    """The report of a gate whose worker ended before its verdict (`error`: KernelAborted),
    checked against the schema."""
    report = GateReport(gate, name, Verdict.FAIL, str(error), tuple(kernels),
                        Aborted(error.how, error.status, error.where))
    report.to_json()
    return report


def write_reports(report: dict | GateReport, out_dir, stem: str | None = None) -> dict[str, Path]:
    """Write stem.{md,xml[,png]} then stem.json (validated); -> paths by kind. The Markdown,
    JUnit and plot are drawn from the report as its JSON file reads back."""
    out_dir = Path(out_dir)
    doc = report.as_dict() if isinstance(report, GateReport) else report
    stem = stem or doc["gate"]
    written: dict = orjson.loads(jsonio.dumps(doc, human=False))  # as the file will read back
    jsonio.validate(written, SCHEMA, out_dir / f"{stem}.json")
    typed = GateReport.from_json(written)
    paths = {}
    plot_name = None
    if typed.perf is not None:
        paths["png"] = atomic_write_bytes(out_dir / f"{stem}.png", plot_trials(typed, typed.perf))
        plot_name = paths["png"].name
    paths["md"] = atomic_write_bytes(out_dir / f"{stem}.md", markdown(typed, plot_name).encode())
    paths["xml"] = atomic_write_bytes(out_dir / f"{stem}.xml", junit_xml(typed))
    paths["json"] = jsonio.write_json(out_dir / f"{stem}.json", written, SCHEMA)
    return paths
