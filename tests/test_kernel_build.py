"""Kernel DSOs: `trtmc kernel build`, the example kernels on CPU tensors, their metadata, the
deliberately bad test kernels, and the CPU-side checks of the CuTe DSL exporter."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import tvm_ffi

from pipeline.kernels.build import build_kernel
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.graph import snapshot as snapshots
from pipeline.families.capture import capture_role
from pipeline.graph.select import save_receipt, select_region

ROOT = Path(__file__).resolve().parent.parent
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(7,), (3, 5, 11), (2, 1, 4, 33)]


def _run(dso: Path):
    return tvm_ffi.load_module(str(dso)).run


def _params(dso: Path):
    meta = tvm_ffi.load_module(str(dso)).get_function_metadata("run")
    return None if meta is None else meta["type_schema"]


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32])
@pytest.mark.parametrize("shape", SHAPES)
def test_identity_copy_copies(byok_kernels, dtype, shape):
    x = (torch.randn(shape) * 100).to(dtype)
    out = torch.full(shape, -1).to(dtype)
    _run(byok_kernels["identity_copy"])(x, out)
    assert torch.equal(out, x)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_residual_add_matches_torch_bit_for_bit(byok_kernels, dtype, shape):
    gen = torch.Generator().manual_seed(len(shape))
    a, b = (torch.randn(shape, generator=gen).mul(1e3 ** torch.rand(shape, generator=gen)).to(dtype)
            for _ in range(2))
    out = torch.full(shape, float("nan"), dtype=dtype)
    _run(byok_kernels["residual_add"])(a, b, out)
    assert torch.equal(out, a + b)  # torch adds 16-bit floats in float and rounds once, too


def test_residual_add_rounds_specials_like_torch(byok_kernels):
    vals = [0.0, -0.0, 1e-8, -6e-8, 6.1e-5, 65504.0, 7e4, float("inf"), float("-inf"), 3.0e38]
    for dtype in (torch.float16, torch.bfloat16):
        a = torch.tensor(vals, dtype=torch.float32).to(dtype)
        b = torch.tensor(list(reversed(vals)), dtype=torch.float32).to(dtype)
        out = torch.empty_like(a)
        _run(byok_kernels["residual_add"])(a, b, out)
        assert torch.equal(out.isnan(), (a + b).isnan())
        assert torch.equal(out.nan_to_num(), (a + b).nan_to_num())


@pytest.mark.parametrize("args, error, message", [
    (lambda: (torch.zeros(4), torch.zeros(4, dtype=torch.float16), torch.zeros(4)), TypeError,
     "argument 'b' has dtype float16, expected float32 like 'a'"),
    (lambda: (torch.zeros(4), torch.zeros(4), torch.zeros(5)), ValueError,
     "argument 'out' has shape [5], expected [4] like 'a'"),
    (lambda: (torch.zeros(4, 4).t(), torch.zeros(4, 4), torch.zeros(4, 4)), ValueError,
     "argument 'a' is not contiguous"),
    (lambda: (torch.zeros(4, dtype=torch.int32),) * 3, TypeError,
     "argument 'a' has dtype int32, expected float32, float16, bfloat16"),
    (lambda: (torch.zeros(4), torch.zeros(4)), TypeError, "Expected 3 but got 2 arguments"),
])
def test_residual_add_refuses_bad_arguments(byok_kernels, args, error, message):
    with pytest.raises(error) as e:
        _run(byok_kernels["residual_add"])(*args())
    assert message in str(e.value)


def test_identity_copy_refuses_mismatched_dtype(byok_kernels):
    with pytest.raises(TypeError, match="argument 'output' has dtype int32, expected float32"):
        _run(byok_kernels["identity_copy"])(torch.zeros(3), torch.zeros(3, dtype=torch.int32))


def test_builds_carry_signature_metadata(byok_kernels):
    assert _params(byok_kernels["residual_add"]).count('"DLTensor*"') == 3
    assert _params(byok_kernels["identity_copy"]).count('"DLTensor*"') == 2
    assert '{"type":"int"}' in _params(byok_kernels["residual_add_wrong_signature"])
    assert _params(byok_kernels["residual_add_no_metadata"]) is None


def test_bad_test_kernels_are_wrong_in_their_own_way(byok_kernels):
    a, b = torch.randn(2, 9), torch.randn(2, 9)
    out = torch.full((2, 9), float("nan"))
    _run(byok_kernels["residual_add_nowrite"])(a, b, out)
    assert out.isnan().all()
    _run(byok_kernels["residual_sub"])(a, b, out)
    assert torch.equal(out, a - b)
    _run(byok_kernels["residual_add_no_metadata"])(a, b, out)
    assert torch.equal(out, a + b)


def test_slow_kernel_adds_correctly(byok_kernels):
    a, b = torch.randn(16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    _run(byok_kernels["residual_add_slow"])(a, b, out)
    assert torch.equal(out, a + b)


@pytest.mark.slow
def test_cli_builds_atomically_and_reports_progress(tmp_path, capsys):
    out = tmp_path / "lib" / "identity.so"
    assert main(["kernel", "build", str(ROOT / "examples/byok/identity_copy.cu"), "-o", str(out),
                 "--cpu-only"]) == 0
    x, y = torch.arange(6, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)
    _run(out)(x, y)
    assert torch.equal(x, y)
    err = capsys.readouterr().err
    assert "[kernel build] compiling" in err and f"[kernel build] wrote {out}" in err
    assert sorted(p.name for p in out.parent.iterdir()) == ["identity.so"]  # no temp left over


@pytest.mark.slow
def test_compiler_errors_are_user_errors_with_the_compiler_output(tmp_path, capsys):
    src = tmp_path / "broken.cu"
    src.write_text('#include <tvm/ffi/function.h>\nvoid run() { this_is_not_declared(); }\n')
    out = tmp_path / "broken.so"
    assert main(["kernel", "build", str(src), "-o", str(out), "--cpu-only"]) == 2
    err = capsys.readouterr().err
    assert "trtmc: error:" in err and "g++ failed with exit code" in err
    assert "this_is_not_declared" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.cu"]


@pytest.mark.parametrize("kwargs, message", [
    ({"source": "missing.cu"}, "missing.cu: kernel source not found"),
    ({"output": "."}, "is a directory"),
    # a parameter name: the CLI maps it to its flag
    ({"cuda": False, "cuda_arch": "90a"}, "cuda_arch 90a: only meaningful for a CUDA build"),
    ({"cuda": True, "cuda_arch": "sm_9x"}, "'sm_9x' is not a CUDA architecture"),
])
def test_build_refusals(tmp_path, kwargs, message):
    args = {"source": ROOT / "examples/byok/residual_add.cu", "output": tmp_path / "x.so", **kwargs}
    with pytest.raises(UserError) as e:
        build_kernel(Path(args.pop("source")), Path(args.pop("output")), **args)
    assert message in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["residual_add", "identity_copy"])
def test_cuda_build_runs_on_the_current_stream(tmp_path, name):
    dso = build_kernel(ROOT / f"examples/byok/{name}.cu", tmp_path / f"{name}.so", cuda=True)
    fn = _run(dso)
    stream = torch.cuda.Stream()
    for dtype in FLOATS:
        with torch.cuda.stream(stream):  # inputs made on the side stream too: no cross-stream race
            a, b = (torch.randn(4096, 4099, device="cuda", dtype=dtype) for _ in range(2))
            out = torch.full_like(a, float("nan"))
            if name == "residual_add":
                fn(a, b, out)
                expected = a + b
            else:
                fn(a, out)
                expected = a
        stream.synchronize()
        assert torch.equal(out, expected)


# CuTe DSL exporter: every check that runs before compiling (compiling needs a GPU).

def _exporter():
    spec = importlib.util.spec_from_file_location(
        "export_cutedsl_residual_add", ROOT / "examples/byok/export_cutedsl_residual_add.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def residual_selection(tiny_distilbert, tmp_path_factory):
    """A real snapshot of tiny DistilBERT and a selection of one residual add."""
    cap = capture_role(str(tiny_distilbert), None, "decode",
                       {"precision": "fp32", "sequence_length": 16})
    (node,) = [n["id"] for n in cap.snapshot["nodes"]
               if n["name"] == "encoder.layers.0.attention_residual_add"]
    folder = tmp_path_factory.mktemp("export")
    snapshots.save(cap.snapshot, folder / "graph.json")
    receipt = select_region(cap.snapshot, [node], binding_id="residual")
    save_receipt(receipt, folder / "residual.selection.json")
    return folder, receipt


def test_exporter_accepts_the_residual_contract(residual_selection):
    _, receipt = residual_selection
    assert _exporter().check_contract(receipt, "sel") == ("FP32", list(receipt.inputs[0].shape))


@pytest.mark.parametrize("edit, message", [
    (lambda abi: abi["inputs"].append(abi["inputs"][0]), "takes 2 inputs and 1 output"),
    (lambda abi: abi["inputs"][1].update(dtype="FP16"), "input 1 is FP16"),
    (lambda abi: abi["outputs"][0].update(shape=[1]), "output 0 is FP32 [1]"),
    (lambda abi: [t.update(dtype="INT32") for t in abi["inputs"] + abi["outputs"]],
     "dtype INT32 is not supported"),
    (lambda abi: abi.update(workspace_bytes=64), "takes no workspace and no extra args"),
    (lambda abi: abi["extra_args"].append({"type": "none"}), "takes no workspace and no extra args"),
])
def test_exporter_refuses_other_contracts(residual_selection, edit, message):
    import dataclasses

    from pipeline.graph.receipt import Abi
    receipt = residual_selection[1]
    abi = receipt.abi.to_json()
    edit(abi)
    receipt = dataclasses.replace(receipt, abi=Abi.from_json(abi))
    with pytest.raises(UserError) as e:
        _exporter().check_contract(receipt, "sel.json")
    assert message in str(e.value) and str(e.value).startswith("sel.json: ")


def test_exporter_refuses_to_overwrite(residual_selection, tmp_path, capsys):
    folder, _ = residual_selection
    out = tmp_path / "k.so"
    out.write_bytes(b"keep me")
    assert _exporter().main(["--snapshot", str(folder / "graph.json"), "--selection",
                             str(folder / "residual.selection.json"), "--output", str(out)]) == 2
    assert "already exists; refusing to overwrite" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_exporter_needs_a_gpu_and_says_so_before_importing_cutlass(residual_selection, tmp_path,
                                                                   capsys, monkeypatch):
    folder, _ = residual_selection
    monkeypatch.setitem(sys.modules, "cutlass", None)  # importing it would raise ImportError
    out = tmp_path / "k.so"
    assert _exporter().main(["--snapshot", str(folder / "graph.json"), "--selection",
                             str(folder / "residual.selection.json"), "--output", str(out)]) == 2
    assert "needs a CUDA GPU and none is visible here" in capsys.readouterr().err
    assert not out.exists()
