"""The scripts of benchmarks/ (developer tools, shipped in no wheel) still start on a CPU: each
answers --help with its usage, those with a CPU mode run it, and those that need a GPU refuse
without one in one line with exit status 2, not a traceback. Each runs as a developer runs it: a
fresh interpreter on the script's path, CUDA hidden (CUDA_VISIBLE_DEVICES="")."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
DATA = ROOT / "docs" / "data"
# each test starts the script in an interpreter of its own: the slow lane, as such tests are
pytestmark = pytest.mark.slow
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))

# each script that needs a GPU, with the arguments it requires (none is read before the refusal)
NEEDS_GPU = {
    "gpu_attention.py": ["--out", "{tmp}/out.json"],
    "gpu_attention_flow.py": ["--native", "n.bundle", "--slot", "s.bundle", "--selection", "s.json",
                              "--out", "{tmp}/out.json"],
    "gpu_attention_trace.py": ["--out", "{tmp}/out.json"],
    "gpu_decode_kernels.py": ["--out", "{tmp}/out.json"],
    "gpu_gates.py": ["--native", "n.bundle", "--slot", "s.bundle", "--selection", "s.json",
                     "--out", "{tmp}/out.json"],
    "gpu_prefill.py": ["attention", "--out", "{tmp}/out.json"],
    "gpu_qwen3_8b.py": ["run", "--out", "{tmp}/out.json"],
}
# the rest run on a CPU (shadow_cost.py on the spec's device, which needs a built spec)
CPU = {"host_channel.py", "plot_attention.py", "shadow_cost.py"}


def _env() -> dict[str, str]:
    """This checkout's `pipeline` first, and no CUDA device visible."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}


def _run(script: str, *args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *map(str, args)], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=300)


def test_every_script_is_checked_here():
    assert SCRIPTS and set(SCRIPTS) == set(NEEDS_GPU) | CPU, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_answers_help_with_its_usage(script):
    proc = _run(script, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {script} "), proc.stdout


@pytest.mark.parametrize("script", sorted(NEEDS_GPU))
def test_a_gpu_script_refuses_without_a_gpu_in_one_line(script, tmp_path):
    proc = _run(script, *(a.format(tmp=tmp_path) for a in NEEDS_GPU[script]))
    assert proc.returncode == 2, proc.stderr
    assert re.fullmatch(rf"{re.escape(script)}: needs a CUDA GPU, and torch \S+ sees none\n",
                        proc.stderr), proc.stderr
    assert proc.stdout == "" and not (tmp_path / "out.json").exists()


def test_the_channel_benchmark_times_frames_through_a_pipe():
    proc = _run("host_channel.py", "--mib", 1, "--frames", 2)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["mib"] == 1 and result["frames"] == 2 and result["median_s"] > 0
    proc = _run("host_channel.py", "--mib", 1, "--cuda")  # GPU to GPU: without one, one line
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert re.fullmatch(r"host_channel\.py: needs a CUDA GPU, and torch \S+ sees none\n", proc.stderr)


def test_the_decode_script_captures_its_networks_on_a_cpu(tmp_path):
    """gpu_qwen3_8b.py's CPU step: Qwen3-8B's networks captured from its config alone."""
    out = tmp_path / "qwen3_8b"
    proc = _run("gpu_qwen3_8b.py", "capture", "-o", out, "--max-cache-length", 64)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["computed.safetensors", "config.json",
                                                     "decode.export.json", "prefill.export.json"]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 36


def test_the_attention_plot_draws_the_recorded_run(tmp_path):
    out = tmp_path / "img" / "decode_attention.png"
    proc = _run("plot_attention.py", "--result", DATA / "gpu_attention_2026-12-01.json",
                "--trace", DATA / "gpu_attention_trace_2026-12-01.json", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"wrote {out}\n" and out.read_bytes().startswith(b"\x89PNG")


def test_shadow_cost_runs_a_cpu_spec(tmp_path):
    """The tutorial's DistilBERT spec built on a CPU (`trtmc pipeline ... build_native bind`),
    then shadow_cost.py over it: both arms run, and the correctness gate passes."""
    spec = json.loads((ROOT / "examples" / "pipelines" / "distilbert_tutorial.json").read_text())
    spec["kernel"]["source"] = str(ROOT / "examples" / "byok" / "residual_add.cu")
    spec["output"] = str(tmp_path / "out")
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    built = subprocess.run([sys.executable, "-m", "pipeline.cli", "pipeline", "spec.json",
                            "build_native", "bind"], cwd=tmp_path, env=_env(), capture_output=True,
                           text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    proc = _run("shadow_cost.py", "--spec", "spec.json", "--repeats", 1, "--out", "cost.json",
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cost = json.loads((tmp_path / "cost.json").read_text())
    assert cost["device"] == "cpu" and cost["gate_passed"] and cost["calls_checked"] > 0
    assert [len(cost["times_s"][arm]) for arm in ("plain", "shadowed")] == [1, 1]


def test_run_device_runs_only_scripts_that_are_here():
    named = set(re.findall(r"benchmarks/(\w+\.py)", (BENCHMARKS / "run_device.sh").read_text()))
    assert named and named <= set(SCRIPTS), sorted(named - set(SCRIPTS))
