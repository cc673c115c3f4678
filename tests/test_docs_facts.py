"""Facts the docs state that the code decides: read from both, so a page cannot drift from the
code. The formats table of docs/architecture.md against the schemas and the writers' versions."""
from __future__ import annotations

import gzip
import json
import re
import tarfile
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


def test_the_flashinfer_tables_are_their_raw_files():
    """Each region cell of the FlashInfer tables (H100 and H200) shows its file's stream timing, µs
    per call and share of the copy roofline, in order: a re-measured file with an unchanged table
    fails here."""
    sections = _sections()  # the H100 part ends where the H200 subsection begins
    arms = (("native", "triton (runtime)"), ("kernel",), ("flashinfer",))
    for title, folder in (("FlashInfer's decode kernel beside ours", "h100-flashinfer-2026-12-06"),
                          ("FlashInfer on an H200, capacity 40,960", "h200-flashinfer-2026-12-06")):
        raw = json.loads((DATA / folder / "gpu_attention_flashinfer.json").read_text())
        section = sections[title]
        for timed in raw["stream_timing"]:
            for cell, names in zip(_cells(section, f"{timed['context']:,} keys"), arms):
                expected = [figure for name in names for figure in
                            (timed[name]["us_per_call"], 100 * timed[name]["fraction_of_copy_bw"])
                            [:2 if "(" in cell else 1]]
                _assert_shows(_figures(cell), expected, (folder, timed["context"], cell))
        assert f"{raw['copy_bandwidth']['bytes_per_s'] / 1e12:.2f} TB/s" in section, folder


def test_the_h200_flashinfer_end_to_end_is_its_runs():
    """The H200 end-to-end row and what the bullets derive from it and from the region timings:
    each arm's tokens/s from its call's file, each kernel against the native run of its own call."""
    table = _sections()["FlashInfer on an H200, capacity 40,960"]
    section = " ".join(table.split())
    folder = DATA / "h200-flashinfer-2026-12-06"
    tokens = {}  # per call (named by its kernel): each arm's tokens/s
    for kernel in ("hopper", "flashinfer"):
        text = (folder / "e2e" / f"native-{kernel}.txt").read_text()
        tokens[kernel] = {arm: float(v) for arm, v in re.findall(r"^(\w+) .*tokens_per_sec=([\d.]+)$", text, re.M)}
    row = _cells(table, "end to end")
    assert row == [f"{tokens['hopper']['native']:.1f} beside ours; {tokens['flashinfer']['native']:.1f} "
                   "beside FlashInfer", f"{tokens['hopper']['hopper']:.1f}",
                   f"{tokens['flashinfer']['flashinfer']:.1f}"], row
    behind = 100 * (1 - tokens["flashinfer"]["flashinfer"] / tokens["flashinfer"]["native"])
    ahead = 100 * (tokens["hopper"]["hopper"] / tokens["hopper"]["native"] - 1)
    assert f"{behind:.1f}% fewer tokens/s than the native region in its call; ours is {ahead:.1f}% ahead" in section
    raw = json.loads((folder / "gpu_attention_flashinfer.json").read_text())
    slower = {t["context"]: t["flashinfer"]["us_per_call"] / t["kernel"]["us_per_call"] for t in raw["stream_timing"]}
    assert (f"{slower[2048]:.1f}x slower than ours at 2,048 keys, {slower[4096]:.1f}x at 4,096 and "
            f"{slower[32768]:.1f}x at 32,768") in section


def _finished_probes(log: str) -> list[tuple[int, str]]:
    """Each instance's probe that finished in a `doit` log, in order: its calls and its seconds
    as logged."""
    return [(int(n), t) for n, t in
            re.findall(r"layers\.\d+\.decode_attention  (\d+)/\1 .*?([\d.]+)s$", log, re.M)]


def _correctness_seconds(log: str) -> str:
    """The correctness stage's time in a `doit` log, as logged."""
    return re.search(r"\[stage\] correctness done in ([\d.]+) s", log).group(1)


def _gates_40960(gpu: str) -> Path:
    """The folder of FlashInfer's gates at capacity 40,960 on `gpu` (h100 or h200)."""
    return DATA / f"{gpu}-flashinfer-2026-12-07" / "gates-40960"


def _assert_gate_cells(folder: Path, correctness: str, perf: str) -> bool:
    """A mode's correctness cell (verdict, stage time, calls and probes from its doit log and
    ledger) and perf cell (verdict from its report) show its run; whether the run was promoted,
    as its ledger, receipt and `gate verify`'s output agree."""
    log = (folder / "doit.log").read_text()
    verdict = re.search(r"\[stage\] correctness gate (\w+): all (\d+) cases match, (\d+) slot calls", log)
    ledger = {e["event"]: e for e in map(json.loads, (folder / "ledger.jsonl").read_text().splitlines())}
    figures = ledger["correctness"]["figures"]
    assert verdict.group(1) == ledger["correctness"]["verdict"] == "pass" and figures["failed_cases"] == 0
    assert figures["probe_passed"] and len(figures["slots"]) == 36
    (calls, first), *others = _finished_probes(log)
    assert len(others) == 35 and len({n for n, _ in others}) == 1
    times = sorted(float(t) for _, t in others)
    assert correctness.startswith(f"**{verdict.group(1)}** in {_correctness_seconds(log)} s: "), folder
    assert f"{int(verdict.group(3)):,} " in correctness and " cases" in correctness
    assert (f"({calls} calls in the first in {first} s, {others[0][0]} in each other in "
            f"{times[0]}–{times[-1]} s)") in correctness, folder
    report = json.loads((folder / "perf.json").read_text())
    assert perf.startswith(f"**{report['verdict']}**") and ledger["perf"]["verdict"] == report["verdict"]
    promoted = "promote" in ledger
    assert promoted == (folder / "promotion.json").is_file()
    if promoted:
        assert (folder / "verify.log").read_text().splitlines()[-1].startswith("verified: ")
    return promoted


def test_the_h100_gates_at_40960_are_their_run():
    """Each mode's row of the H100 table at capacity 40,960 shows its run (`_assert_gate_cells`)
    and its memory from the samples."""
    section = _section("FlashInfer's gates on an H100, capacity 40,960")
    by_process: dict[str, list[int]] = {}
    together: dict[str, int] = {}
    for line in (_gates_40960("h100") / "gpu-memory.txt").read_text().splitlines():
        time, pid, mib, _ = line.split()
        by_process.setdefault(pid, []).append(int(mib))
        together[time] = together.get(time, 0) + int(mib)
    stages = [samples for samples in by_process.values() if len(samples) >= 10]  # a helper lives a few
    assert len(stages) == 10  # per mode: the correctness gate's judge and host, then the perf gate's three
    for mode, (judge, host) in {"eager": stages[0:2], "optimized": stages[5:7]}.items():
        cells = _cells(section, mode)
        promoted = _assert_gate_cells(_gates_40960("h100") / mode, cells[0], cells[1])
        assert cells[2] == ("promoted; `gate verify` passes" if promoted else "not promoted"), mode
        assert cells[3] == f"{max(judge):,} MiB; {max(host):,} MiB", mode
    text = " ".join(section.split())
    assert f"held at most {max(together.values()):,} MiB together in any sample" in text
    trials = json.loads((_gates_40960("h100") / "optimized" / "perf.json").read_text())["trials"]
    ratios, native, external = ([t[key] for t in trials]
                                for key in ("ratio", "native_throughput", "external_throughput"))
    assert sorted(range(len(trials)), key=external.__getitem__)[:2] == [3, 2] and max(external) == external[-1]
    assert (f"ratios ran from {min(ratios):.2f} to {max(ratios):.2f}, so {len(trials)} trials" in text and
            f"native between {min(native):.1f} and {max(native):.1f} tokens/s, FlashInfer's from "
            f"{external[2]:.1f} and {external[3]:.1f} in its third and fourth trials up to {external[-1]:.1f} "
            "in its last") in text


def test_the_h200_gate_rows_are_their_run():
    """The H200 table's gate rows show each mode's run (`_assert_gate_cells`), the promotion row
    both modes' outcomes, and the bullets the eager gain and the optimized region's deficit."""
    table = _sections()["FlashInfer on an H200, capacity 40,960"]
    rows = {"eager": ("correctness gate, eager mode", "perf gate, eager mode"),
            "optimized": ("correctness gate through `doit`, all 36 layers: optimized mode",
                          "perf gate through `doit` (10 alternating trials): optimized mode")}
    promoted = {mode: _assert_gate_cells(_gates_40960("h200") / mode, _cells(table, correctness)[2],
                                         _cells(table, perf)[2])
                for mode, (correctness, perf) in rows.items()}
    outcome = {True: "promoted; `gate verify` passes", False: "not promoted"}
    assert _cells(table, "promotion and `gate verify`")[2] == (
        f"eager mode: {outcome[promoted['eager']]}; optimized mode: {outcome[promoted['optimized']]}")
    eager, optimized = (_perf_figures(json.loads((_gates_40960("h200") / mode / "perf.json").read_text()))
                        for mode in ("eager", "optimized"))
    text = " ".join(table.split())
    assert f"makes the engine {100 * (eager['ratio'] - 1):.1f}% faster" in text
    assert (f"trails the native Triton kernel by {optimized['kernel layer 0'] - optimized['native layer 0']:.1f} µs"
            " a call in layer 0") in text


def test_the_optimized_spread_at_40960_is_its_run():
    """The H200's optimized perf trials as the bullet groups them (those below 0.9, the rest),
    native's range, and the spread of native at capacity 16,384 on the H100 it is set against."""
    text = " ".join(_sections()["FlashInfer on an H200, capacity 40,960"].split())
    trials = json.loads((_gates_40960("h200") / "optimized" / "perf.json").read_text())["trials"]
    low = sorted(t["ratio"] for t in trials if t["ratio"] < 0.9)
    high = sorted(t["ratio"] for t in trials if t["ratio"] >= 0.9)
    native = [t["native_throughput"] for t in trials]
    assert (f"{len(low)} of its {len(trials)} trials' ratios lie between {low[0]:.2f} and {low[-1]:.2f}, "
            f"the other {('one', 'two', 'three', 'four', 'five')[len(high) - 1]} between {high[0]:.2f} and "
            f"{high[-1]:.2f}, and native ran between {min(native):.1f} and {max(native):.1f} tokens/s") in text
    earlier = [t["native_throughput"] for t in json.loads(
        (DATA / "h100-flashinfer-2026-12-06" / "gates-16384" / "optimized" / "perf.json").read_text())["trials"]]
    assert f"its native trials stayed within {100 * (max(earlier) / min(earlier) - 1):.1f}% of each other" in text


def test_the_probe_pace_at_40960_is_its_run():
    """The pace at capacity 40,960 with the channel as it is, from the H200 run's optimized log, and
    the earlier pace on an H200 it is set against."""
    section = " ".join(_sections()["FlashInfer on an H200, capacity 40,960"].split())
    calls, seconds = _finished_probes((_gates_40960("h200") / "optimized" / "doit.log").read_text())[0]
    earlier_calls, earlier_seconds = _finished_probes(
        (DATA / "h200-flashinfer-2026-12-06" / "gates-40960" / "optimized" / "doit.log").read_text())[0]
    assert (f"probe of the first instance took {seconds} s for {calls} calls, {float(seconds) / calls:.2f} s a "
            f"call; on an H200 on **2026-12-06**, before that change, it took {earlier_seconds} s for "
            f"{earlier_calls} calls, {float(earlier_seconds) / earlier_calls:.2f} s a call") in section


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
        cell, rate = _median_run([r for r in runs if r["code"] == code])
        line = next(line for line in section.splitlines() if line.startswith(row))
        assert f"| {cell} | {rate} |" in line, line


def _median_run(runs: list[dict]) -> tuple[str, str]:
    """Three channel runs as a table shows them: the median seconds per frame (lowest, highest),
    and the median run's rate."""
    s = sorted(runs, key=lambda r: r["median_s"])
    return (f"{s[1]['median_s']:.3f} ({s[0]['median_s']:.3f}, {s[-1]['median_s']:.3f})",
            f"{s[1]['gb_per_s']:.2f}")


def test_the_gpu_channel_table_is_its_raw_file():
    runs = [json.loads(line) for line in (ROOT / "docs" / "data" / "h100-host-channel-2026-12-06" /
                                          "runs.jsonl").read_text().splitlines()]
    section = _section("What the kernel host costs")
    for mib in (64, 160):
        cells, rates = zip(*(_median_run([r for r in runs if r["cuda"] and r["mib"] == mib
                                          and r["pinned"] is pinned]) for pinned in (True, False)))
        assert f"| {mib} MiB | {cells[0]} | {cells[1]} | {rates[0]} / {rates[1]} |" in section, mib


DATA = ROOT / "docs" / "data"
# Per section (`## ` or `### `) of docs/performance.md with a table: the raw files it cites, under
# docs/data (a folder: every file in it, .gz and .tgz unpacked), and the scales from the raw files'
# units to the page's (1e3: s to ms; 1e6: s to µs; 100: a fraction to %; 1e-9: bytes to GB;
# 1e-12: bytes/s to TB/s).
RAW: dict[str, tuple[tuple[str, ...], tuple[float, ...]]] = {
    "The gates through `doit` on the H200": (
        ("h200-doit-final-2026-12-02.log", "h200-doit-gpu-job-2026-12-02.log"), (1,)),
    "Hostile kernels": (("h200-hostile-kernels-2026-12-02.log", "h200-shadow-gates-2026-12-02.json"), (1,)),
    "What the kernel host costs": (
        ("cpu-kernel-host-cost-2026-12-06.txt", "cpu-host-channel-2026-12-06", "cpu-production-throughput-2026-12-06",
         "h100-kernel-host-gates-2026-12-06", "h100-kernel-host-2026-12-06/summary.txt",
         "h100-host-channel-2026-12-06"), (1,)),
    "Qwen3-8B: decode, first token and first call": (("h200-qwen3-8b-decode-2026-12-04",), (1, 1e3, 1e-9, 1e-12)),
    "Beside transformers at its fastest": (
        ("h100-qwen3-8b-decode-2026-12-06", "h200-qwen3-8b-decode-2026-12-06"), (1, 1e3)),
    "Both gates at Qwen3-8B dims: the identity copy, through `doit`": (
        ("h200-qwen3-8b-logits-copy-doit-2026-12-02",), (1,)),
    "One kernel in every attention layer, through `doit`": (("h200-attention-all-layers-doit-2026-12-04",), (1, 1e6)),
    "All 36 layers of Qwen3-8B": (
        ("h200-qwen3-8b-attention-all-layers-2026-12-04", "h200-qwen3-8b-attention-all-layers-2026-12-03"),
        (1, 1e-12)),
    "The Hopper decode-attention kernel alone": (
        ("gpu_attention_2026-12-01.json", "gpu_attention_seed4242_2026-12-01.json",
         "gpu_attention_trace_2026-12-01.json", "attention_workspace_2026-12-01/final"), (1, 100)),
    "FlashInfer's decode kernel beside ours": (("h100-flashinfer-2026-12-06",), (1,)),
    "FlashInfer's gates on an H100, capacity 40,960": (("h100-flashinfer-2026-12-07",), (1,)),
    "FlashInfer on an H200, capacity 40,960": (("h200-flashinfer-2026-12-06", "h200-flashinfer-2026-12-07"), (1,)),
    "The attention flow under both gates": (
        ("gpu_attention_flow_head_2026-12-01.json", "gpu_attention_flow_workspace_2026-12-01.json"), (1, 1e6)),
    "The MiniLM residual add in the optimized mode: CUDA C++ and CuTe DSL": (("gpu_gates_2026-12-01.json",), (1, 1e6)),
    "Triton GEMV against cuBLAS": (
        ("gpu_decode_kernels_gemv_configs_2026-12-04.json", "h200-qwen3-8b-decode-2026-12-04/profile_decode_step.json"),
        (1, 1e-12)),
    "Many specs through `trtmc matrix --ray`": (("h200-ray-matrix-2026-12-03",), (1,)),
}
# Sections without a table figure to check: what they state is method, or prose.
NO_TABLE = {"How the figures are measured", "What shadow execution costs", "What is not measured"}
# Table figures that no raw file holds, each with why.
NOT_RAW: dict[str, dict[str, str]] = {
    "Hostile kernels": {
        "0.004": "what the wrong kernel adds (tests/kernels/residual_add_late_offset.cu), not a measurement",
    },
}


def _sections() -> dict[str, str]:
    """Each `## ` or `### ` section of docs/performance.md by its title."""
    parts = re.split(r"^#{2,3} (.+)$", (ROOT / "docs" / "performance.md").read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _raw_texts(path: Path) -> list[str]:
    if path.is_dir():
        return [text for p in sorted(path.rglob("*")) if p.is_file() for text in _raw_texts(p)]
    if path.name.endswith((".tgz", ".tar.gz")):
        with tarfile.open(path) as tar:
            return [tar.extractfile(m).read().decode(errors="replace")
                    for m in tar.getmembers() if m.isfile()]
    if path.suffix == ".gz":
        return [gzip.decompress(path.read_bytes()).decode(errors="replace")]
    if path.suffix == ".png":
        return []
    return [path.read_text(errors="replace")]


def _qwen3_decode_derived() -> list[float]:
    """The shares of the roofline and the first token's floor from each run's file; where a
    prefill goes: cuBLAS's GEMMs, the attention kernel and the rest of the GPU's busy time."""
    folder = DATA / "h200-qwen3-8b-decode-2026-12-04"
    out = []
    for path in [*folder.glob("engine_*.json"), *folder.glob("without_fusions_*.json")]:
        run = json.loads(path.read_text())
        out.append(100 * run["tokens_per_s"] / run["roofline_tokens_per_s"])
        out.append(1e3 * run["step_bytes"] / run["roofline"]["bytes_per_s"])
    for mode in ("optimized", "eager"):
        for row in json.loads((folder / f"profile_{mode}.json").read_text())["rows"]:
            gemm = sum(k["ms"] for k in row["top"] if k["kernel"].startswith(("nvjet", "void cublas")))
            attention = sum(k["ms"] for k in row["top"] if k["kernel"].startswith(("_prompt_kernel", "fmha")))
            out += [gemm, attention / 36, row["gpu_busy_ms"] - gemm - attention]
    return out


def _gemv_derived() -> list[float]:
    """cuBLAS's time over the Triton GEMV's (the configuration the page names: a row a program,
    4,096-wide K steps, 8 warps, 2 stages), and a decode step's GEMV weights in GB."""
    raw = json.loads((DATA / "gpu_decode_kernels_gemv_configs_2026-12-04.json").read_text())
    products = {p["gemm"]: p for p in raw["gemv_configs"]}
    out = [p["cublas"]["us"] / p["triton (1, 4096, 8, 2)"]["us"] for p in products.values()]
    layer = sum(p["weight_bytes"] for name, p in products.items() if name != "lm head")
    out.append((36 * layer + products["lm head"]["weight_bytes"]) / 1e9)
    return out


def _anchor_runs() -> dict[str, dict]:
    """The run behind each row of "Beside transformers at its fastest", by GPU."""
    return {gpu: json.loads((DATA / f"{gpu.lower()}-qwen3-8b-decode-2026-12-06" / "engine_128_transformers.json")
                            .read_text()) for gpu in ("H100", "H200")}


def _over_fastest(run: dict) -> float:
    """The engine's tokens/s over those of transformers' fastest configuration in the same run."""
    return run["tokens_per_s"] / max(c["tokens_per_s"] for c in run["transformers"]["configurations"].values())


def _anchor_derived() -> list[float]:
    """Per run: the engine's share of its roofline and its margin over transformers' fastest."""
    return [figure for run in _anchor_runs().values()
            for figure in (_decode_figures(run)["roofline %"], _over_fastest(run))]


# Figures a section computes from its raw files (ratios, shares, sums), computed here alike.
DERIVED = {
    "Beside transformers at its fastest": _anchor_derived,
    "Qwen3-8B: decode, first token and first call": _qwen3_decode_derived,
    "Triton GEMV against cuBLAS": _gemv_derived,
}
SHOWN = re.compile(r"\d[\d,]*\.\d+(?:e-?\d+)?")
RAW_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _table_figures(section: str) -> list[str]:
    """Every number with a decimal point in the section's table rows, as written."""
    return [f for line in section.splitlines() if line.startswith("|") for f in SHOWN.findall(line)]


def _rounds_to(shown: str, value: float) -> bool:
    """`value` rounded to the decimals `shown` has is `shown` (either way at an exact half)."""
    mantissa, _, exponent = shown.replace(",", "").partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    half = 0.5 * 10.0 ** (int(exponent or 0) - decimals) * (1 + 1e-9)
    return abs(value - float(shown.replace(",", ""))) <= half


def _found(shown: str, text: str, numbers: list[float]) -> bool:
    """The figure as written in the raw text, or a raw number that rounds to it as shown."""
    if re.search(r"(?<![\d.])" + re.escape(shown) + r"(?!\d)", text):
        return True
    return any(_rounds_to(shown, n) for n in numbers)


def _missing(title: str, section: str) -> list[str]:
    paths, scales = RAW[title]
    text = "\n".join(t for p in paths for t in _raw_texts(DATA / p))
    raw = [float(n) for n in RAW_NUMBER.findall(text)]
    numbers = [n * s for n in raw for s in scales] + (DERIVED[title]() if title in DERIVED else [])
    allowed = NOT_RAW.get(title, {})
    return [f for f in _table_figures(section) if f not in allowed and not _found(f, text, numbers)]


def test_every_table_figure_is_in_its_raw_files():
    """Every figure with a decimal point in a table of docs/performance.md is in the raw files its
    section cites, as written or as a number there that rounds to it, or is computed from them
    here; a figure edited on the page alone, or a file re-measured alone, fails."""
    sections = _sections()
    with_tables = {title for title, text in sections.items() if _table_figures(text)}
    assert with_tables - NO_TABLE == set(RAW), sorted(with_tables ^ set(RAW))
    wrong = {title: missing for title in RAW if (missing := _missing(title, sections[title]))}
    assert not wrong, wrong


def test_the_raw_files_are_the_ones_each_section_cites():
    """Each raw path a section names under docs/data is among its RAW entries and each entry is
    named there, so the check reads the files the page cites; NOT_RAW lists only figures shown."""
    sections = _sections()
    for title, (paths, _) in RAW.items():
        text = sections[title]
        for path in paths:
            assert (DATA / path).exists(), path
            assert Path(path).name in text or path in text, (title, path)
        for cited in re.findall(r"docs/data/([\w.-]+(?:/[\w.-]+)*)", text):
            if cited.endswith(".sh"):  # a command as it ran
                continue
            assert any(cited.startswith(p) or p.startswith(cited) for p in paths), (title, cited)
    for title, figures in NOT_RAW.items():
        assert set(figures) <= set(_table_figures(sections[title])), (title, figures)


def _cells(section: str, first: str) -> list[str]:
    """The cells after the first of the row whose first cells are, or begin with, `first` (a
    label's words up to a space, colon or comma)."""
    line = next(line for line in section.splitlines() if re.match(rf"\| {re.escape(first)}[ :,|]", line))
    return [c.strip() for c in line.strip("|").split("|")][1:]


def _figures(cell: str) -> list[str]:
    return re.findall(r"\d[\d,]*(?:\.\d+)?", cell)


def _assert_shows(shown: list[str], expected: list, where: object) -> None:
    """`shown` is `expected` rounded as shown, figure by figure (None: a figure not checked)."""
    assert len(shown) == len(expected), (where, shown)
    wrong = [(f, v) for f, v in zip(shown, expected) if v is not None and not _rounds_to(f, v)]
    assert not wrong, (where, wrong)


def test_the_prefill_table_is_its_profiles():
    """Each row of "Where a prefill goes": wall, GPU busy, launches, cuBLAS's GEMMs, the attention
    kernel and the rest of the busy time, from the profile's kernels, cell by cell."""
    folder = DATA / "h200-qwen3-8b-decode-2026-12-04"
    section = _section("Qwen3-8B: decode, first token and first call")
    for mode in ("optimized", "eager"):
        for row in json.loads((folder / f"profile_{mode}.json").read_text())["rows"]:
            gemms = [k for k in row["top"] if k["kernel"].startswith(("nvjet", "void cublas"))]
            gemm = sum(k["ms"] for k in gemms)
            attention = sum(k["ms"] for k in row["top"] if k["kernel"].startswith(("_prompt_kernel", "fmha")))
            cells = _cells(section, f"{row['tokens']:,}, {mode}")
            expected = [row["median_wall_ms"], row["gpu_busy_ms"], row["kernel_launches"], gemm, attention,
                        row["gpu_busy_ms"] - gemm - attention]
            for cell, value in zip(cells, expected):
                assert _rounds_to(_figures(cell)[0], value), (row["tokens"], mode, cell, value)
            if row["tokens"] == 4000:
                assert _figures(cells[3])[1] == str(sum(k["calls"] for k in gemms)), (mode, cells[3])


def test_the_hopper_stream_table_is_its_raw_file():
    """Each cell of the Hopper kernel's stream timing: µs per call and, in parentheses, the share
    of copy bandwidth, from `stream_timing` of the seed-1000 file."""
    raw = json.loads((DATA / "gpu_attention_2026-12-01.json").read_text())
    section = _section("The Hopper decode-attention kernel alone")
    assert f"copy bandwidth {raw['copy_bandwidth']['bytes_per_s'] / 1e12:.2f} TB/s" in section
    columns = [("native",), ("kernel",), ("after_cache_write", "kernel"), ("kernel (workspace)",),
               ("after_cache_write", "kernel (workspace)"), ("sdpa",), ("triton (runtime)",),
               ("copy (same bytes)",)]
    for timed in raw["stream_timing"]:
        cells = _cells(section, f"{timed['capacity']:,} | {timed['context']:,}")[1:]
        assert len(cells) == len(columns), cells
        for cell, keys in zip(cells, columns):
            arm = timed
            for key in keys:
                arm = arm[key]
            shown = _figures(cell)
            assert _rounds_to(shown[0], arm["us_per_call"]), (timed["context"], keys, cell)
            if len(shown) > 1:
                assert _rounds_to(shown[1], 100 * arm["fraction_of_copy_bw"]), (timed["context"], keys, cell)


def _perf_figures(report: dict) -> dict[str, float]:
    """What a page states from one perf report, by name: the verdict's figures, and the regions'
    medians (µs) and speedups as ranges over the instances and in layer 0."""
    summary, regions = report["summary"], report["regions"]
    first = [i for i, r in enumerate(regions) if ".layers.0." in r["binding_id"]]
    out = {"ratio": summary["median_ratio"], "low": summary["ci_low"], "high": summary["ci_high"],
           "predicted": summary.get("predicted_ratio"), "threshold": report["settings"]["threshold"],
           "trials": len(report["trials"]), "native tokens/s": summary["native_median_throughput"],
           "external tokens/s": summary["external_median_throughput"]}
    for arm, key in (("native", "native_median_s"), ("kernel", "kernel_median_s"), ("speedup", "kernel_speedup")):
        values = [r[key] * (1 if arm == "speedup" else 1e6) for r in regions]
        out |= {f"{arm} min": min(values), f"{arm} max": max(values)}
        out |= {f"{arm} layer 0": values[i] for i in first}
    return out


# Table cells that state one perf report's figures: (section, the text its table follows, the row's
# first cells, the cell's index after the first, the report under docs/data (`file#key/key` for one
# inside a larger file), the name of each figure in the cell in order, None for one that is not the
# report's). The raw-file check accepts any number of the folder that rounds alike, and a report
# holds every trial's ratio; these cells are read whole.
PERF_CELLS = (
    ("FlashInfer's decode kernel beside ours", "", "perf gate through `doit` (10 alternating trials): optimized mode",
     2, "h100-flashinfer-2026-12-06/gates-16384/optimized/perf.json",
     ("ratio", None, "low", "high", "threshold", "external tokens/s", "native tokens/s", "speedup min", "speedup max",
      None, "kernel layer 0", "native layer 0", None)),
    ("FlashInfer's decode kernel beside ours", "", "perf gate, eager mode", 2,
     "h100-flashinfer-2026-12-06/gates-16384/eager/perf.json",
     ("ratio", "low", "high", "threshold", "external tokens/s", "native tokens/s", "speedup min", "speedup max",
      "kernel layer 0", "native layer 0", None)),
    *((title, "", row, column, f"{gpu}-flashinfer-2026-12-07/gates-40960/{mode}/perf.json",
       ("ratio", "low", "high", "threshold", "external tokens/s", "native tokens/s", "speedup min", "speedup max",
        "kernel layer 0", "native layer 0", None) + (("predicted",) if mode == "optimized" else ()))
      for gpu, title, column, rows in (
          ("h100", "FlashInfer's gates on an H100, capacity 40,960", 1, {"eager": "eager", "optimized": "optimized"}),
          ("h200", "FlashInfer on an H200, capacity 40,960", 2,
           {"eager": "perf gate, eager mode",
            "optimized": "perf gate through `doit` (10 alternating trials): optimized mode"}))
      for mode, row in rows.items()),
    ("All 36 layers of Qwen3-8B", "", "perf verdict", 0,
     "h200-qwen3-8b-attention-all-layers-2026-12-04/perf-optimized.json.gz",
     ("ratio", "low", "high", "trials", None, "predicted")),
    ("All 36 layers of Qwen3-8B", "", "tokens/s, native / external (both prompts, prefill included)", 0,
     "h200-qwen3-8b-attention-all-layers-2026-12-04/perf-optimized.json.gz", ("native tokens/s", "external tokens/s")),
    ("All 36 layers of Qwen3-8B", "", "each instance in situ (20,480 keys), native / kernel", 0,
     "h200-qwen3-8b-attention-all-layers-2026-12-04/perf-optimized.json.gz",
     ("native min", "native max", "kernel min", "kernel max", "speedup min", "speedup max")),
    ("All 36 layers of Qwen3-8B", "**The eager mode",
     "end to end, measured [95% interval] / predicted (Amdahl, 36 regions)", 0,
     "h200-qwen3-8b-attention-all-layers-2026-12-03/perf-eager.json.gz", ("ratio", "low", "high", "predicted")),
    ("All 36 layers of Qwen3-8B", "**The eager mode", "tokens/s, native / external (both prompts, prefill included)", 0,
     "h200-qwen3-8b-attention-all-layers-2026-12-03/perf-eager.json.gz", ("native tokens/s", "external tokens/s")),
    ("All 36 layers of Qwen3-8B", "**The eager mode", "each instance in situ (20,480 keys), native / kernel", 0,
     "h200-qwen3-8b-attention-all-layers-2026-12-03/perf-eager.json.gz",
     ("native min", "native max", "kernel min", "kernel max", "speedup min", "speedup max")),
    ("One kernel in every attention layer, through `doit`", "", "perf, end to end (20 trials)", 0,
     "h200-attention-all-layers-doit-2026-12-04/perf.json",
     ("ratio", "low", "high", "native tokens/s", "external tokens/s")),
    ("One kernel in every attention layer, through `doit`", "", "predicted from the 4 region timings (Amdahl)", 0,
     "h200-attention-all-layers-doit-2026-12-04/perf.json", ("predicted",)),
    ("Both gates at Qwen3-8B dims: the identity copy, through `doit`", "", "warm", 6,
     "h200-qwen3-8b-logits-copy-doit-2026-12-02/perf-warm.json", ("ratio", "low", "high")),
    *(("The attention flow under both gates", "", f"{slot} | {mode}", column,
       f"gpu_attention_flow_{file}_2026-12-01.json#{mode}/perf", names)
      for slot, file in (("recipe, `run`", "head"), ("by hand, `run_workspace`", "workspace"))
      for mode in ("optimized", "eager")
      for column, names in ((2, ("ratio", "low", "high", "trials")),
                            (3, ("native min", "kernel min", "speedup min", None)))
      if (file, mode, column) != ("workspace", "eager", 3)),  # a region that run did not time
    *(("The MiniLM residual add in the optimized mode: CUDA C++ and CuTe DSL", "", row, column,
       f"gpu_gates_2026-12-01.json#{key}/optimized/perf", names)
      for row, key in (("CUDA C++", "cuda_cpp"), ("CuTe DSL", "cutedsl"))
      for column, names in ((1, ("native tokens/s",)), (2, ("external tokens/s",)),
                            (3, ("ratio", "low", "high", "trials")), (4, ("native min", "kernel min")))),
)


def test_the_perf_cells_are_their_reports():
    """Each cell of PERF_CELLS shows its report's figures, each rounded as shown, in order: a
    figure one digit off fails here though a trial of the same report rounds to it."""
    for title, after, row, column, path, names in PERF_CELLS:
        file, _, keys = path.partition("#")
        raw = (DATA / file).read_bytes()
        report = json.loads(gzip.decompress(raw) if file.endswith(".gz") else raw)
        for key in filter(None, keys.split("/")):
            report = report[key]
        figures = _perf_figures(report)
        section = _section(title)
        cell = _cells(section.split(after)[-1] if after else section, row)[column]
        _assert_shows(_figures(cell), [figures[name] if name else None for name in names], (title, row, names))


def test_the_flashinfer_gate_rows_state_their_verdicts():
    """Each FlashInfer gate row begins with its run's verdict, and a correctness row with the
    stage's time from that run's doit log."""
    runs = DATA / "h100-flashinfer-2026-12-06" / "gates-16384"
    section = _section("FlashInfer's decode kernel beside ours")
    rows = {"optimized": ("correctness gate through `doit`, all 36 layers, capacity 16,384: optimized mode",
                          "perf gate through `doit` (10 alternating trials): optimized mode"),
            "eager": ("correctness gate, eager mode", "perf gate, eager mode")}
    for mode, (correctness_row, perf_row) in rows.items():
        log = (runs / mode / "doit.log").read_text()
        seconds = _correctness_seconds(log)
        verdict = re.search(r"\[stage\] correctness gate (pass|fail)", log).group(1)
        assert _cells(section, correctness_row)[2].startswith(f"**{verdict}** in {seconds} s"), mode
        perf = json.loads((runs / mode / "perf.json").read_text())
        assert _cells(section, perf_row)[2].startswith(f"**{perf['verdict']}**"), mode


def _decode_figures(run: dict) -> dict[str, float]:
    """What the decode table states from one `trtmc bench decode --json` run, by name."""
    out = {"tokens/s": run["tokens_per_s"], "first token ms": 1e3 * run["median_first_token_s"],
           "first call s": run["first_call_s"], "roofline tokens/s": run["roofline_tokens_per_s"],
           "roofline %": 100 * run["tokens_per_s"] / run["roofline_tokens_per_s"],
           "floor ms": 1e3 * run["step_bytes"] / run["roofline"]["bytes_per_s"]}
    out |= {f"decode s {i}": s for i, s in enumerate(run["decode_seconds"])}
    return out | {f"first token ms {i}": 1e3 * s for i, s in enumerate(run["first_token_seconds"])}


# The decode table's cells: (row's first cell, cell index after it, each figure's run and name);
# E and W begin the names of the engine's runs and of those without its fusions.
E, W = "engine", "without_fusions"
DECODE_CELLS = (
    ("decode", 0, ((f"{E}_128_cold", "tokens/s"), *((f"{E}_128_cold", f"decode s {i}") for i in range(3)))),
    ("decode", 1, ((f"{E}_4000", "tokens/s"), *((f"{E}_4000", f"decode s {i}") for i in range(3)))),
    ("decode", 2, ((f"{W}_128_cold", "tokens/s"), (f"{W}_4000", "tokens/s"))),
    ("roofline", 0, ((f"{E}_128_cold", "roofline tokens/s"), (f"{E}_128_cold", "roofline %"))),
    ("roofline", 1, ((f"{E}_4000", "roofline tokens/s"), (f"{E}_4000", "roofline %"))),
    ("time to first token", 0,
     ((f"{E}_128_cold", "first token ms"), *((f"{E}_128_cold", f"first token ms {i}") for i in range(3)))),
    ("time to first token", 1,
     ((f"{E}_4000", "first token ms"), *((f"{E}_4000", f"first token ms {i}") for i in range(3)))),
    ("time to first token", 2, ((f"{W}_128_cold", "first token ms"), (f"{W}_4000", "first token ms"))),
    ("its floor", 0, ((f"{E}_128_cold", "floor ms"),)),
    ("first call, cache empty", 0, ((f"{E}_128_cold", "first call s"),)),
    ("first call, cache empty", 2, ((f"{W}_128_cold", "first call s"),)),
    ("first call, cache warm", 0, ((f"{E}_128_warm", "first call s"), (f"{E}_128_warm2", "first call s"))),
    ("first call, cache warm", 1, ((f"{E}_4000", "first call s"),)),
    ("first call, cache warm", 2, ((f"{W}_128_warm", "first call s"), (f"{W}_128_warm2", "first call s"))),
)


def test_the_decode_table_is_its_runs():
    """Each cell of the Qwen3-8B decode table shows, in order, the figures of the runs it names,
    rounded as shown: the runs share many numbers (three of 238.8 tokens/s), so a cell is read
    from its own run."""
    folder = DATA / "h200-qwen3-8b-decode-2026-12-04"
    section = _section("Qwen3-8B: decode, first token and first call")
    for row, column, figures in DECODE_CELLS:
        shown = [f for f in _figures(_cells(section, row)[column]) if "." in f]
        expected = [_decode_figures(json.loads((folder / f"{run}.json").read_text()))[name] for run, name in figures]
        _assert_shows(shown, expected, (row, column))


def test_the_anchor_table_is_its_runs():
    """Each row of "Beside transformers at its fastest" shows its run's figures in order: the
    engine's tokens/s, roofline share, roofline and first token, then each transformers
    configuration's tokens/s, first token and compile, then the margin over the fastest one."""
    section = _section("Beside transformers at its fastest")
    compiled = []
    for gpu, run in _anchor_runs().items():
        engine = _decode_figures(run)
        measured = run["transformers"]["configurations"]
        expected = [[engine["tokens/s"], engine["roofline %"], engine["roofline tokens/s"], engine["first token ms"]]]
        for name in ("dynamic cache", "static cache"):
            c = measured[name]
            expected.append([c["tokens_per_s"], 1e3 * c["median_first_token_s"]]
                            + ([c["first_call_s"]] if c["compiled"] else []))
        expected.append([_over_fastest(run)])
        compiled.append(measured["static cache"]["tokens_per_s"] / measured["dynamic cache"]["tokens_per_s"])
        row = f"{gpu}, 128 tokens"
        for column, figures in enumerate(expected):
            _assert_shows([f for f in _figures(_cells(section, row)[column]) if "." in f], figures, (row, column))
    h100, h200 = compiled
    assert f"is {h100:.1f}x its dynamic cache on the H100 and {h200:.1f}x" in " ".join(section.split())
