"""`trtmc pipeline SPEC...`: the doit pipeline run through doit's API from the package, away from
the source tree, on a one-layer synthetic DistilBERT spec whose outputs lie beside it."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from tests.forked_python import python_m

ROOT = Path(__file__).resolve().parent.parent
ALL = {"inspect", "select", "build_native", "build_slot", "export_dso", "bind", "correctness",
       "perf", "promote"}
KERNEL_FILES = ("examples/byok/residual_add.cu", "examples/byok/trtmc_kernel.h",
                "tests/kernels/residual_sub.cu")


def copy_kernels(root: Path) -> None:
    """The kernels the specs below name, at the places they have in the repository (their
    includes are relative)."""
    for rel in KERNEL_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, root / rel)


def tiny_spec(folder: Path, name: str, kernel: dict, **extra) -> Path:
    """A spec of a synthetic one-layer DistilBERT (built by its inspect stage), its outputs in
    `NAME.out` beside it, with gate settings small enough for a test."""
    spec = {"schema_version": 1, "name": name,
            "model": {"synth": {"config": "distilbert-base-uncased",
                                "overrides": {"dim": 64, "n_layers": 1, "n_heads": 4,
                                              "hidden_dim": 128}, "seed": 0}},
            "build": {"precision": "fp32", "sequence_length": 16}, "engine_role": "decode",
            "selection": {"node_names": ["encoder.layers.0.attention_residual_add"],
                          "binding_id": "tiny.layer0.residual"},
            "kernel": kernel,
            # a threshold met even when a trial is timed beside other tests: these tests are about
            # running the stages, not timing
            "gates": {"device": "cpu", "texts": ["Hello world!"],
                      "perf": {"trials": 5, "warmup": 1, "threshold": 0.001}},
            "output": f"{name}.out", **extra}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_bytes(orjson.dumps(spec))
    return path


def ran(output: str) -> set[str]:
    """Stages doit ran (`.  stage:name`), from its output."""
    return {line[3:].split(":")[0] for line in output.splitlines() if line.startswith(".  ")}


def trtmc(*args, cwd: Path) -> subprocess.CompletedProcess:
    return python_m("pipeline.cli", *args, cwd=cwd)


@pytest.mark.slow
def test_pipeline_runs_every_stage_then_nothing(tmp_path):
    copy_kernels(tmp_path)
    spec = tiny_spec(tmp_path / "specs", "tiny", {"source": "../examples/byok/residual_add.cu"})
    out = tmp_path / "specs" / "tiny.out"
    first = trtmc("pipeline", str(spec), cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert ran(first.stdout) == ALL, first.stdout
    assert (out / ".doit.db").is_file() and not (tmp_path / "artifacts").exists()
    receipt = orjson.loads((out / "promotion.json").read_bytes())
    assert receipt["gates"]["correctness"]["verdict"] == "pass"
    assert (out / "reports" / "perf.xml").is_file()
    again = trtmc("pipeline", str(spec), cwd=tmp_path)
    assert again.returncode == 0 and ran(again.stdout) == set(), again.stdout
    assert "-- promote:tiny" in again.stdout
    # doit's own arguments after the spec: one stage, forced
    forced = trtmc("pipeline", str(spec), "--always", "export_dso", cwd=tmp_path)
    assert forced.returncode == 0 and ran(forced.stdout) == {"export_dso"}, forced.stdout


@pytest.mark.slow
def test_a_bad_spec_is_one_line_and_exit_2(tmp_path):
    spec = tiny_spec(tmp_path, "bad", {"source": "missing.cu"})
    proc = trtmc("pipeline", str(spec), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("trtmc: error: "), proc.stderr
    assert "$.kernel.source" in proc.stderr and "missing.cu" in proc.stderr
    assert not (tmp_path / "bad.out").exists()


@pytest.mark.slow
def test_no_spec_before_doit_arguments_is_exit_2(tmp_path):
    proc = trtmc("pipeline", "list", "--all", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "no pipeline spec given before 'list'" in proc.stderr


def test_a_task_naming_one_spec_goes_to_that_spec_only(tmp_path):
    from pipeline.flow.spec import load_spec
    from pipeline.flow.tasks import _owned_args
    copy_kernels(tmp_path)
    a, b = (load_spec(tiny_spec(tmp_path, n, {"source": "examples/byok/residual_add.cu"}))
            for n in ("a", "b"))
    names = {"a", "b"}
    assert _owned_args(["perf:a", "-n", "2"], a, names) == ["perf:a", "-n", "2"]
    assert _owned_args(["perf:a", "-n", "2"], b, names) is None
    assert _owned_args(["perf", "--always"], b, names) == ["perf", "--always"]


def test_the_project_root_variable_places_a_spec_without_output(tmp_path, monkeypatch):
    """TRTMC_PROJECT_ROOT replaces the default root of `artifacts/pipelines/NAME`, for doit's
    tasks (their targets) as for the stages (what they write); a relative one is refused in one
    line naming the variable."""
    from doit import doit_cmd

    from pipeline.errors import UserError
    from pipeline.flow.spec import DEFAULT_SPEC, ROOT_ENV, load_spec
    from pipeline.flow.tasks import from_doit_var
    copy_kernels(tmp_path)
    spec = tiny_spec(tmp_path / "specs", "tiny", {"source": "../examples/byok/residual_add.cu"})
    raw = orjson.loads(spec.read_bytes())
    del raw["output"]
    spec.write_bytes(orjson.dumps(raw))
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "root"))
    assert load_spec(spec).paths.out == tmp_path / "root/artifacts/pipelines/tiny"
    monkeypatch.setattr(doit_cmd, "_CMDLINE_VARS", {"spec": str(spec)})  # `doit spec=SPEC`
    assert [s.paths.out for s in from_doit_var(DEFAULT_SPEC).specs()] == \
        [tmp_path / "root/artifacts/pipelines/tiny"]
    monkeypatch.setenv(ROOT_ENV, "root")
    with pytest.raises(UserError, match=f"^{ROOT_ENV}=root: expected an absolute path$"):
        load_spec(spec)
