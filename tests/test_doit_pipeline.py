"""The doit pipeline run for real (`doit -f dodo.py` in a process of its own), on a tiny DistilBERT.

The tests of this module share one workspace and run in order: each starts from the state the
previous one left, and reads which tasks ran from doit's `.  task` (ran) / `-- task` (up to date)
lines.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from pipeline import jsonio
from tests.forked_python import python_m

# every stage is a child process: minutes, not seconds; the tests take turns on one workspace,
# in order, so they run on one worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("doit_workspace")]

ROOT = Path(__file__).resolve().parent.parent
NAME = "tiny"
ALL = {"inspect", "select", "build_native", "build_slot", "export_dso", "bind", "correctness",
       "perf", "promote"}
KERNEL_STAGES = {"export_dso", "bind", "correctness", "perf", "promote"}


class Workspace:
    def __init__(self, root: Path, model: Path):
        self.root, self.model = root, model
        self.spec_path = root / "spec.json"
        self.kernel, self.header = root / "kernel.cu", root / "variant.h"
        self.header.write_text("// a header of the kernel's own\n")
        self.kernel.write_text(f'#include "variant.h"\n'
                               f'#include "{ROOT / "examples/byok/residual_add.cu"}"\n')
        self.out = root / "out"
        self.spec = {
            "schema_version": 1, "name": NAME, "model": str(model),
            "build": {"precision": "fp32", "sequence_length": 16}, "engine_role": "decode",
            "bundle": {"plans": False},
            "selection": {"node_names": ["encoder.layers.0.attention_residual_add"],
                          "binding_id": "tiny.layer0.residual"},
            "kernel": {"source": str(self.kernel)},
            "gates": {"texts": ["Hello world!", "The cat sat on the mat."],
                      # a threshold met even when a trial is timed beside other tests:
                      # these tests are about caching, not timing
                      "perf": {"trials": 5, "warmup": 1, "threshold": 0.001}},
            "output": str(self.out)}
        self.write_spec()

    def write_spec(self) -> None:
        self.spec_path.write_bytes(orjson.dumps(self.spec))

    def arguments(self, *tasks, options=()) -> list[str]:
        return ["-f", str(ROOT / "dodo.py"), "--db-file", str(self.root / "doit.db"),
                "--backend", "sqlite3", "-v", "2", *options, f"spec={self.spec_path}", *tasks]

    def command(self, *tasks, options=()) -> list[str]:
        """The doit command line, for a test that signals the process."""
        return [sys.executable, "-m", "doit", *self.arguments(*tasks, options=options)]

    def doit(self, *tasks, options=()) -> tuple[int, set[str], str]:
        """-> (exit status, stages that ran, output)."""
        proc = python_m("doit", *self.arguments(*tasks, options=options), cwd=ROOT,
                        stderr_to_stdout=True)
        return proc.returncode, ran(proc.stdout), proc.stdout

    def report(self, gate: str) -> dict:
        return jsonio.read_json(self.out / "reports" / f"{gate}.json", "gate_report")


def ran(output: str) -> set[str]:
    return {line[3:].split(":")[0] for line in output.splitlines() if line.startswith(".  ")}


def one_layer_model(tiny_distilbert: Path, model: Path) -> Path:
    """A copy of the tiny DistilBERT at `model`, cut to one layer (stages run faster)."""
    shutil.copytree(tiny_distilbert, model)
    config = orjson.loads((model / "config.json").read_bytes())
    (model / "config.json").write_bytes(orjson.dumps({**config, "n_layers": 1}))
    return model


def one_layer_workspace(root: Path, tiny_distilbert: Path, kind=Workspace):
    """A workspace (`kind`) over a one-layer copy of the tiny DistilBERT."""
    return kind(root, one_layer_model(tiny_distilbert, root / "model"))


@pytest.fixture(scope="module")
def ws(tiny_distilbert, tmp_path_factory) -> Workspace:
    return one_layer_workspace(tmp_path_factory.mktemp("doit"), tiny_distilbert)


def test_first_run_promotes_and_second_run_does_nothing(ws):
    rc, stages, out = ws.doit()
    assert rc == 0, out
    assert stages == ALL
    receipt = jsonio.read_json(ws.out / "promotion.json", "promotion")
    assert receipt["dso"]["sha256"] == hashlib.sha256((ws.out / "kernel/kernel.so").read_bytes()).hexdigest()
    assert receipt["gates"]["perf"]["verdict"] == "pass"
    for ext in ("json", "md", "xml", "png"):
        assert (ws.out / "reports" / f"perf.{ext}").is_file()
    # the native engine was also timed before the kernel's library was loaded, as many trials
    perf = ws.report("perf")
    assert len(perf["native_alone"]["native_s"]) == len(perf["trials"]) == 5
    assert perf["summary"]["native_beside_over_alone"] > 0
    # each gate ran the spec's two texts and three of its own, drawn from seeds of their own
    correctness = ws.report("correctness")
    drawn = [item["text"] for item in correctness["drawn"]["items"]]
    assert [c["input"] for c in correctness["cases"]] == ws.spec["gates"]["texts"] + drawn
    assert [item["kind"] for item in correctness["drawn"]["items"]] == \
        ["corpus", "vocabulary", "perturbed"]
    assert len(perf["drawn"]["items"]) == 3 and perf["drawn"]["seed"] != correctness["drawn"]["seed"]
    rc, stages, out = ws.doit()
    assert (rc, stages) == (0, set()), out
    assert "-- promote:tiny" in out


def test_the_readme_library_example_runs_on_the_pipeline_outputs(ws):
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## The library")[1].split("```python\n")[1].split("```")[0]
    code = code.replace('"artifacts/pipelines/minilm_residual_add"', repr(str(ws.out)))
    assert repr(str(ws.out)) in code
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("pass "), proc.stderr


@pytest.mark.parametrize("file", ["kernel", "header"])
def test_a_kernel_source_or_header_change_reruns_only_kernel_stages(ws, file):
    with getattr(ws, file).open("a") as f:
        f.write(f'extern "C" int trtmc_test_{file}_variant() {{ return 2; }}\n')
    rc, stages, out = ws.doit()
    assert rc == 0, out
    assert stages == KERNEL_STAGES
    pinned = [s["path"] for s in jsonio.read_json(ws.out / "promotion.json", "promotion")["kernel_sources"]]
    assert pinned[0] == "kernel.cu" and "variant.h" in pinned
    assert any(p.endswith("examples/byok/trtmc_kernel.h") for p in pinned)  # found through residual_add.cu


def test_graph_option_change_reruns_inspect_select_and_after(ws):
    old_selection = (ws.out / "selection.json").read_bytes()
    ws.spec["build"]["sequence_length"] = 12
    ws.write_spec()
    rc, stages, out = ws.doit()
    assert rc == 0, out
    assert stages == ALL - {"export_dso"}

    # A selection made on the old graph is never used: the stage refuses it...
    (ws.out / "selection.json").write_bytes(old_selection)
    proc = subprocess.run([sys.executable, "-m", "pipeline.flow", "build_slot", str(ws.spec_path)],
                          cwd=ROOT, text=True, capture_output=True)
    assert proc.returncode == 2 and "stale" in proc.stderr, proc.stderr
    # ...and doit sees it does not match the graph, so it selects again.
    rc, stages, out = ws.doit()
    assert rc == 0 and "select" in stages, out
    graph = orjson.loads((ws.out / "graph.json").read_bytes())
    selection = orjson.loads((ws.out / "selection.json").read_bytes())
    assert selection["graph_fingerprint"] == graph["fingerprint"]


def test_revision_change_reruns_inspect_select_and_after(ws):
    config = orjson.loads((ws.model / "config.json").read_bytes())
    (ws.model / "config.json").write_bytes(orjson.dumps({**config, "initializer_range": 0.03}))
    rc, stages, out = ws.doit("build_slot")
    assert rc == 0, out
    assert stages == {"inspect", "select", "build_slot"}
    assert orjson.loads((ws.out / "graph.json").read_bytes())["build"]["revision"] != \
        orjson.loads((ws.out / "native.bundle/manifest.json").read_bytes())["revision"]


@pytest.mark.parametrize("rel", ["weights.safetensors", "kernel_slots.json", "config.json"])
def test_an_edited_file_of_a_built_bundle_rebuilds_the_bundle(ws, rel):
    """The rebuild writes the same bytes (builds are deterministic), so the verdicts on them
    stand and nothing after it runs."""
    assert ws.doit()[0] == 0  # up to date, whatever ran before
    path = ws.out / "slot.bundle" / rel
    built = path.read_bytes()
    path.write_bytes(built + b" ")
    rc, stages, out = ws.doit()
    assert (rc, stages) == (0, {"build_slot"}), out
    assert path.read_bytes() == built
    (ws.out / "slot.bundle" / "stray.txt").write_text("a file the bundle does not list")
    rc, stages, out = ws.doit()
    assert (rc, stages) == (0, {"build_slot"}), out
    assert not (ws.out / "slot.bundle" / "stray.txt").exists()
    rc, stages, out = ws.doit()
    assert (rc, stages) == (0, set()), out


def test_an_edited_receipt_is_written_again(ws):
    assert ws.doit()[0] == 0
    receipt = ws.out / "promotion.json"
    receipt.write_bytes(receipt.read_bytes().replace(b'"pass"', b'"PASS"', 1))
    rc, stages, out = ws.doit()
    assert (rc, stages) == (0, {"promote"}), out
    assert b'"PASS"' not in receipt.read_bytes()


def test_a_source_changed_after_the_dso_was_built_from_it_is_never_promoted(ws):
    """A kernel source edited while the gates run (after export_dso read it): the gated library
    was built from other bytes than the sources the receipt would pin."""
    rc, stages, out = ws.doit("perf")
    assert rc == 0, out
    (ws.out / "promotion.json").unlink(missing_ok=True)
    original = ws.kernel.read_bytes()
    ws.kernel.write_bytes(original + b"// edited while gated\n")
    try:
        proc = python_m("pipeline.flow", "promote", ws.spec_path, cwd=ROOT)
    finally:
        ws.kernel.write_bytes(original)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{ws.kernel}: changed since the DSO was built from it" in proc.stderr
    assert not (ws.out / "promotion.json").exists()
    # another toolchain than the one that built the DSO (simulated: tvm-ffi's version)
    other = {**os.environ, "TRTMC_ENV_OVERRIDE": '{"apache_tvm_ffi": "0.0.0"}'}
    proc = python_m("pipeline.flow", "promote", ws.spec_path, cwd=ROOT, env=other)
    assert proc.returncode == 2 and "built with another toolchain" in proc.stderr, proc.stderr
    rc, stages, out = ws.doit()
    assert (rc, stages) == (0, {"promote"}), out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_run_leaves_nothing_that_looks_up_to_date(ws, sig):
    """Kill doit and its stage while a stage runs; the next run re-runs that stage."""
    (ws.out / "promotion.json").unlink(missing_ok=True)
    proc = subprocess.Popen(ws.command(), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    killed = None
    for line in proc.stdout:
        if line.startswith(".  "):
            killed = line[3:].split(":")[0]
            os.killpg(proc.pid, sig)
            break
    proc.wait()
    proc.stdout.close()
    assert killed is not None and proc.returncode != 0
    rc, stages, out = ws.doit()
    assert rc == 0, out
    assert killed in stages and "promote" in stages
    assert (ws.out / "promotion.json").is_file()


def processes(matches: Callable[[list[bytes]], bool]) -> list[int]:
    """Pids of the processes whose arguments `matches`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and matches(cmd):
            pids.append(int(proc.name))
    return pids


def _stage_processes(spec_path: Path) -> list[int]:
    """Pids of `python -m pipeline.flow ... SPEC` processes of this workspace."""
    return processes(lambda cmd: b"pipeline.flow" in cmd and str(spec_path).encode() in cmd)


def _session(leader: int) -> list[int]:
    """Pids of the running processes in the session `leader` started, other than the leader:
    whatever a doit run started in a session of its own left running, however it was started
    (a zombie has stopped and is not counted)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == leader:
            continue
        try:
            fields = (proc / "stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z" and int(fields[3]) == leader:  # state, parent, group, session
            pids.append(int(proc.name))
    return pids


def _start_perf(ws) -> subprocess.Popen:
    """doit running the perf stage alone (no report of either gate left), in a session of its
    own; returned once doit has printed that the stage starts."""
    (ws.out / "promotion.json").unlink(missing_ok=True)
    for gate in ("correctness", "perf"):
        (ws.out / "reports" / f"{gate}.json").unlink(missing_ok=True)
    proc = subprocess.Popen(ws.command("perf"), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    for line in proc.stdout:
        if line.startswith(".  perf"):
            break
    return proc


def _stage_started(ws, doit: int) -> bool:
    """The perf stage is running: a child of doit's session with the command line doit was
    started with (the stage doit forked), or `python -m pipeline.flow ... SPEC`; a short-lived
    command run meanwhile is neither."""
    argv = [os.fsencode(arg) for arg in ws.command("perf")] + [b""]
    forked = set(_session(doit)) & set(processes(lambda cmd: cmd == argv))
    return bool(forked or _stage_processes(ws.spec_path))


def _wait_gone(ws, proc: subprocess.Popen) -> None:
    """doit has exited; give what it started up to a minute to go (a worker still starting when
    its stage died sees that once it runs: late, on a loaded 2-core machine)."""
    proc.wait()
    proc.stdout.close()
    deadline = time.monotonic() + 60
    while (_stage_processes(ws.spec_path) or _session(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)


def test_sigterm_to_doit_alone_stops_its_stage(ws):
    """Only doit gets the signal (not its process group): the running stage must stop too, and
    so must anything doit started for it, even when the signal comes as the stage starts."""
    proc = _start_perf(ws)
    proc.send_signal(signal.SIGTERM)  # at once: while the stage is being started
    _wait_gone(ws, proc)
    assert not _stage_processes(ws.spec_path) and not _session(proc.pid), "a process outlived doit"
    assert not (ws.out / "reports/perf.json").exists()

    proc = _start_perf(ws)
    try:
        # doit imports the stage's modules before it forks the stage: seconds, or a minute on a
        # loaded 2-core machine
        deadline = time.monotonic() + 180
        while not _stage_started(ws, proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _stage_started(ws, proc.pid), "the perf stage never started"
        proc.send_signal(signal.SIGTERM)
        _wait_gone(ws, proc)
    finally:  # never leave a doit holding the workspace's lock for the tests after this one
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not _stage_processes(ws.spec_path) and not _session(proc.pid), "the stage outlived doit"
    assert not (ws.out / "reports/perf.json").exists()
    rc, stages, out = ws.doit()
    assert rc == 0 and "perf" in stages, out


def test_a_run_stopped_by_sigterm_keeps_the_stages_that_finished(ws):
    """doit writes its database as a run ends: a SIGTERM to doit (a CI job's time limit) while a
    later stage runs must still record the stages before it, which the next run does not repeat."""
    (ws.out / "promotion.json").unlink(missing_ok=True)
    for gate in ("correctness", "perf"):
        (ws.out / "reports" / f"{gate}.json").unlink(missing_ok=True)
    proc = subprocess.Popen(ws.command(), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(".  perf"):  # correctness has finished
                proc.send_signal(signal.SIGTERM)
                break
        _wait_gone(ws, proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert any(line.startswith(".  perf") for line in seen), "".join(seen)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not _stage_processes(ws.spec_path) and not _session(proc.pid), "the stage outlived doit"
    rc, stages, out = ws.doit()
    assert (rc, stages) == (0, {"perf", "promote"}), out


def test_wrong_function_kernel_fails_correctness(ws):
    ws.spec["kernel"] = {"source": str(ROOT / "tests/kernels/residual_sub.cu")}
    ws.write_spec()
    rc, stages, out = ws.doit()
    assert rc != 0 and "TaskFailed - taskid:correctness:tiny" in out, out
    report = ws.report("correctness")
    assert not report["passed"] and not report["probe"]["passed"]
    assert not (ws.out / "promotion.json").exists()
    assert 'failures="' in (ws.out / "reports/correctness.xml").read_text()
    # the earlier kernel's passing perf reports went with its verdict
    assert not list((ws.out / "reports").glob("perf.*")), list((ws.out / "reports").iterdir())


def _perf_not_passed(ws, source: str, perf: dict, capabilities: list[str]) -> dict:
    """The workspace's kernel (granted `capabilities`) and perf block set to these, a doit run:
    correctness passes, perf does not, nothing is promoted. -> the perf report."""
    ws.spec["kernel"] = {"source": str(ROOT / source), "capabilities": capabilities}
    ws.spec["gates"]["perf"] = perf
    ws.write_spec()
    rc, stages, out = ws.doit()
    assert rc != 0 and "TaskFailed - taskid:perf:tiny" in out, out
    assert ws.report("correctness")["passed"]
    assert not (ws.out / "promotion.json").exists()
    return ws.report("perf")


def test_slow_kernel_fails_perf(ws):
    perf = _perf_not_passed(ws, "tests/kernels/residual_add_slow.cu",
                            {"trials": 9, "warmup": 1}, ["time"])  # the default threshold, 0.98
    assert perf["verdict"] == "fail" and perf["summary"]["ci_high"] < 0.98


@pytest.mark.alone  # the native arm's core must not be another worker's
def test_a_kernel_whose_library_holds_back_its_process_cannot_hold_back_the_native_engine(ws):
    """Right, but once called its library ties its process to one core and spins three threads
    there. Its process is the kernel host, not the native engine's: the native arm runs as fast
    beside it as before it started, and the kernel's own arm is what slows down. 128 texts a run,
    so that a run outlasts the scheduler's time slices."""
    texts = ws.spec["gates"]["texts"]
    ws.spec["gates"]["texts"] = texts * 64
    try:
        perf = _perf_not_passed(ws, "tests/kernels/residual_add_holds_native.cu",
                                {"trials": 9, "warmup": 1, "threshold": 0.5}, ["threads"])
    finally:
        ws.spec["gates"]["texts"] = texts
    assert perf["verdict"] != "pass", perf["message"]
    assert perf["summary"]["native_beside_over_alone"] > 0.75, perf["summary"]
    assert perf["summary"]["median_ratio"] < 0.75, perf["summary"]


def test_a_kernel_that_exits_fails_its_gate_and_leaves_no_pass_behind(ws):
    """A kernel that calls exit(0) in the correctness gate's kernel host: the stage fails with an
    aborted report in place of the pass the last kernel left, and stays out of date."""
    ws.spec["kernel"] = {"source": str(ROOT / "examples/byok/residual_add.cu")}
    ws.spec["gates"]["perf"] = {"trials": 5, "warmup": 1, "threshold": 0.001}
    ws.write_spec()
    rc, _, out = ws.doit("correctness")
    assert rc == 0 and ws.report("correctness")["passed"], out
    ws.spec["kernel"] = {"source": str(ROOT / "tests/kernels/residual_add_exit.cu"),
                         "capabilities": ["exit"]}
    ws.write_spec()
    for _ in range(2):  # a failed stage is never up to date
        rc, stages, out = ws.doit("correctness")
        assert rc == 1 and "correctness" in stages, out
        report = ws.report("correctness")
        assert not report["passed"] and report["aborted"]["how"] == "exit", report
        assert "the kernel host exited with status 0" in report["message"]
    assert not (ws.out / "promotion.json").exists()
    ledger = (ws.out / "ledger.jsonl").read_text().splitlines()
    assert '"aborted":"exit"' in ledger[-1]


def test_stages_run_under_doit_n(ws):
    """`doit -n 2` runs stages from doit's worker processes; a stage checks it still has doit
    among its parents, not that doit is its parent."""
    ws.spec["kernel"] = {"source": str(ROOT / "examples/byok/residual_add.cu")}
    ws.write_spec()
    rc, stages, out = ws.doit(options=("-n", "2"))
    assert rc == 0 and "promote" in stages, out
    assert (ws.out / "promotion.json").is_file()


def test_a_mistake_a_stage_finds_in_the_spec_exits_2(ws):
    """A gate that does not pass is doit's exit status 1; a mistake in the spec or its inputs,
    found by a stage (here a node name the graph lacks), is 2, after the stage's one line."""
    ws.spec["selection"] = {"node_names": ["no.such.node"], "binding_id": "tiny.layer0.residual"}
    ws.write_spec()
    rc, _, out = ws.doit("select")
    assert rc == 2, out
    assert "$.selection.node_names[0]: no node named 'no.such.node'" in out


_OUT_OF_MEMORY = """
import dataclasses, sys, torch
from pipeline.flow import __main__ as flow
said = ("CUDA out of memory. Tried to allocate 80.00 MiB. GPU 0 has a total capacity of 79.18 GiB "
        "of which 48.56 MiB is free. Including non-PyTorch memory, this process has 54.57 GiB")
def judge(spec):  # as torch raises it in the gate's own process
    raise torch.OutOfMemoryError(said)
def host(spec):  # as the client relays it from the kernel host
    raise RuntimeError("correctness gate: the kernel host raised:\\ntorch.OutOfMemoryError: " + said)
action = {"judge": judge, "host": host}[sys.argv[1]]
flow.BY_NAME = {**flow.BY_NAME, "perf": dataclasses.replace(flow.BY_NAME["perf"], action=action)}
sys.exit(flow.main(["perf", sys.argv[2]]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["judge", "host"])
def test_a_stage_out_of_gpu_memory_ends_in_one_line(where, tmp_path):
    spec = ROOT / "tests" / "specs" / "hostile_gpu_hang.json"
    done = subprocess.run([sys.executable, "-c", _OUT_OF_MEMORY, where, str(spec)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRTMC_STAGE_LOCK": str(tmp_path / "lock")})
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == [line for line in done.stderr.splitlines() if line.strip()
                      and not line.startswith("[")], done.stderr
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert errors[0].startswith(f"perf: error: {spec}: the GPU ran out of memory (")
    assert "Tried to allocate 80.00 MiB" in errors[0] and "max_cache_length" in errors[0]
