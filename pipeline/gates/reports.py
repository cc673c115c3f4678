"""Gate reports: JSON (schema'd, every trial), a Markdown summary (+ PNG plot for perf), JUnit XML.

`write_reports` writes the JSON last, so a report JSON on disk means the whole set is there.
"""
from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from pathlib import Path

from pipeline import jsonio
from pipeline.files import atomic_write_bytes

SCHEMA = "gate_report"


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def markdown(report: dict, plot_name: str | None = None) -> str:
    lines = [f"# {report['gate']} gate: {report['name']}", "",
             f"**Verdict: {report['verdict'].upper()}**: {report['message']}", ""]
    if report["gate"] == "correctness":
        probe = report["probe"]
        if probe is not None:
            lines += [f"Region probe: {'pass' if probe['passed'] else 'FAIL'} (max |diff| "
                      f"{_fmt(probe['max_abs_diff'])}, tolerance {_fmt(probe['tolerance'])})", ""]
        if report["kind"] == "encoder":
            t = report["thresholds"]
            lines += [f"Thresholds: max |diff| <= {t['max_abs_diff']}, cosine >= {t['min_cosine']}", "",
                      "| # | input | max abs diff | cosine | result |", "| - | - | - | - | - |"]
            lines += [f"| {c['index']} | {c['input'][:40]} | {_fmt(c['max_abs_diff'])} | "
                      f"{_fmt(c['cosine'])} | {'pass' if c['passed'] else 'FAIL ' + c['detail']} |"
                      for c in report["cases"]]
        else:
            lines += ["| # | prompt | tokens | result |", "| - | - | - | - |"]
            lines += [f"| {c['index']} | {c['input'][:40]} | {len(c['native_tokens'])} | "
                      f"{'pass' if c['passed'] else 'FAIL ' + c['detail']} |" for c in report["cases"]]
    else:
        s, cfg = report["summary"], report["settings"]
        lines += ["| quantity | value |", "| - | - |",
                  f"| median external/native throughput ratio | {s['median_ratio']:.4f} |",
                  f"| {cfg['confidence']:.0%} bootstrap interval | [{s['ci_low']:.4f}, {s['ci_high']:.4f}] |",
                  f"| threshold | {cfg['threshold']} |",
                  f"| native median throughput | {s['native_median_throughput']:.4g} {cfg['unit']}/s |",
                  f"| external median throughput | {s['external_median_throughput']:.4g} {cfg['unit']}/s |",
                  f"| trials / warm-up / timer | {cfg['trials']} / {cfg['warmup']} / {cfg['timer']} |",
                  f"| bootstrap resamples / seed | {cfg['resamples']} / {cfg['seed']} |", ""]
        if plot_name:
            lines += [f"![trials]({plot_name})", ""]
    return "\n".join(lines) + "\n"


def junit_xml(report: dict) -> bytes:
    """One testsuite; a testcase per text/prompt (+ the probe) or one for the perf verdict."""
    suite = ET.Element("testsuite", name=f"trtmc.{report['gate']}.{report['name']}")
    cases = []
    if report["gate"] == "correctness":
        if report["probe"] is not None:
            p = report["probe"]
            cases.append(("region_probe", p["passed"], f"max |diff| {_fmt(p['max_abs_diff'])} > "
                                                        f"tolerance {_fmt(p['tolerance'])}"))
        cases += [(f"case_{c['index']}", c["passed"], c["detail"] or "outside thresholds")
                  for c in report["cases"]]
    else:
        cases.append(("perf_ratio", report["passed"], report["message"]))
    for name, passed, why in cases:
        case = ET.SubElement(suite, "testcase", classname=f"trtmc.{report['gate']}", name=name)
        if not passed:
            ET.SubElement(case, "failure", message=why, type=report["verdict"])
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(sum(1 for _, ok, _ in cases if not ok)))
    buf = io.BytesIO()
    ET.ElementTree(suite).write(buf, encoding="utf-8", xml_declaration=True)
    return buf.getvalue()


def plot_trials(report: dict) -> bytes:
    """PNG: per-trial throughput of both sides and the ratio against the threshold."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    trials = report["trials"]
    x = [t["trial"] for t in trials]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(x, [t["native_throughput"] for t in trials], "o-", ms=3, label="native")
    top.plot(x, [t["external_throughput"] for t in trials], "s-", ms=3, label="external")
    top.set_ylabel(f"{report['settings']['unit']}/s")
    top.legend()
    bottom.plot(x, [t["ratio"] for t in trials], "o", ms=3, label="ratio")
    s = report["summary"]
    bottom.axhspan(s["ci_low"], s["ci_high"], alpha=0.3, label=f"{report['settings']['confidence']:.0%} interval of the median")
    bottom.axhline(report["settings"]["threshold"], color="red", ls="--", label="threshold")
    bottom.set_xlabel("trial")
    bottom.set_ylabel("external / native")
    bottom.legend()
    fig.suptitle(f"perf gate {report['name']}: {report['verdict']}")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return buf.getvalue()


def write_reports(report: dict, out_dir, stem: str | None = None) -> dict[str, Path]:
    """Write stem.{md,xml[,png]} then stem.json (validated); -> paths by kind."""
    out_dir = Path(out_dir)
    stem = stem or report["gate"]
    jsonio.validate(report, SCHEMA, out_dir / f"{stem}.json")
    paths = {}
    plot_name = None
    if report["gate"] == "perf":
        paths["png"] = atomic_write_bytes(out_dir / f"{stem}.png", plot_trials(report))
        plot_name = paths["png"].name
    paths["md"] = atomic_write_bytes(out_dir / f"{stem}.md", markdown(report, plot_name).encode())
    paths["xml"] = atomic_write_bytes(out_dir / f"{stem}.xml", junit_xml(report))
    paths["json"] = jsonio.write_json(out_dir / f"{stem}.json", report, SCHEMA)
    return paths
