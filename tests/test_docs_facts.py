"""Facts the docs state that the code decides: read from both, so a page cannot drift from the
code. The formats table of docs/architecture.md against the schemas and the writers' versions."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _formats() -> list[tuple[str, list[str], int | None]]:
    """(file, schemas, version) per row of the page's "Files and their formats" table."""
    section = ARCHITECTURE.read_text().split("## Files and their formats")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and
            not line.startswith(("| file ", "| ---"))]
    out = []
    for row in rows:
        file, schemas, version = [c.strip() for c in row.strip("|").split("|")]
        out.append((file, re.findall(r"`([a-z_]+)`", schemas),
                    None if version == "—" else int(version)))
    return out


def _schema_versions(schema: dict) -> set[int]:
    """Every `schema_version` const a schema holds, at any depth (a report's kinds each have one)."""
    found: set[int] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            version = node.get("properties", {}).get("schema_version", {})
            if isinstance(version, dict) and "const" in version:
                found.add(version["const"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(schema)
    return found


def test_the_formats_table_names_each_schema_at_its_version():
    formats = _formats()
    assert len(formats) >= 10, formats
    for file, schemas, version in formats:
        assert schemas, file
        main = json.loads((ROOT / "schemas" / f"{schemas[0]}.schema.json").read_text())
        assert _schema_versions(main) == (set() if version is None else {version}), (file, schemas)
        for other in schemas[1:]:
            assert (ROOT / "schemas" / f"{other}.schema.json").is_file(), other


def test_the_writers_write_the_versions_the_table_states():
    from pipeline.gates import promotion, reports
    from pipeline.graph import select, snapshot
    versions = {schemas[0]: version for _, schemas, version in _formats()}
    assert versions["promotion"] == promotion.SCHEMA_VERSION
    assert versions["gate_report"] == reports.REPORT_VERSION
    assert versions["graph"] == snapshot.SCHEMA_VERSION
    assert versions["selection"] == versions["selection_set"] == select.SCHEMA_VERSION


def test_every_schema_is_in_the_table_or_read_from_outside():
    """A schema of a file trtmc writes is in the table; the rest describe inputs it reads."""
    inputs = {"hf_config", "safetensors_header", "safetensors_index", "intoto_statement"}
    named = {s for _, schemas, _ in _formats() for s in schemas}
    on_disk = {p.name.removesuffix(".schema.json") for p in (ROOT / "schemas").glob("*.schema.json")}
    assert on_disk - inputs == named - inputs and named <= on_disk, (on_disk, named)


FIGURE = re.compile(r"(\d[\d,]*(?:\.\d+)?)( tokens/s| ms| µs| s\b|x\b|%| TB/s| GB/s)")


def _measured() -> set[str]:
    return set(re.findall(r"\d[\d,]*(?:\.\d+)?", (ROOT / "docs" / "performance.md").read_text()))


def test_the_readmes_figures_are_the_performance_pages():
    """Every figure with a unit in the README's summary of GPU results is a number written the
    same way in docs/performance.md, where it has its table, command and raw file."""
    readme = (ROOT / "README.md").read_text()
    summary = readme.split("measured. In short:")[1].split("\nDocs:")[0]
    stated = {n for n, _ in FIGURE.findall(summary)}
    assert len(stated) >= 10 and stated <= _measured(), sorted(stated - _measured())


def test_the_kernel_guide_states_no_figure_of_its_own():
    guide = (ROOT / "examples" / "byok" / "README.md").read_text()
    stated = {n for n, _ in FIGURE.findall(guide)}
    assert stated <= _measured(), sorted(stated - _measured())


def test_the_flashinfer_table_is_its_raw_file():
    """Each region timing of the FlashInfer table is the stream timing of its raw file, rounded as
    shown: a re-measured file with an unchanged table fails here."""
    data = ROOT / "docs" / "data" / "h100-flashinfer-2026-12-06"
    raw = json.loads((data / "gpu_attention_flashinfer.json").read_text())
    page = (ROOT / "docs" / "performance.md").read_text()
    table = page.split("## FlashInfer's decode kernel beside ours")[1].split("\n## ")[0]
    rows = {int(m.group(1).replace(",", "")): m.group(2) for m in
            re.finditer(r"^\| ([\d,]+) keys[^|]*\|(.*)$", table, re.M)}
    for timed in raw["stream_timing"]:
        row = rows[timed["context"]]
        for column in ("native", "triton (runtime)", "kernel", "flashinfer"):
            assert f"{timed[column]['us_per_call']:.2f}" in row, (timed["context"], column, row)
    assert f"{raw['copy_bandwidth']['bytes_per_s'] / 1e12:.2f} TB/s" in table


def test_the_roofline_method_is_the_codes():
    """The copy roofline as docs/performance.md describes it: the sizes, repeats, warm-ups,
    headroom and the CPU copy are pipeline/gates/roofline.py's constants."""
    from pipeline.gates import roofline as r
    text = " ".join((ROOT / "docs" / "performance.md").read_text().split("**The copy roofline**")[1]
                    .split("\n\n")[0].split())
    sizes = [n // r.GIB for n in r.CUDA_SIZES]
    assert f"copies of {', '.join(map(str, sizes[:-1]))} and {sizes[-1]} GiB" in text
    assert f"timed {r.REPEATS['cuda']} times with CUDA events after {r.WARMUP} warm-up" in text
    assert f"{r.HEADROOM_BYTES // r.MIB} MiB of headroom" in text
    assert f"{r.CPU_SIZES[0] // r.MIB} MiB host copy (median of {r.REPEATS['cpu']})" in text
    pipeline_page = " ".join((ROOT / "docs" / "pipeline.md").read_text().split())
    assert f"the best of {', '.join(map(str, sizes[:-1]))} and {sizes[-1]} GiB device copies" in \
        pipeline_page


def test_the_stage_table_is_the_stage_table():
    """docs/pipeline.md's table of stages lists the stages the code runs, in their order."""
    from pipeline.flow.stages import BY_NAME
    page = (ROOT / "docs" / "pipeline.md").read_text()
    table = page.split("| stage | reads | writes (doit target) |")[1].split("\n\n")[0]
    listed = re.findall(r"^\| `([a-z_]+)` \|", table, re.M)
    assert listed == list(BY_NAME), listed


def _section(title: str) -> str:
    return (ROOT / "docs" / "performance.md").read_text().split(f"## {title}")[1].split("\n## ")[0]


def test_the_kernel_host_gpu_tables_are_their_raw_files():
    """The kernel host's GPU stage times, the flow after the clock fix and the production medians
    are the raw files' figures, as shown: a file re-measured without its table fails here."""
    data = ROOT / "docs" / "data" / "h100-kernel-host-gates-2026-12-06"
    section = _section("What the kernel host costs")
    stages = {(version, stage): seconds for version, stage, seconds in re.findall(
        r"^(new|old) 1 (\w+):\S+\s+([\d.]+) s", (data / "gatecost.txt").read_text(), re.M)}
    assert len(stages) == 8, stages
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (\w+) \|(.*)$", section, re.M)}
    for (version, stage), seconds in stages.items():
        cells = [c.strip() for c in rows[stage].split("|")]
        assert cells[0 if version == "new" else 1].startswith(seconds), (version, stage, cells)
    after = (data / "after-fix" / "summary.txt").read_text()
    for stage, seconds in re.findall(r"^(\w+):\S+\s+([\d.]+) s", after, re.M):
        assert f"{stage} {seconds}" in section.replace("\n", " "), (stage, seconds)
    medians: dict[str, list[float]] = {}
    for line in (data / "prod_medians.jsonl").read_text().splitlines():
        row = json.loads(line)
        medians.setdefault(row["arm"], []).append(row["median"])
    for arm, shown in (("hosted", "hosted"), ("in_process", "in process"), ("native", "native")):
        values = sorted(medians[arm])
        expected = (f"| {shown} | {values[len(values) // 2]:,.0f} | {values[0]:,.0f}, "
                    f"{values[-1]:,.0f} |")
        assert expected in section, expected


def test_the_channel_table_is_its_raw_file():
    runs = [json.loads(line) for line in (ROOT / "docs" / "data" / "cpu-host-channel-2026-12-06" /
                                          "runs.jsonl").read_text().splitlines()]
    section = _section("What the kernel host costs")
    for code, row in (("new", "| 1 MiB pipes"), ("old", "| 64 KiB pipes")):
        seconds = sorted(r["median_s"] for r in runs if r["code"] == code)
        rates = sorted(r["gb_per_s"] for r in runs if r["code"] == code)
        line = next(line for line in section.splitlines() if line.startswith(row))
        assert (f"| {seconds[1]:.3f} ({seconds[0]:.3f}, {seconds[-1]:.3f}) | {rates[1]:.2f} |"
                in line), line
