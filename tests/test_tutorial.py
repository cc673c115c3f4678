"""The tutorial as written (tests/tutorial/tutorial.sh), on an offline Hugging Face cache built
in a temporary HF_HOME: a tiny synthetic Qwen3 filed as Qwen/Qwen3-8B at the tutorial's REVISION,
and a full-size synthetic DistilBERT at its CUTE_REVISION, named by its cached snapshot folder as
the tutorial tells offline users to do. Also: `pip install .` gives a working `trtmc`."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import orjson
import pytest

from pipeline.models import hubcache
from pipeline.models.synth import synthesize
from tests.conftest import TINY_QWEN3

ROOT = Path(__file__).resolve().parent.parent
REVISION = "b968826d9c46dd6066d109eabc6255188de91218"
CUTE_REVISION = "12040accade4e8a0f71eabdb258fecc2e7e948be"


def _env(**extra) -> dict:
    env = {**os.environ, **extra}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


@pytest.fixture(scope="module")
def offline_cache(tmp_path_factory) -> tuple[Path, Path]:
    home = tmp_path_factory.mktemp("hf_home")
    old = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = str(home / "hub")
    try:
        src = tmp_path_factory.mktemp("src")
        hubcache.add_to_cache(synthesize("Qwen3-8B", src / "qwen3",
                                         overrides={**TINY_QWEN3, "max_position_embeddings": 40960}),
                              "Qwen/Qwen3-8B", REVISION)
        snapshot = hubcache.add_to_cache(synthesize("distilbert-base-uncased", src / "distilbert"),
                                         "distilbert/distilbert-base-uncased", CUTE_REVISION)
    finally:
        if old is None:
            del os.environ["HF_HUB_CACHE"]
        else:
            os.environ["HF_HUB_CACHE"] = old
    return home, snapshot


@pytest.mark.slow
@pytest.mark.long
def test_the_tutorial_runs_as_written(offline_cache, tmp_path):
    home, distilbert_snapshot = offline_cache
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = _env(HF_HOME=str(home), HF_HUB_OFFLINE="1", CUTE_MODEL=str(distilbert_snapshot),
               TUTORIAL_PERF_VERDICT="report")
    env.pop("HF_HUB_CACHE", None)
    run = subprocess.run(["bash", str(ROOT / "tests/tutorial/tutorial.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "TUTORIAL COMPLETE" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    work = tmp_path / "artifacts/qwen3-graph-slot"
    # the recipe build binds under the recipe id, in the receipt and in the bundle's kernel_slots.json
    receipt = orjson.loads((work / "qwen3-slot-ready.selection.json").read_bytes())
    slots = orjson.loads((work / "qwen3-slot-ready.bundle/kernel_slots.json").read_bytes())
    assert receipt["binding_id"] == "qwen.decode_logits_copy@1"
    assert [s["binding_id"] for s in slots["slots"]] == ["qwen.decode_logits_copy@1"]
    # `graph recipes` prints its table, nodes comma-joined
    recipes = (work / "decode.recipes.txt").read_text().splitlines()
    assert recipes[0].split() == ["RECIPE", "INSTANCE", "NODES"]
    assert re.fullmatch(r"qwen\.decode_logits_copy@1\s+decoder\.logits_zero_bias\s+node:\d+,node:\d+,node:\d+",
                        recipes[-1])
    # the manual logits region is static: no output-shape rule
    manual = orjson.loads((work / "manual.selection.json").read_bytes())
    assert manual["output_shape_like_input"] is None and manual["outputs"][0]["shape"] == [1, 1, 512]
    extra = orjson.loads((work / "manual-extra.selection.json").read_bytes())
    assert extra["extra_args"] == [{"type": "int", "value": 32}, {"type": "float", "value": 0.5}]
    # the benchmark lines report, and both arms generated the same number of tokens
    logs = [re.findall(r"generated_tokens_mean=([0-9.]+).*tokens_per_sec=([0-9.]+)",
                       (work / f"{arm}.perf.log").read_text()) for arm in ("native", "external")]
    assert all(logs) and logs[0][-1][0] == logs[1][-1][0] and all(float(x[-1][1]) > 0 for x in logs)
    # DistilBERT named by its cached snapshot folder: the revision is that commit
    snap = orjson.loads((tmp_path / "artifacts/distilbert-cutedsl/decode.graph.json").read_bytes())
    assert snap["engine_role"] == "decode" and snap["build"]["revision"] == CUTE_REVISION
    assert snap["build"]["model"] == "distilbert/distilbert-base-uncased"
    assert "PASS: numerical gate" in run.stdout


@pytest.mark.slow
def test_hub_ids_resolve_through_the_cache_api(offline_cache, monkeypatch):
    from pipeline.errors import UserError
    from pipeline.models.checkpoint import resolve
    home, snapshot = offline_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    path, model_id, commit = resolve("distilbert/distilbert-base-uncased", "main")  # a ref
    assert (path, model_id, commit) == (snapshot.resolve(), "distilbert/distilbert-base-uncased", CUTE_REVISION)
    assert resolve(str(snapshot), CUTE_REVISION)[1:] == ("distilbert/distilbert-base-uncased", CUTE_REVISION)
    with pytest.raises(UserError, match=r"Qwen/Qwen3-8B@0{40}: not in the local Hugging Face cache"):
        resolve("Qwen/Qwen3-8B", "0" * 40)
    with pytest.raises(UserError, match="does not match this cached snapshot's commit"):
        resolve(str(snapshot), "f" * 40)


def _ok(cmd, **kwargs) -> subprocess.CompletedProcess:
    """`cmd` run to success, or a failure that shows what it printed."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_pip_install_dot_gives_a_working_trtmc(tmp_path):
    """The wheel alone, in a fresh virtual environment that sees this interpreter's installed
    dependencies (whether or not this one runs in a virtual environment) but not the source
    tree or its editable install."""
    import site
    wheels = tmp_path / "wheels"
    _ok([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        timeout=600)
    (wheel,) = wheels.glob("trtmc-*.whl")
    venv.create(tmp_path / "venv", with_pip=False)
    python = tmp_path / "venv/bin/python"
    purelib = _ok([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                  ).stdout.strip()
    # the dependencies: this interpreter's site folders, as plain path entries (their .pth files,
    # the editable install's among them, are not run)
    deps = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    (Path(purelib) / "dependencies.pth").write_text("\n".join(deps) + "\n")
    _ok([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", purelib,
         str(wheel)], timeout=600)
    out = tmp_path / "out"
    # run away from the source tree: the installed package, its schemas and shipped configs
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _ok([python, "-c", "import pipeline; print(pipeline.__file__)"], cwd=tmp_path,
                env=env).stdout
    assert where.startswith(purelib)
    trtmc = [python, "-m", "pipeline.cli"]
    _ok(trtmc + ["model", "synth", "Qwen3-8B", "--no-weights", "-o", str(out / "q")],
        cwd=tmp_path, env=env, timeout=300)
    _ok(trtmc + ["graph", "inspect", "--snapshot", str(out / "g.json"), "--engine-role",
                 "decode", str(out / "q"), "--max-cache-length", "64"],
        cwd=tmp_path, env=env, timeout=300)
    listing = _ok(trtmc + ["graph", "recipes", str(out / "g.json")], cwd=tmp_path, env=env,
                  timeout=300).stdout
    assert "qwen.decode_attention_region@2" in listing
    # the doit pipeline from the installed package: a spec without $.output writes beside itself
    from tests.test_pipeline_command import tiny_spec
    spec = tiny_spec(tmp_path / "specs", "beside", {"source": str(ROOT / "examples/byok/residual_add.cu")})
    raw = orjson.loads(spec.read_bytes())
    del raw["output"]
    spec.write_bytes(orjson.dumps(raw))
    _ok(trtmc + ["pipeline", str(spec), "select"], cwd=tmp_path, env=env, timeout=600)
    assert (tmp_path / "specs/artifacts/pipelines/beside/selection.json").is_file()
