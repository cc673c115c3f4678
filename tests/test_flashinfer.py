"""`trtmc kernel export flashinfer-decode-attention`: what it refuses before it compiles (a machine
without a GPU, a selection whose ABI it does not implement, another FlashInfer than the pin or one
without its headers), the ABI it accepts, and, where nvcc and FlashInfer's headers are here, the
DSO it builds: it passes the library inspection and states its build in its own section."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.families.capture import capture_role
from pipeline.graph.select import from_recipe, save_selection
from pipeline.kernels import flashinfer
from pipeline.kernels.build import cuda_gpu_present
from pipeline.kernels.inspect import BUILD_SECTION, build_info_file, inspect_file

RECIPE = "qwen.decode_attention_region@2"


def _selection(model: Path, out: Path, cache: int, *, workspace: int = 0) -> Path:
    cap = capture_role(str(model), None, "decode", {"precision": "bf16", "max_cache_length": cache,
                                                     "decoder_engine_layout": "split"})
    receipt = from_recipe(cap.snapshot, RECIPE, "decoder.layers.1.decode_attention")
    if workspace:
        from pipeline.graph.select import select_region
        receipt = select_region(cap.snapshot, list(receipt.nodes), binding_id="attention.workspace@1",
                                workspace_bytes=workspace, output_shape_like_input=0)
    save_selection(receipt, out)
    return out


def _package(root: Path, version: str, *, headers: bool = True) -> Path:
    """A folder laid out like the flashinfer package: _build_meta.py and the header trees."""
    root.mkdir(parents=True)
    (root / "_build_meta.py").write_text(f'"""meta"""\n__version__ = "{version}"\n'
                                         f'__git_commit__ = "0123456789abcdef"\n')
    for tree in flashinfer.HEADER_TREES if headers else ():
        (root / tree).mkdir(parents=True)
        (root / tree / "x.h").write_text("// header\n")
    return root


@pytest.mark.skipif(cuda_gpu_present(), reason="a GPU is here: the exporter would build for it")
def test_a_machine_without_a_gpu_refuses_the_exporter_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "kernel", "export",
                           "flashinfer-decode-attention", "-o", str(tmp_path / "fi.so")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "no CUDA GPU here" in done.stderr and "--arch" in done.stderr
    assert not (tmp_path / "fi.so").exists()


def test_a_selection_it_does_not_implement_is_refused_naming_the_argument(tiny_qwen3, tmp_path):
    small = _selection(tiny_qwen3, tmp_path / "small.json", 64)  # head dim 16
    with pytest.raises(UserError, match=r"small.json: q is BF16 \[1, \d+, -1, 16\], expected BF16 "
                                        r"or FP16 \[1, Hq, 1 or -1, 128\]"):
        flashinfer.check_selection(small)
    ws = _selection(tiny_qwen3, tmp_path / "ws.json", 64, workspace=4096)
    with pytest.raises(UserError, match="ws.json: workspace_bytes 4096; this kernel keeps its plan"):
        flashinfer.check_selection(ws)


@pytest.mark.slow
def test_qwen3_8b_attention_is_the_abi_it_implements(qwen3_8b_config_dir, tmp_path):
    abi = flashinfer.check_selection(_selection(qwen3_8b_config_dir, tmp_path / "s.json", 40960))
    assert [t["shape"] for t in abi["inputs"]][:2] == [[1, 32, -1, 128], [1, 8, 40960, 128]]


def test_only_the_pinned_release_with_its_headers_is_used(tmp_path):
    other = _package(tmp_path / "other", "0.6.0")
    with pytest.raises(UserError, match=r"FlashInfer 0\.6\.0, but the pin is 0\.7\.2\.post1 \(pass "
                                        r"--flashinfer-version 0\.6\.0"):
        flashinfer.find_release(other, flashinfer.PINNED_VERSION)
    assert flashinfer.find_release(other, "0.6.0").commit == "0123456789abcdef"
    bare = _package(tmp_path / "bare", flashinfer.PINNED_VERSION, headers=False)
    with pytest.raises(UserError, match="data/cccl/cub: missing; FlashInfer's headers are expected"):
        flashinfer.find_release(bare, flashinfer.PINNED_VERSION)
    with pytest.raises(UserError, match="cannot read FlashInfer's build metadata"):
        flashinfer.find_release(tmp_path / "nowhere", flashinfer.PINNED_VERSION)


def test_the_headers_digest_covers_every_header(tmp_path):
    release = flashinfer.find_release(_package(tmp_path / "fi", flashinfer.PINNED_VERSION),
                                      flashinfer.PINNED_VERSION)
    before = release.headers_sha256()
    (tmp_path / "fi" / "data/include/x.h").write_text("// another header\n")
    assert release.headers_sha256() != before


def _installed_headers() -> Path | None:
    spec = importlib.util.find_spec("flashinfer")
    return None if spec is None or spec.origin is None else Path(spec.origin).parent


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None or _installed_headers() is None,
                    reason="needs nvcc and flashinfer-python's headers (pip install --no-deps "
                           "flashinfer-python==0.7.2.post1)")
def test_the_dso_passes_inspection_and_states_its_build(tmp_path):
    info = flashinfer.export_decode_attention(tmp_path / "fi.so", arch="90a")
    assert inspect_file(tmp_path / "fi.so").passed
    stated = build_info_file(tmp_path / "fi.so")
    assert stated == info and stated["flashinfer"]["version"] == flashinfer.PINNED_VERSION
    assert stated["arch"] == "sm_90a" and BUILD_SECTION == ".trtmc_build"


@pytest.mark.parametrize("arch, expected", [("89", "89"), ("sm_90a", "90a"), ("100a", "100a")])
def test_an_arch_named_is_the_one_built_for(arch, expected):
    assert flashinfer.target_arch(arch) == expected


@pytest.mark.parametrize("arch, refusal", [
    ("75", r"--arch 75: FlashInfer's decode kernel needs SM 8\.0 or newer"),
    ("90a,100a", "one architecture per DSO"),
])
def test_an_arch_it_cannot_build_for_is_refused(arch, refusal):
    with pytest.raises(UserError, match=refusal):
        flashinfer.target_arch(arch)


def test_build_metadata_that_is_no_regular_file_is_refused_without_waiting(tmp_path):
    import os
    folder = tmp_path / "fi"
    folder.mkdir()
    os.mkfifo(folder / "_build_meta.py")  # a read of it would block
    with pytest.raises(UserError, match="_build_meta.py: cannot read FlashInfer's build metadata"):
        flashinfer.find_release(folder, flashinfer.PINNED_VERSION)
