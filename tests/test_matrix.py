"""`trtmc matrix`: many specs' pipelines, here one after another or on a private local Ray
cluster; a promoted spec, a spec whose correctness gate fails (a kernel computing the wrong
function), a spec that does not load, and a spec whose kernel exporter kills the process running
its pipeline (as the kernel's out-of-memory killer would)."""
from __future__ import annotations

import re
import stat
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import orjson
import pytest

from pipeline.errors import UserError
from tests.forked_python import python_m
from tests.test_doit_pipeline import one_layer_model, processes
from tests.test_pipeline_command import copy_kernels, tiny_spec

# exporters that kill, as the kernel's out-of-memory killer would, the process running this
# spec's pipeline, or the one that started it (on Ray, the worker), then fail
KILLERS = {"kill_runner.sh": 'kill -9 "$TRTMC_DOIT_PID"\nexit 1\n',
           "kill_worker.sh": 'kill -9 "$(cut -d" " -f4 /proc/"$TRTMC_DOIT_PID"/stat)"\nsleep 60\n'
                             'exit 1\n'}


def _killer(script: str) -> dict:
    return {"exporter": ["sh", script, "{output}"], "sources": [script]}


@pytest.fixture(scope="module")
def specs(tiny_distilbert, tmp_path_factory) -> dict[str, Path]:
    """The specs, on a one-layer DistilBERT folder beside them (a matrix on Ray ships it)."""
    root = tmp_path_factory.mktemp("matrix")
    copy_kernels(root)
    one_layer_model(tiny_distilbert, root / "model")
    folder = root / "specs"
    folder.mkdir()
    for name, body in KILLERS.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}")
        (folder / name).chmod((folder / name).stat().st_mode | stat.S_IXUSR)
    kernels = {
        "good": {"source": "../examples/byok/residual_add.cu"},
        "wrong": {"source": "../tests/kernels/residual_sub.cu"},
        "bad": {"source": "../examples/byok/no_such_kernel.cu"},
        "killed": _killer("kill_runner.sh"),
    }
    return {name: tiny_spec(folder, name, kernel, model="../model") for name, kernel in kernels.items()}


def _running(needle: bytes) -> list[int]:
    """Pids of the processes with an argument that holds `needle`."""
    return processes(lambda cmd: any(needle in arg for arg in cmd))


def _cmdline(pid: int) -> str:
    """A process's command line, to name what is left running."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def matrix(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "matrix", *map(str, args)],
                          cwd=cwd, text=True, capture_output=True, timeout=900)


def rows(summary: str) -> dict[str, list[str]]:
    """The summary table's rows by spec name: [status, correctness, perf, ran on, time, detail]."""
    out = {}
    for line in summary.splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 7 and cells[0] not in ("spec", "---"):
            out[cells[0]] = cells[1:]
    return out


def junit_cases(path: Path) -> dict[str, str]:
    """testcase classname.name -> passed / failure / error."""
    root = ET.parse(path).getroot()
    return {f"{c.get('classname')}.{c.get('name')}":
            "failure" if c.find("failure") is not None else
            "error" if c.find("error") is not None else "passed"
            for c in root.iter("testcase")}


def check_results(results: Path, summary: dict[str, list[str]], ran_on: str) -> None:
    assert summary["good"][:3] == ["passed", "pass", "pass"] and summary["good"][3] == ran_on
    assert summary["wrong"][:2] == ["failed", "fail"], summary["wrong"]
    assert "correctness gate fail" in summary["wrong"][5]
    assert summary["bad"][0] == "error" and "$.kernel.source" in summary["bad"][5]
    assert summary["killed"][0] == "crashed", summary
    assert "the pipeline process was killed by signal 9 (SIGKILL) mid-run" in summary["killed"][5]
    good = results / "good"
    receipt = orjson.loads((good / "promotion.json").read_bytes())
    assert receipt["gates"]["perf"]["verdict"] == "pass"
    assert (good / "reports" / "correctness.xml").is_file() and (good / "ledger.jsonl").is_file()
    assert not (results / "wrong" / "promotion.json").exists()
    cases = junit_cases(results / "junit.xml")
    assert cases["trtmc.good.perf.perf_ratio"] == "passed"
    assert "failure" in {v for k, v in cases.items() if k.startswith("trtmc.wrong.correctness")}
    assert cases["trtmc.bad.pipeline"] == "error" and cases["trtmc.killed.pipeline"] == "error"
    assert (results / "summary.md").read_text().startswith("# trtmc matrix")


@pytest.mark.slow
@pytest.mark.long
def test_matrix_here_runs_each_spec_and_reports_every_outcome(specs, tmp_path):
    proc = matrix(*specs.values(), "-o", tmp_path / "results", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    check_results(tmp_path / "results", rows(proc.stdout), "cpu")


@pytest.mark.slow
@pytest.mark.long
def test_matrix_on_a_local_ray_cluster_reports_every_outcome(specs, tmp_path):
    """Also a spec whose exporter kills the Ray worker running it: the matrix reports the worker's
    death, and the pipeline process that worker started dies with it."""
    pytest.importorskip("ray")
    worker_killed = tiny_spec(specs["good"].parent, "worker_killed", _killer("kill_worker.sh"),
                              model="../model")
    proc = matrix(*specs.values(), worker_killed, "--ray", "local", "--ray-init",
                  '{"num_cpus": 2}', "-o", tmp_path / "results", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = rows(proc.stdout)
    check_results(tmp_path / "results", summary, "cpu")
    assert summary["worker_killed"][0] == "crashed", summary
    assert "the Ray worker died mid-run" in summary["worker_killed"][5]
    deadline = time.monotonic() + 20
    while _running(b"worker_killed") and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: _cmdline(pid) for pid in _running(b"worker_killed")}
    assert not left, f"the pipeline outlived its Ray worker: {left}"


def test_resources_follow_the_spec_device_and_gpu_model(tmp_path):
    from pipeline.flow.matrix import parse_gpu_models, plan
    cpu = tiny_spec(tmp_path, "cpu_spec", {"dso": "k.so"})
    (tmp_path / "k.so").write_bytes(b"")
    gpu = tiny_spec(tmp_path, "gpu_spec", {"dso": "k.so"})
    auto = tiny_spec(tmp_path, "auto_spec", {"dso": "k.so"})
    for path, device in ((gpu, "cuda"), (auto, "auto")):
        raw = orjson.loads(path.read_bytes())
        raw["gates"]["device"] = device
        path.write_bytes(orjson.dumps(raw))
    models = parse_gpu_models(["H200", "auto_spec=A100"])
    e = {x.name: x for x in plan([str(cpu), str(gpu), str(auto)], True, models, local=False)}
    assert e["cpu_spec"].resources() == {"num_cpus": 1, "num_gpus": 0}
    assert e["gpu_spec"].resources() == {"num_cpus": 1, "num_gpus": 1,
                                         "resources": {"accelerator_type:H200": 0.001}}
    assert e["auto_spec"].resources()["resources"] == {"accelerator_type:A100": 0.001}
    e = {x.name: x for x in plan([str(auto)], False, {}, local=False)}
    assert e["auto_spec"].resources()["num_gpus"] == 0


@pytest.mark.slow
def test_a_simulated_gpu_cluster_never_shares_a_gpu_and_honours_the_model(tmp_path):
    """Two fake GPUs labelled H200 on a local cluster: three GPU tasks never run more than two
    at a time, each sees one device of its own, and a task asking for another model waits."""
    ray = pytest.importorskip("ray")
    from pipeline.flow.matrix import Entry
    ray.init(num_cpus=4, num_gpus=2, resources={"accelerator_type:H200": 2},
             include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(max_calls=1, max_retries=0)
        def hold():
            import os
            import time
            start = time.time()
            time.sleep(0.5)
            return os.environ.get("CUDA_VISIBLE_DEVICES"), start, time.time()
        other = Entry("y.json", "y", gpu=True, gpu_model="A100").resources()
        waiting = hold.options(**other).remote()  # first in line, so it had every chance to run
        gpu = Entry("x.json", "x", gpu=True, gpu_model="H200").resources()
        spans = ray.get([hold.options(**gpu).remote() for _ in range(3)])
        assert all(len(dev.split(",")) == 1 for dev, _, _ in spans)
        overlapping = max(sum(1 for _, s, t in spans if s <= start < t) for _, start, _ in spans)
        assert overlapping <= 2
        ready, _ = ray.wait([waiting], timeout=0.5)
        assert ready == []  # no node has an A100: the task is not scheduled
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_missing_or_bad_options_are_one_line(tmp_path, specs):
    proc = matrix(specs["good"], "--ray-init", "{}", "-o", tmp_path / "r", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--ray-init: only with --ray local" in proc.stderr
    proc = matrix(specs["good"], "--gpu-model", "nobody=H200", "-o", tmp_path / "r", cwd=tmp_path)
    assert proc.returncode == 2 and "no spec of the matrix has that name" in proc.stderr
    code = ("import sys; sys.modules['ray'] = None\n"
            "from pipeline.cli import main\n"
            f"sys.exit(main(['matrix', {str(specs['good'])!r}, '--ray', 'local', '-o', "
            f"{str(tmp_path / 'r')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "pip install 'trtmc[ray]'" in proc.stderr


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"), ("[2]", "expected a JSON object of ray.init arguments, got list"),
    ('{"num_cpus": 1, "num_cpus": 2}', 'duplicate key "num_cpus"'),
])
def test_a_bad_ray_init_is_one_line_naming_the_flag(text, message):
    from pipeline.cli.args import ray_init
    with pytest.raises(UserError, match=f"^--ray-init: .*{re.escape(message)}"):
        ray_init(text)
    assert ray_init('{"num_cpus": 2}') == {"num_cpus": 2}


@pytest.mark.slow
def test_importing_the_package_and_its_commands_loads_no_ray():
    code = ("import sys, pipeline.cli, pipeline.flow.matrix, pipeline.flow.tasks\n"
            "pipeline.cli.parser()\nprint('ray' in sys.modules, 'doit' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


@pytest.mark.slow
def test_in_place_on_ray_reuses_what_was_built_where_the_spec_is(specs, tmp_path, monkeypatch):
    """The CPU-build / GPU-gate split on a cluster: a spec built where it is (`trtmc pipeline`),
    then run by a Ray task in place, runs no stage again (its own output folder and doit
    database), also when the task's shipped copy of the code would resolve a spec without
    $.output elsewhere (the driver hands it its root); --in-place needs --ray."""
    pytest.importorskip("ray")
    from pipeline.flow.matrix import run_in_worker, stage_code
    from pipeline.flow.spec import ROOT_ENV
    raw = orjson.loads(specs["good"].read_bytes())
    del raw["output"]
    spec = specs["good"].with_name("no_output.json")
    spec.write_bytes(orjson.dumps({**raw, "name": "no_output"}))
    root = tmp_path / "root"
    monkeypatch.setenv(ROOT_ENV, str(root))
    built = python_m("pipeline.cli", "pipeline", spec, cwd=tmp_path)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    assert (root / "artifacts/pipelines/no_output/promotion.json").is_file()
    proc = matrix(spec, "--ray", "local", "--ray-init", '{"num_cpus": 2}', "--in-place",
                  "-o", tmp_path / "results", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rows(proc.stdout)["no_output"][:3] == ["passed", "pass", "pass"]
    log = (tmp_path / "results/no_output/pipeline.log").read_text()
    assert "-- perf:no_output" in log and not re.search(r"^\.  ", log, re.M), log
    assert (tmp_path / "results/no_output/promotion.json").is_file()
    alone = matrix(spec, "--in-place", "-o", tmp_path / "r2", cwd=tmp_path)
    assert alone.returncode == 2 and alone.stderr.strip().endswith(
        "--in-place: only with --ray (without it every spec runs in place, here)"), alone.stderr
    # the Ray task's own step, from a shipped copy of the code, without the variable around it
    shipped = tmp_path / "shipped"
    stage_code(shipped)
    monkeypatch.chdir(shipped)
    monkeypatch.delenv(ROOT_ENV)
    result = run_in_worker(str(spec), str(root))
    log = result["log"].decode()
    assert result["rc"] == 0 and not re.search(r"^\.  ", log, re.M), log
    assert "promotion.json" in result["files"] and not (shipped / "artifacts").exists()


def test_a_spec_named_like_a_folder_the_matrix_did_not_write_or_a_combined_file_is_refused(tmp_path):
    """Writing a spec's results replaces DIR/NAME: only a folder the matrix wrote (its marker in
    it) may be replaced, and no spec may be named like DIR/junit.xml or DIR/summary.md. Checked
    before anything runs."""
    from pipeline.flow.matrix import MARKER, Entry, check_folders, write_results
    out = tmp_path / "results"
    (out / "mine").mkdir(parents=True)
    (out / "mine" / "thesis.tex").write_text("kept")
    with pytest.raises(UserError, match=r"mine: exists and is not a folder trtmc matrix wrote"):
        check_folders([Entry("spec.json", "mine")], out)
    for name in ("junit.xml", "summary.md"):
        with pytest.raises(UserError, match=f"name '{name}' is the name of the matrix's combined"):
            check_folders([Entry("spec.json", name)], out)
    assert (out / "mine" / "thesis.tex").read_text() == "kept"
    write_results([Entry("spec.json", "ours", status="error", message="did not load",
                         files={"reports/x.json": b"{}"})], out)
    assert (out / "ours" / MARKER).is_file()
    check_folders([Entry("spec.json", "ours")], out)  # its own folder: replaced next time


def test_a_workers_report_is_read_as_strictly_as_a_report_file():
    """The verdicts a matrix shows come from reports its workers send back, read as any report
    file is: a valid failing report gives its verdict and message, one the schema refuses shows as
    unreadable rather than as the verdict it claims."""
    from pipeline.flow.matrix import outcome
    recorded = Path(__file__).resolve().parent.parent / "docs" / "data" / "h100-kernel-host-2026-12-06"
    perf = orjson.loads((recorded / "perf.json").read_bytes())
    failing = {**perf, "verdict": "fail", "passed": False, "message": "slower"}
    files = {"reports/correctness.json": (recorded / "correctness.json").read_bytes(),
             "reports/perf.json": orjson.dumps(failing)}
    assert outcome(1, files, b"") == ("failed", "perf gate fail: slower",
                                      {"correctness": "pass", "perf": "fail"})
    files["reports/perf.json"] = orjson.dumps({**perf, "verdict": "maybe"})
    assert outcome(0, files, b"")[2] == {"correctness": "pass", "perf": "unreadable"}
