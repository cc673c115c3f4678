"""The copy roofline (pipeline/gates/roofline.py) and the optimized mode's compile cache folder
(pipeline/runtime/compiled.py), on a CPU: the roofline's selection logic with real host copies
at small sizes, its once-per-process cache, its place in the perf report (schema, Markdown), and
the compile cache's key, folder and the CI steps that carry it."""
from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
import torch
import yaml

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.gates import performance as p
from pipeline.gates import reports
from pipeline.gates import roofline as rl
from pipeline.gates.environment import OVERRIDE, gate_environment
from pipeline.gates.report_types import RegionOutputs, RegionTiming, Trial
from pipeline.runtime import compiled

ROOT = Path(__file__).resolve().parent.parent
MIB = rl.MIB
SMALL = (1 * MIB, 4 * MIB)


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    """Every test starts with no roofline measured in this process."""
    monkeypatch.setattr(rl, "_CACHE", {})


@pytest.fixture
def copies(monkeypatch):
    """The real `_copy_seconds`, counting its calls by buffer size."""
    calls: list[int] = []
    real = rl._copy_seconds

    def counted(device, nbytes, repeats):
        calls.append(nbytes)
        return real(device, nbytes, repeats)
    monkeypatch.setattr(rl, "_copy_seconds", counted)
    return calls


def _measurement(ratios) -> p.Measurement:
    return p.Measurement("perf_counter", 1, 0, tuple(
        Trial(i, "native" if i % 2 == 0 else "external", 0.01, 0.01 / r, 100.0, 100.0 * r, r)
        for i, r in enumerate(ratios)))


def _region(bandwidth: float, timer: str = "perf_counter") -> RegionTiming:
    return RegionTiming(
        binding_id="b", case="static", timer=timer, engine="eager", trials=5, l2_flush_bytes=0,
        bytes=4096, bandwidth_bytes_per_s=bandwidth, floor_s=4096 / bandwidth,
        native_median_s=2e-6, kernel_median_s=1e-6, kernel_speedup=2.0,
        kernel_roofline_fraction=4096 / bandwidth / 1e-6,
        native_roofline_fraction=4096 / bandwidth / 2e-6, outputs=RegionOutputs(5, 0.0, None))


# -- the roofline ---------------------------------------------------------------------------------
def test_a_real_cpu_copy_counts_read_and_write_and_takes_the_best_median(copies):
    r = rl.measure_roofline("cpu", sizes=SMALL, repeats=3)
    assert r.sizes == SMALL and len(r.median_s) == 2 and all(t > 0 for t in r.median_s)
    assert r.size_bytes_per_s == tuple(2 * n / t for n, t in zip(SMALL, r.median_s))
    assert r.bytes_per_s == max(r.size_bytes_per_s)
    assert r.timer == "perf_counter" and not r.gpu and r.repeats == 3 and r.skipped == ()
    assert "not a GPU roofline" in r.method and "read + written" in r.method
    assert "1 MiB, 4 MiB" in r.method and "median of 3" in r.method
    assert sorted(copies) == sorted(SMALL)


def test_the_best_median_across_sizes_is_the_roofline(monkeypatch):
    timings = {1 * MIB: [1e-3, 9.0, 2e-3, 1e-4, 3e-3],  # median 2e-3: 1.05 GB/s
               2 * MIB: [1e-3, 1e-3, 5.0, 1e-3, 1e-3],  # median 1e-3: 4.19 GB/s (the best)
               4 * MIB: [4e-3, 4e-3, 4e-3]}             # median 4e-3: 2.10 GB/s
    monkeypatch.setattr(rl, "_copy_seconds", lambda device, n, repeats: timings[n])
    r = rl.measure_roofline("cpu", sizes=tuple(timings), repeats=5)
    assert r.median_s == (2e-3, 1e-3, 4e-3)
    assert r.bytes_per_s == 2 * (2 * MIB) / 1e-3  # read + written, the median (not the minimum)
    assert "the best median across sizes (2 MiB)" in r.method


def test_sizes_that_do_not_fit_are_skipped_and_named(copies):
    huge = 1 << 60
    r = rl.measure_roofline("cpu", sizes=(1 * MIB, huge), repeats=2)
    assert r.sizes == (1 * MIB,) and r.skipped == (huge,) and copies == [1 * MIB]
    assert "skipped, not fitting" in r.method and rl.size_text(huge) in r.method


def test_when_no_size_fits_the_largest_copy_that_does_is_measured(monkeypatch, copies):
    monkeypatch.setattr(rl, "_available_bytes", lambda device: rl.HEADROOM_BYTES + 5 * MIB)
    r = rl.measure_roofline("cpu", sizes=(64 * MIB,), repeats=2)
    assert r.sizes == (2 * MIB,) and r.skipped == (64 * MIB,) and copies == [2 * MIB]
    assert "the largest copy that fits was measured" in r.method


def test_plan_sizes():
    g = rl.GIB
    assert rl.plan_sizes(rl.CUDA_SIZES, None) == (list(rl.CUDA_SIZES), [])
    assert rl.plan_sizes(rl.CUDA_SIZES, 100 * g) == (list(rl.CUDA_SIZES), [])
    assert rl.plan_sizes(rl.CUDA_SIZES, 5 * g) == ([g, 2 * g], [4 * g])
    # under 2 GiB + headroom free: the largest whole-MiB copy that fits, never below 1 MiB
    assert rl.plan_sizes(rl.CUDA_SIZES, g + rl.HEADROOM_BYTES) == ([g // 2], list(rl.CUDA_SIZES))
    assert rl.plan_sizes((g,), 0) == ([MIB], [g])


def test_a_buffer_that_cannot_be_allocated_is_skipped(monkeypatch):
    monkeypatch.setattr(rl, "_copy_seconds",
                        lambda device, n, repeats: None if n > MIB else [1e-4] * repeats)
    r = rl.measure_roofline("cpu", sizes=(MIB, 2 * MIB), repeats=3)
    assert r.sizes == (MIB,) and r.skipped == (2 * MIB,) and "allocation failed: 2 MiB" in r.method
    monkeypatch.setattr(rl, "_copy_seconds", lambda device, n, repeats: None)
    with pytest.raises(RuntimeError, match="no copy roofline"):
        rl.measure_roofline("cpu", sizes=(MIB,), repeats=1)


def test_one_measurement_per_process_and_device(copies):
    a = rl.measure_roofline("cpu", sizes=SMALL, repeats=2)
    b = rl.measure_roofline(torch.device("cpu"), sizes=list(SMALL), repeats=2)
    assert a is b and sorted(copies) == sorted(SMALL)  # each size copied in one measurement only
    rl.measure_roofline("cpu", sizes=(MIB,), repeats=2)  # other sizes: another measurement
    assert len(copies) == 3


def test_the_cpu_default_and_the_gates_bandwidth_share_one_measurement(monkeypatch, copies):
    monkeypatch.setattr(rl, "CPU_SIZES", (2 * MIB,))
    r = rl.measure_roofline("cpu")
    assert r.sizes == (2 * MIB,) and r.repeats == rl.REPEATS["cpu"]
    assert p.measure_bandwidth(torch.device("cpu")) == r.bytes_per_s and copies == [2 * MIB]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        rl.measure_roofline("cpu", sizes=(0,))
    with pytest.raises(ValueError):
        rl.measure_roofline("cpu", sizes=(MIB,), repeats=-1)


# -- the roofline in the perf report ------------------------------------------------------------
def test_the_perf_report_carries_the_roofline_and_markdown_prints_its_method_once(tmp_path):
    r = rl.measure_roofline("cpu", sizes=SMALL, repeats=2)
    rep = p.perf_report("demo", _measurement([1.0, 1.01, 0.99, 1.0, 1.0]),
                        regions=[_region(r.bytes_per_s)], roofline=r)
    assert rep["roofline"]["bytes_per_s"] == rep["regions"][0]["bandwidth_bytes_per_s"]
    assert rep["roofline"]["sizes"] == list(SMALL) and rep["roofline"]["method"] == r.method
    paths = reports.write_reports(rep, tmp_path)  # validated against the schema
    back = orjson.loads(paths["json"].read_bytes())
    jsonio.validate(back, "gate_report", "perf.json")
    assert back["roofline"]["median_s"] == list(r.median_s) and back["schema_version"] == 6
    md = paths["md"].read_text()
    assert md.count(r.method) == 1 and "no roofline on a CPU |" in md


def test_reports_without_a_roofline_stay_valid_and_a_bad_one_is_refused():
    plain = p.perf_report("demo", _measurement([1.0, 1.0, 1.0]), regions=[_region(1e10)])
    assert "roofline" not in plain
    jsonio.validate(orjson.loads(jsonio.dumps(plain, human=False)), "gate_report", "old.json")
    assert "Copy roofline" not in reports.markdown(reports.GateReport.from_json(plain))
    for bad in ({"bytes_per_s": 1e10, "sizes": [MIB]},                       # no method
                {"bytes_per_s": 1e10, "method": "m", "sizes": []},            # no size
                {"bytes_per_s": 1e10, "method": "m", "sizes": [MIB], "x": 1}):  # unknown field
        with pytest.raises(UserError):
            jsonio.validate(orjson.loads(jsonio.dumps({**plain, "roofline": bad}, human=False)),
                            "gate_report", "bad.json")


# -- the compile cache --------------------------------------------------------------------------
def test_the_compile_cache_key_is_the_gates_environment(monkeypatch):
    monkeypatch.delenv(OVERRIDE, raising=False)
    env = gate_environment("cpu")
    assert compiled.compile_cache_key("cpu") == {k: env[k] for k in ("torch", "cuda", "gpu")}
    assert compiled.compile_cache_key("cpu")["torch"] == torch.__version__


def test_a_cuda_device_is_keyed_by_its_gpu_model(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: ["NVIDIA H200", "NVIDIA B200"][i])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert compiled.compile_cache_key("cuda")["gpu"] == "NVIDIA H200"  # GPU 0, as the gates say
    assert compiled.compile_cache_key("cuda:1") == {"torch": torch.__version__, "cuda": "13.0",
                                                    "gpu": "NVIDIA B200"}


def test_the_compile_cache_folder_is_named_as_documented(monkeypatch, tmp_path):
    key = {"torch": "2.11.0+cu130", "cuda": "13.0", "gpu": "NVIDIA H200"}
    assert compiled.compile_cache_name(key) == "torch-2.11.0+cu130_cuda-13.0_NVIDIA-H200"
    assert compiled.compile_cache_name({"torch": "2.13.0+cpu", "cuda": None, "gpu": None}) == \
        "torch-2.13.0+cpu_cuda-none_cpu"
    assert compiled.compile_cache_name({**key, "gpu": "NVIDIA H100 80GB HBM3/x"}) == \
        "torch-2.11.0+cu130_cuda-13.0_NVIDIA-H100-80GB-HBM3-x"
    name = compiled.compile_cache_name(compiled.compile_cache_key("cpu"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compiled.compile_cache_dir("cpu") == tmp_path / "trtmc" / "inductor" / name
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compiled.compile_cache_dir("cpu") == tmp_path / "home" / ".cache" / "trtmc" / "inductor" / name
    for doc in ("docs/performance.md", "docs/ci-workflow.md"):  # the pages name this layout
        text = (ROOT / doc).read_text()
        assert "$XDG_CACHE_HOME/trtmc/inductor/KEY" in text
        assert "torch-2.11.0+cu130_cuda-13.0_NVIDIA-H200" in text


def test_the_first_compile_sets_the_cache_folder_and_honours_the_users(monkeypatch, tmp_path):
    """Inductor's folder, with Triton's inside it, unless the user set either."""
    from pipeline.runtime.program import Plan
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(compiled.CACHE_ENV, raising=False)
    monkeypatch.delenv(compiled.TRITON_CACHE_ENV, raising=False)
    program = type("P", (), {"device": torch.device("cpu"), "step": staticmethod(lambda x: x + 1),
                             "plan": Plan([], {}, [], [], "test")})()
    compiled.compile_step(program, backend="eager")  # compiles lazily: nothing runs yet
    assert os.environ[compiled.CACHE_ENV] == str(compiled.compile_cache_dir("cpu"))
    assert os.environ[compiled.TRITON_CACHE_ENV] == str(compiled.compile_cache_dir("cpu") / "triton")
    # torch writes its own default there when first asked for the folder: not the user's
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    monkeypatch.delenv(compiled.CACHE_ENV)
    torch_default = cache_dir()
    assert os.environ[compiled.CACHE_ENV] == torch_default != str(compiled.compile_cache_dir("cpu"))
    assert compiled.use_compile_cache("cpu") == str(compiled.compile_cache_dir("cpu"))
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "mine"))
    monkeypatch.setenv(compiled.TRITON_CACHE_ENV, str(tmp_path / "my-triton"))
    compiled.compile_step(program, backend="eager")
    assert compiled.use_compile_cache("cpu") == str(tmp_path / "mine")
    assert os.environ[compiled.CACHE_ENV] == str(tmp_path / "mine")
    assert os.environ[compiled.TRITON_CACHE_ENV] == str(tmp_path / "my-triton")
    # Inductor's precompiled C++ headers: in that folder, not in one it fixes under /tmp
    from torch._inductor import codecache
    monkeypatch.setattr(codecache, "_HEADER_DIR", codecache._HEADER_DIR)  # put back after
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", codecache._HEADER_LOCK_DIR)
    compiled.compile_step(program)
    assert codecache._HEADER_DIR == str(tmp_path / "mine" / "precompiled_headers")
    assert codecache._HEADER_LOCK_DIR == str(tmp_path / "mine" / "precompiled_headers" / "locks")


def test_a_python_that_writes_no_bytecode_keeps_it_in_the_cache_folder(tmp_path):
    """Under PYTHONDONTWRITEBYTECODE, where the packages were installed without their bytecode, a
    trtmc process (the CLI, a doit run's process) writes the bytecode of what it imports under the
    cache folder, and so do the processes it starts; nothing beside the sources. Where they were
    installed with it, or the user set PYTHONPYCACHEPREFIX, nothing changes."""
    import py_compile
    import subprocess
    import sys
    src = tmp_path / "src"
    src.mkdir()
    for name in ("parent_mod", "child_mod", "bare_pkg", "compiled_pkg"):
        (src / f"{name}.py").write_text("X = 1\n")
    py_compile.compile(str(src / "compiled_pkg.py"))  # as pip installs a package
    run = ("from pipeline.cli import main; main(['model', '--help'])",
           "from pipeline.flow.tasks import prepare_process; prepare_process()")

    def child(code, probe, **env):
        script = f"import sys\nimport pipeline.files\npipeline.files.BYTECODE_PROBE = {probe!r}\n" \
                 f"try:\n    {code}\nexcept SystemExit:\n    pass\n" \
                 "import parent_mod, subprocess\n" \
                 "subprocess.run([sys.executable, '-c', 'import child_mod'], check=True)\n"
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=os.pathsep.join([str(src), str(ROOT)]), **env)
        if "PYTHONPYCACHEPREFIX" not in env or env["PYTHONPYCACHEPREFIX"] is None:
            env.pop("PYTHONPYCACHEPREFIX", None)
        subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True)

    def written(folder):
        return sorted(p.name.split(".")[0] for p in folder.rglob("*.pyc"))

    for k, code in enumerate(run):
        cache, mine, kept = tmp_path / f"cache{k}", tmp_path / f"mine{k}", tmp_path / f"kept{k}"
        child(code, "bare_pkg", XDG_CACHE_HOME=str(cache), PYTHONPYCACHEPREFIX=None)
        prefixed = cache / "trtmc" / "pycache" / src.relative_to(src.anchor)
        assert written(prefixed) == ["child_mod", "parent_mod"]
        assert written(src / "__pycache__") == ["compiled_pkg"]
        child(code, "bare_pkg", PYTHONPYCACHEPREFIX=str(mine), XDG_CACHE_HOME=str(mine / "x"))
        assert not (mine / "x").exists() and not written(mine)
        child(code, "compiled_pkg", XDG_CACHE_HOME=str(kept), PYTHONPYCACHEPREFIX=None)
        assert not written(kept) and written(src / "__pycache__") == ["compiled_pkg"]


def test_the_gpu_job_restores_and_saves_the_compile_cache():
    """The folder is the run's own and only pushes to main save it: it holds code the runtime
    runs, written in the process the kernel under test runs in."""
    jobs = yaml.safe_load((ROOT / "examples/ci/gates.yml").read_text())["jobs"]
    steps = jobs["gpu"]["steps"]
    folder = next(i for i, s in enumerate(steps) if s.get("id") == "inductor")
    assert "compile_cache_dir('cuda')" in steps[folder]["run"]
    assert "dir=" in steps[folder]["run"] and "key=" in steps[folder]["run"]
    assert 'echo "XDG_CACHE_HOME=$RUNNER_TEMP/' in steps[folder]["run"]  # for every later step
    cache = [(i, s) for i, s in enumerate(steps) if s.get("uses", "").startswith("actions/cache/")
             and "steps.inductor.outputs.dir" in s["with"]["path"]]
    (restore_at, restore), (save_at, save) = cache
    gates = next(i for i, s in enumerate(steps) if s.get("run") == "doit spec=${{ matrix.spec }}")
    assert restore["uses"].startswith("actions/cache/restore") and restore_at < gates
    assert save["uses"].startswith("actions/cache/save") and save_at > gates
    assert save.get("if") == "always() && github.event_name == 'push'"
    assert restore["with"]["key"] == save["with"]["key"]
    assert "steps.inductor.outputs.key" in save["with"]["key"]
    assert all("inductor" not in str(s) for s in jobs["cpu"]["steps"])  # the CPU job compiles nothing
