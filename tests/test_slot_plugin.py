"""The TensorRT slot plugin and runtime as far as this machine allows: the real tensorrt_rtx plugin
registry and plugin classes, raw pointers wrapped for TVM-FFI, and the real residual-add DSO run
through `enqueue` on CPU memory. Insertion into a network and execution in an engine need full
TensorRT and a GPU: here they must refuse clearly."""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from pipeline.kernels import bind
from pipeline.errors import UserError
from pipeline.graph.abi import abi_of, abi_sha256
from pipeline.trt.slot_plugin import (PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, RawTensor,
                                          dl_tensor, insert_slot_layer, launch, plugin_fields,
                                          register_slot_plugins)
from pipeline.trt.engine import TensorRTEngine
from pipeline.trt import LOGGER, capabilities, trt

BOUNDARY = {"dtype": "FP16", "shape": [-1, 8]}


def _slot(binding_id: str, workspace_bytes: int) -> dict:
    abi = abi_of([BOUNDARY, BOUNDARY], [BOUNDARY], workspace_bytes, [], 0)
    return {"binding_id": binding_id, "engine_role": "decode", "abi": abi,
            "abi_sha256": abi_sha256(abi)}


@pytest.fixture(scope="module")
def kernels(byok_kernels, tmp_path_factory):
    """`add`: the residual-add DSO on a dynamic-rows FP16 ABI; `ws`: an ABI with a workspace
    (bound to the metadata-less build, so its signature is not checked; never enqueued)."""
    folder = tmp_path_factory.mktemp("slot_plugin")
    slots = [_slot("add", 0), _slot("ws", 256)]
    libs = {"add": byok_kernels["residual_add"], "ws": byok_kernels["residual_add_no_metadata"]}
    for lib in libs.values():
        shutil.copy(lib, folder / lib.name)
    manifest = folder / "bindings.json"
    manifest.write_text(json.dumps({"schema_version": 1, "bindings": [
        {"id": s["binding_id"], "abi_sha256": s["abi_sha256"],
         "library": libs[s["binding_id"]].name, "function": "run"} for s in slots]}))
    return bind(manifest, slots)


@pytest.fixture(scope="module")
def creator(kernels):
    return register_slot_plugins(kernels, device_type="cpu")


def _plugin(creator, binding_id, sha=None, phase=trt.TensorRTPhase.BUILD):
    sha = sha or creator.kernels[binding_id].abi_sha256
    return creator.create_plugin(f"slot:{binding_id}", plugin_fields(binding_id, sha), phase)


def _desc(dtype, shape, fmt=trt.TensorFormat.LINEAR):
    d = trt.PluginTensorDesc()
    d.type, d.dims, d.format = dtype, trt.Dims(shape), fmt
    return d


def _dyn(dtype, fmt=trt.TensorFormat.LINEAR):
    d = trt.DynamicPluginTensorDesc()
    d.desc = _desc(dtype, [-1, 8], fmt)
    return d


def test_creator_is_registered_and_a_new_one_replaces_it(kernels, creator):
    registry = trt.get_plugin_registry()
    assert registry.get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE) is creator
    other = register_slot_plugins(kernels, device_type="cpu")
    assert registry.get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE) is other
    assert [f.name for f in creator.field_names] == ["binding_id", "abi_sha256"]


def test_plugin_answers_from_the_abi(creator, kernels):
    add, ws = _plugin(creator, "add"), _plugin(creator, "ws", phase=trt.TensorRTPhase.RUNTIME)
    assert (add.plugin_name, add.plugin_version, add.num_outputs) == (PLUGIN_NAME, "1", 1)
    fields = {f.name: bytes(f.data).decode() for f in add.get_fields_to_serialize()}
    assert fields == {"binding_id": "add", "abi_sha256": kernels["add"].abi_sha256}
    assert add.get_output_data_types([trt.float16, trt.float16]) == [trt.float16]
    assert add.get_workspace_size([], []) == 0 and ws.get_workspace_size([], []) == 256
    # dynamic rows: the output takes the dims of input 0 (output_shape_like_input)
    like = [object(), object()]
    assert add.get_output_shapes(like, [], None)[0] is like[0]
    half, fp32 = _dyn(trt.float16), _dyn(trt.float32)
    assert add.supports_format_combination(0, [half, half, half], 2)
    assert add.supports_format_combination(2, [half, half, half], 2)
    assert not add.supports_format_combination(1, [half, fp32, half], 2)
    assert not add.supports_format_combination(2, [half, half, fp32], 2)
    chw = _dyn(trt.float16, trt.TensorFormat.CHW2)
    assert not add.supports_format_combination(0, [chw, half, half], 2)
    assert add.attach_to_context(None).kernel is add.kernel and add.clone() is not add


def test_creator_refuses_unknown_ids_wrong_hashes_and_missing_fields(creator):
    with pytest.raises(UserError, match="binding id 'nope' has no bound kernel .bound: add, ws."):
        _plugin(creator, "nope", sha="0" * 64)
    with pytest.raises(UserError, match="ABI mismatch for 'add': the plan has 0{64}"):
        _plugin(creator, "add", sha="0" * 64)
    with pytest.raises(UserError, match="ABI mismatch"):  # a hash made for another ABI
        _plugin(creator, "add", sha=creator.kernels["ws"].abi_sha256)
    only_id = trt.PluginFieldCollection([plugin_fields("add", "x")[0]])
    with pytest.raises(UserError, match="missing field.s. abi_sha256"):
        creator.create_plugin("slot:add", only_id, trt.TensorRTPhase.RUNTIME)


@pytest.mark.parametrize("dtype,torch_dtype", [("FP16", torch.float16), ("BF16", torch.bfloat16),
                                               ("FP32", torch.float32), ("INT32", torch.int32)])
def test_dl_tensor_views_raw_cpu_memory(dtype, torch_dtype):
    x = torch.arange(24).reshape(2, 3, 4).to(torch_dtype)
    view = dl_tensor(x.data_ptr(), dtype, x.shape, ("cpu", 0))
    assert tuple(view.shape) == (2, 3, 4)
    back = torch.from_dlpack(view)
    assert back.dtype == torch_dtype and back.data_ptr() == x.data_ptr()
    back[1, 2, 3] = 7
    assert x[1, 2, 3] == 7  # a view of the same memory, not a copy
    with pytest.raises(UserError, match="dtype FP8"):
        dl_tensor(x.data_ptr(), "FP8", x.shape, ("cpu", 0))


def test_enqueue_runs_the_residual_add_dso_on_raw_pointers(creator):
    plugin = _plugin(creator, "add").attach_to_context(None)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(5, 8, generator=gen).half() for _ in range(2))
    out = torch.full((5, 8), float("nan"), dtype=torch.float16)
    descs = [_desc(trt.float16, [5, 8]) for _ in range(3)]
    plugin.enqueue(descs[:2], descs[2:], [a.data_ptr(), b.data_ptr()], [out.data_ptr()], 0, 0)
    torch.testing.assert_close(out, (a.float() + b.float()).half(), rtol=0, atol=0)


def test_launch_checks_the_descs_against_the_abi(kernels):
    x = torch.zeros(5, 8, dtype=torch.float16)
    ok = RawTensor("FP16", (5, 8), x.data_ptr())
    with pytest.raises(UserError, match="input 1 is FP32 .5, 8., the ABI declares FP16 .-1, 8."):
        launch(kernels["add"], [ok, RawTensor("FP32", (5, 8), x.data_ptr())], 0, [ok], ("cpu", 0), 0)
    with pytest.raises(UserError, match="output 0 is FP16 .5, 9."):
        launch(kernels["add"], [ok, ok], 0, [RawTensor("FP16", (5, 9), x.data_ptr())], ("cpu", 0), 0)
    with pytest.raises(UserError, match="1 inputs, the ABI has 2"):
        launch(kernels["add"], [ok], 0, [ok], ("cpu", 0), 0)


@pytest.mark.skipif(capabilities().can_execute, reason="this machine can execute TensorRT plans")
def test_tensorrt_engine_refuses_where_plans_cannot_execute(kernels, tmp_path):
    with pytest.raises(UserError, match="TensorRT runtime .* needs 'can_execute'.*use the reference runtime"):
        TensorRTEngine.load(tmp_path / "missing.plan", kernels)


@pytest.mark.skipif(capabilities().has_plugin_layers, reason="full TensorRT has plugin layers")
def test_insert_slot_layer_needs_plugin_layers(creator):
    builder = trt.Builder(LOGGER)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    receipt = SimpleNamespace(binding_id="add", abi_sha256=creator.kernels["add"].abi_sha256)
    with pytest.raises(UserError, match="inserting slot plugin 'add' needs 'has_plugin_layers'.*"
                                        "use full TensorRT"):
        insert_slot_layer(network, receipt, creator)
