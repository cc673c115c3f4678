"""One verdict per environment: doit re-runs exactly the stages whose output depends on the
machine when the machine changes, and `trtmc gate verify` refuses a receipt reached elsewhere.

The pipeline runs for real (`doit -f dodo.py` in a subprocess) on a tiny DistilBERT, gated on
`auto`; another machine is reported through TRTMC_ENV_OVERRIDE. The doit tests share one
workspace and run in order, reading which tasks ran from doit's `.  task` lines.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import torch
import yaml

from pipeline import jsonio
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.gates import environment
from pipeline.gates.policy import GatePolicy
from pipeline.gates.settings import PerfSettings
from test_doit_pipeline import one_layer_workspace
from tests.forked_python import python_m

ROOT = Path(__file__).resolve().parent.parent
GATE_STAGES = {"correctness", "perf", "promote"}
KERNEL_STAGES = {"export_dso", "bind"} | GATE_STAGES
ALL = {"inspect", "select", "build_native", "build_slot"} | KERNEL_STAGES
NEWER_TORCH = {"torch": "2.14.0"}
# the tests take turns on one workspace, in order, so they run on one worker
pytestmark = pytest.mark.xdist_group("environment_workspace")
GPU = {"gpus": [{"name": "NVIDIA H200", "arch": "90"}], "gpu_driver": "570.86.15",
       "cuda": "12.8", "nvcc": "Cuda compilation tools, release 12.8, V12.8.93"}


def _env(override: dict | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != environment.OVERRIDE}
    if override is not None:
        env[environment.OVERRIDE] = orjson.dumps(override).decode()
    return env


class Workspace:
    def __init__(self, root: Path, model: Path):
        self.root, self.spec_path, self.out = root, root / "spec.json", root / "out"
        self.receipt = self.out / "promotion.json"
        self.spec_path.write_bytes(orjson.dumps({
            "schema_version": 1, "name": "tiny", "model": str(model),
            "build": {"precision": "fp32", "sequence_length": 16}, "engine_role": "decode",
            "bundle": {"plans": False},
            "selection": {"node_names": ["encoder.layers.0.attention_residual_add"],
                          "binding_id": "tiny.layer0.residual"},
            "kernel": {"source": str(ROOT / "examples/byok/residual_add.cu")},
            "gates": {"device": "auto", "texts": ["Hello world!"],
                      # a low threshold: these tests are about what re-runs, not timing
                      "perf": {"trials": 5, "warmup": 1, "threshold": 0.001}},
            "output": str(self.out)}))

    def doit(self, override: dict | None = None) -> tuple[int, set[str], str]:
        """-> (exit status, stages that ran, output), on the machine `override` reports."""
        proc = python_m("doit", "-f", ROOT / "dodo.py", "--db-file", self.root / "doit.db",
                        "--backend", "sqlite3", "-v", "2", f"spec={self.spec_path}", cwd=ROOT,
                        env=_env(override), stderr_to_stdout=True)
        ran = {line[3:].split(":")[0] for line in proc.stdout.splitlines()
               if line.startswith(".  ")}
        return proc.returncode, ran, proc.stdout


def verify(monkeypatch, capsys, receipt: Path, *flags: str, override: dict | None = None):
    """`trtmc gate verify` on the machine `override` reports -> (exit status, stdout)."""
    if override is None:
        monkeypatch.delenv(environment.OVERRIDE, raising=False)
    else:
        monkeypatch.setenv(environment.OVERRIDE, orjson.dumps(override).decode())
    rc = main(["gate", "verify", str(receipt), *flags])
    return rc, capsys.readouterr().out


@pytest.fixture(scope="module")
def ws(tiny_distilbert, tmp_path_factory) -> Workspace:
    return one_layer_workspace(tmp_path_factory.mktemp("environment"), tiny_distilbert, Workspace)


@pytest.mark.slow
def test_the_same_machine_reruns_nothing_and_its_receipt_verifies(ws, monkeypatch, capsys):
    rc, ran, out = ws.doit()
    assert (rc, ran) == (0, ALL), out
    rc, ran, out = ws.doit()
    assert (rc, ran) == (0, set()), out
    env = jsonio.read_json(ws.receipt, "promotion")["environment"]
    assert (env["device"], env["engine"], env["gpu"]) == ("cpu", "eager", None)
    assert env["torch"] == torch.__version__ and env["triton"] == environment.probe()["triton"]
    rc, out = verify(monkeypatch, capsys, ws.receipt)
    assert rc == 0 and "env " not in out and out.startswith("ok  ") and "\nverified: " in out, out
    # a CPU verdict holds for the CPU that reached it: another model is another verdict
    rc, out = verify(monkeypatch, capsys, ws.receipt, override={"cpu": "Another CPU"})
    assert rc == 1 and f"env   cpu: recorded {env['cpu']!r}, now 'Another CPU'" in out.splitlines(), out
    # nor does a simulated machine verify as this one, whatever it claims
    monkeypatch.delenv(environment.OVERRIDE)
    claimed = {k: environment.probe()[k] for k in ("cpu", "torch")}
    rc, out = verify(monkeypatch, capsys, ws.receipt, override=claimed)
    assert rc == 1 and [line for line in out.splitlines() if line.startswith("env ")] == [
        "env   TRTMC_ENV_OVERRIDE: recorded None, now ['cpu', 'torch']"], out


def test_the_cpu_model_decides_a_cpu_verdict_and_not_a_gpu_one(monkeypatch):
    """What doit's gate stages and verify compare: the CPU model only where it is the device."""
    def key(device: str, **override) -> dict:
        monkeypatch.setenv(environment.OVERRIDE, orjson.dumps(override).decode())
        return environment.verdict_key(environment.gate_environment(device))
    assert key("cpu", cpu="CPU A")["cpu"] == "CPU A"
    assert key("cpu", cpu="CPU A") != key("cpu", cpu="CPU B")
    assert key("cuda", cpu="CPU A", **GPU) == key("cuda", cpu="CPU B", **GPU)


@pytest.mark.slow
def test_another_torch_reruns_the_gates_and_promote_only(ws):
    rc, ran, out = ws.doit(NEWER_TORCH)
    assert (rc, ran) == (0, GATE_STAGES), out
    rc, ran, out = ws.doit(NEWER_TORCH)
    assert (rc, ran) == (0, set()), out
    assert jsonio.read_json(ws.receipt, "promotion")["environment"]["torch"] == "2.14.0"


@pytest.mark.slow
def test_verify_names_the_environment_difference_and_can_ignore_it(ws, monkeypatch, capsys):
    rc, out = verify(monkeypatch, capsys, ws.receipt)
    assert rc == 1 and "NOT verified" in out, out
    # reached under a simulated torch (the run before): never this machine's verdict
    assert [line for line in out.splitlines() if line.startswith("env ")] == \
        [f"env   torch: recorded '2.14.0', now '{torch.__version__}'",
         "env   TRTMC_ENV_OVERRIDE: recorded ['torch'], now None"]
    assert "DIFF" not in out  # every digest matches: the environment alone refuses it
    rc, out = verify(monkeypatch, capsys, ws.receipt, "--ignore-environment")
    assert rc == 0 and "\nverified: " in out, out
    assert f"note  torch: recorded '2.14.0', now '{torch.__version__}'" in out
    assert "env " not in out


@pytest.mark.slow
def test_a_cpu_verdict_does_not_verify_on_a_gpu_machine(ws, monkeypatch, capsys):
    rc, ran, out = ws.doit()  # back on this machine: a CPU verdict again
    assert (rc, ran) == (0, GATE_STAGES), out
    rc, out = verify(monkeypatch, capsys, ws.receipt, override=GPU)
    assert rc == 1 and "NOT verified" in out, out
    for line in ("env   device: recorded 'cpu', now 'cuda'",
                 "env   gpu: recorded None, now 'NVIDIA H200'",
                 "env   gpu_driver_major: recorded None, now '570'",
                 "env   engine: recorded 'eager', now 'optimized'"):
        assert line in out.splitlines(), out


@pytest.mark.slow
def test_a_gpu_machine_reruns_the_kernel_stages_too(ws, monkeypatch, capsys):
    rc, ran, out = ws.doit(GPU)  # the DSO's target is CUDA there: export_dso and bind too
    assert (rc, ran) == (0, KERNEL_STAGES), out
    env = jsonio.read_json(ws.receipt, "promotion")["environment"]
    assert (env["device"], env["engine"], env["gpu"]) == ("cuda", "optimized", "NVIDIA H200")
    rc, out = verify(monkeypatch, capsys, ws.receipt)
    assert rc == 1 and "env   device: recorded 'cuda', now 'cpu'" in out.splitlines(), out
    rc, ran, out = ws.doit({**GPU, "gpu_driver": "570.124.06"})  # the same driver branch
    assert (rc, ran) == (0, set()), out


@pytest.mark.slow
def test_a_pinned_file_of_another_size_is_one_line_and_never_hashed(ws, monkeypatch, capsys):
    dso = ws.out / "kernel" / "kernel.so"
    kept = dso.read_bytes()
    try:
        with dso.open("r+b") as f:
            f.truncate(60 << 30)  # sparse: hashing it would read 60 GB of zeros
        t0 = time.perf_counter()
        rc, out = verify(monkeypatch, capsys, ws.receipt, override=GPU)
        assert time.perf_counter() - t0 < 30
        doc = jsonio.read_json(ws.receipt, "promotion")
        diff = [line for line in out.splitlines() if line.startswith("DIFF")]
        assert rc == 1 and diff == [f"DIFF  dso  {dso}  expected {doc['dso']['sha256'][:12]}, "
                                    f"{60 << 30} bytes, the receipt pins {len(kept)} (not hashed)"]
        doc["dso"]["size"] = 60 << 30
        ws.receipt.write_bytes(orjson.dumps(doc))  # a receipt that pins the 60 GB file
        rc = main(["gate", "verify", str(ws.receipt)])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.splitlines()) == 1 and "$.dso.size" in err, err
    finally:
        dso.write_bytes(kept)


def test_a_bad_override_is_one_line_naming_the_variable(ws):
    proc = subprocess.run([sys.executable, "-m", "doit", "-f", str(ROOT / "dodo.py"), "--db-file",
                           str(ws.root / "bad.db"), f"spec={ws.spec_path}"], cwd=ROOT, text=True,
                          env=_env({"torch": None}), capture_output=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "dodo.py: error: TRTMC_ENV_OVERRIDE: field 'torch': expected a string, got null"], \
        proc.stderr


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"), ("[]", "expected a JSON object of probe fields, got list"),
    ('{"gpu": "H200"}', "unknown field 'gpu' (expected one of python, platform, cpu, torch"),
    ('{"gpus": ["H200"]}', 'field \'gpus\': expected [{"name": STR, "arch": STR}, ...]'),
])
def test_an_override_is_checked(monkeypatch, text, message):
    monkeypatch.setenv(environment.OVERRIDE, text)
    with pytest.raises(UserError, match=f"^TRTMC_ENV_OVERRIDE: .*{re.escape(message)}"):
        environment.probe()


def test_the_build_target_follows_the_kernel_block_and_the_machine(monkeypatch):
    from pathlib import Path

    from pipeline.kernels.block import CudaSource, PrebuiltDso
    source = CudaSource("run", (), source=Path("k.cu"), cuda=None)
    monkeypatch.setenv(environment.OVERRIDE, orjson.dumps(GPU).decode())
    assert environment.build_key(source)["target"] == "CUDA 90 + CPU"
    assert environment.build_key(CudaSource("run", (), Path("k.cu"), cuda=False))["target"] == "CPU only"
    monkeypatch.setenv("TVM_FFI_CUDA_ARCH_LIST", "90a,100a")
    assert environment.build_key(source)["target"] == "CUDA 90a,100a + CPU"
    monkeypatch.setenv(environment.OVERRIDE, orjson.dumps({**GPU, "nvcc": None}).decode())
    assert environment.build_key(source)["target"] == "CPU only"  # no nvcc: a CPU build
    assert "target" not in environment.build_key(PrebuiltDso("run", (), dso=Path("k.so")))


def test_the_ci_workflow_gates_on_a_gpu_after_a_cpu_job():
    text = (ROOT / "examples/ci/gates.yml").read_text()
    assert text in (ROOT / "docs/ci-workflow.md").read_text()  # the doc shows this very file
    jobs = yaml.safe_load(text)["jobs"]
    cpu, gpu = jobs["cpu"], jobs["gpu"]
    assert gpu["needs"] == "cpu" and "self-hosted" in gpu["runs-on"]
    assert cpu["strategy"]["matrix"] == gpu["strategy"]["matrix"]
    runs = {name: [s.get("run", "") for s in job["steps"]] for name, job in jobs.items()}
    assert not any("torch==" in run for run in runs["gpu"])  # the GPU runner's own CUDA torch
    assert any("download.pytorch.org/whl/cu" in run for run in runs["gpu"])
    assert any(run.startswith("doit spec=") and "build_slot" in run for run in runs["cpu"])
    assert not any("export_dso" in run or "gate verify" in run for run in runs["cpu"])
    gates = runs["gpu"].index("doit spec=${{ matrix.spec }}")  # every stage, then the receipt
    verify = next(run for run in runs["gpu"][gates + 1:] if run.startswith("trtmc gate verify"))
    policy = GatePolicy.read(ROOT / verify.split("--policy")[1].split()[0])  # the job's floors
    assert policy.min_threshold == PerfSettings().threshold  # the default, not a lower one
    restore = next(s for s in gpu["steps"] if s.get("uses", "").startswith("actions/cache/restore"))
    saved = next(s for s in cpu["steps"] if s.get("uses", "").startswith("actions/cache/save"))
    assert restore["with"]["key"] == saved["with"]["key"] and "artifacts/.doit.db" in \
        saved["with"]["path"]


def test_the_ci_workflow_signs_receipts_in_a_job_that_never_runs_a_gate():
    jobs = yaml.safe_load((ROOT / "examples/ci/gates.yml").read_text())["jobs"]
    sign = jobs["sign"]
    assert sign["needs"] == "gpu" and sign["runs-on"] == "ubuntu-latest"
    assert sign["if"] == "github.event_name == 'push'"  # pull requests get no secrets
    assert sign["strategy"]["matrix"] == jobs["gpu"]["strategy"]["matrix"]
    runs = [s.get("run", "") for s in sign["steps"]]
    assert not any("doit" in run or "--kernel-bindings" in run for run in runs)
    step = next(s for s in sign["steps"] if "trtmc gate sign" in s.get("run", ""))
    assert step["env"]["TRTMC_SIGNING_KEY"] == "${{ secrets.TRTMC_SIGNING_KEY }}"
    restored = next(s for s in sign["steps"] if s.get("uses", "").startswith("actions/cache/restore"))
    saved = next(s for s in jobs["gpu"]["steps"] if s.get("uses", "").startswith("actions/cache/save")
                 and "doit.db" in s["with"]["path"])
    assert restored["with"]["key"] == saved["with"]["key"]  # what the gpu job gated


def test_the_schemas_modes_are_the_engines_modes():
    """The spec's and the receipt's `gates.mode` and the receipt's `environment.engine` accept
    exactly the modes a pipeline can open in; the default is decided by one function, which
    the recorded environment and `open_pipeline` share."""
    from pipeline.modes import MODES, Mode
    spec = orjson.loads((ROOT / "schemas/pipeline_spec.schema.json").read_bytes())
    receipt = orjson.loads((ROOT / "schemas/promotion.schema.json").read_bytes())
    gates = receipt["properties"]["gates"]["properties"]
    assert spec["properties"]["gates"]["properties"]["mode"]["enum"] == [*MODES, None]
    assert gates["mode"]["enum"] == [*MODES, None]
    assert receipt["properties"]["environment"]["properties"]["engine"]["enum"] == list(MODES)
    for device, mode in (("cpu", None), ("cuda", None), ("cpu", "optimized"), ("cuda", "eager")):
        assert environment.gate_environment(device, mode)["engine"] == Mode.of(mode, device)
    with pytest.raises(UserError, match="mode fast: expected one of optimized, eager"):
        Mode.of("fast", "cpu")


def test_the_engine_code_is_every_module_but_the_command_line(ws, tmp_path, monkeypatch):
    """An edit to any module the engine, the gates or the stages run is another engine (doit
    measures the verdict again); an edit to the command line's presentation is not."""
    import shutil

    from pipeline.flow import stages
    from pipeline.flow.spec import load_spec
    copy = tmp_path / "pipeline"
    shutil.copytree(environment.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(environment, "PACKAGE", copy)
    digest = environment.engine_code.__wrapped__
    assert digest() == environment.engine_code()  # the copy is the same code
    with (copy / "cli" / "gates.py").open("a") as f:
        f.write("# shown differently\n")
    assert digest() == environment.engine_code()
    with (copy / "runtime" / "pipeline.py").open("a") as f:
        f.write("# run differently\n")
    edited = digest()
    assert edited != environment.engine_code() and edited.startswith("sha256:")
    spec = load_spec(ws.spec_path)
    before = stages._gate_options(spec, "correctness")
    monkeypatch.setenv(environment.OVERRIDE, orjson.dumps({"engine_code": edited}).decode())
    after = stages._gate_options(spec, "correctness")
    assert {k for k in before if before[k] != after[k]} == {"environment"}
    assert after["environment"]["engine_code"] == edited


def test_torch_is_asked_about_gpus_in_a_worker_and_stages_fork_only_where_safe(monkeypatch):
    """A process that initialised CUDA cannot fork a stage that uses CUDA: the probe asks torch in
    a worker, and doit forks a stage only where isolation allows it."""
    from pipeline import isolation
    from pipeline.flow import tasks
    seen = []
    real = isolation.run_isolated
    monkeypatch.setattr(isolation, "run_isolated",
                        lambda fn, *a, **k: seen.append(fn.__name__) or real(fn, *a, **k))
    assert environment._gpus("13.0") == ([], None)  # this CPU build of torch sees no GPU
    assert seen == ["_torch_gpus"]
    assert environment._gpus(None) == ([], None) and seen == ["_torch_gpus"]
    monkeypatch.setattr(isolation, "fork_is_safe", lambda: False)
    assert not tasks._forkable()
