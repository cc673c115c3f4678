"""The TVM-FFI slot plugin: a TensorRT `IPluginV3` that runs a bound kernel inside a TensorRT plan.

Only full TensorRT can put it in a network (`INetworkDefinition.add_plugin_v3`) and execute it;
TensorRT-RTX, which is what installs on these machines, registers the creator and creates plugin
objects, so everything up to insertion and execution is exercised here, and `enqueue` runs on CPU
memory. Nothing in this module has run inside a TensorRT engine.

A plugin's fields are the binding id and the ABI sha256; the creator holds the bound kernels and
refuses a plugin (at build or at plan deserialization) whose id it does not know or whose ABI hash
differs, so a plan cannot run a kernel exported for another selection. `enqueue` wraps TensorRT's
raw pointers as DLPack tensors and calls the kernel in ABI order (pipeline/graph/abi.py:
call_order) on TensorRT's stream, which it makes the TVM-FFI environment stream; it never
synchronizes.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import tvm_ffi

from pipeline.kernels.bind import BoundKernel
from pipeline import dtypes
from pipeline.errors import UserError
from pipeline.graph.abi import call_order
from pipeline.graph.receipt import SelectionReceipt
from pipeline.trt import capabilities, MODULE, data_type, dtype_name, trt

PLUGIN_NAME = "TrtmcTvmFfiSlot"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "trtmc"
FIELDS = ("binding_id", "abi_sha256")

DL_DEVICES = {"cpu": 1, "cuda": 2}  # kDLCPU, kDLCUDA


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_LIBC = ctypes.CDLL(None)
_LIBC.malloc.restype, _LIBC.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
_FREE = ctypes.cast(_LIBC.free, ctypes.c_void_p).value
_CAPSULE_NEW = ctypes.pythonapi.PyCapsule_New
_CAPSULE_NEW.restype = ctypes.py_object
_CAPSULE_NEW.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_CAPSULE_NAME = b"dltensor"  # lives as long as the module: PyCapsule keeps only the pointer


def dl_tensor(ptr: int, dtype: str, shape: Sequence[int], device: tuple[str, int]) -> tvm_ffi.Tensor:
    """A non-owning, contiguous `tvm_ffi.Tensor` view of `ptr` (no Python constructor takes a raw
    pointer). The DLManagedTensor and its shape share one malloc'd block whose deleter is libc
    `free` (a Python deleter crashes at interpreter shutdown); the memory itself is not freed."""
    if dtype not in dtypes.BY_NAME or dtypes.BY_NAME[dtype].dlpack is None:
        raise UserError(f"slot tensor dtype {dtype}: has no DLPack type")
    ndim = len(shape)
    block = _LIBC.malloc(ctypes.sizeof(_DLManagedTensor) + 8 * ndim)
    if not block:
        raise MemoryError("malloc failed for a DLManagedTensor")
    shape_ptr = ctypes.cast(block + ctypes.sizeof(_DLManagedTensor), ctypes.POINTER(ctypes.c_int64))
    for i, d in enumerate(shape):
        shape_ptr[i] = int(d)
    m = _DLManagedTensor.from_address(block)
    dlpack = dtypes.BY_NAME[dtype].dlpack
    if dlpack is None:
        raise ValueError(f"{dtype}: no DLPack type")
    code, bits = dlpack
    m.dl_tensor = _DLTensor(ptr, _DLDevice(DL_DEVICES[device[0]], device[1]), ndim,
                            _DLDataType(code, bits, 1), shape_ptr, None, 0)
    m.manager_ctx, m.deleter = None, _FREE
    return tvm_ffi.from_dlpack(_CAPSULE_NEW(block, _CAPSULE_NAME, None))


@dataclass(frozen=True)
class RawTensor:
    """What TensorRT hands `enqueue` for one tensor: ABI dtype name, concrete shape, address."""
    dtype: str
    shape: tuple[int, ...]
    ptr: int


def _check(kernel: BoundKernel, label: str, specs: Sequence[Mapping], got: Sequence[RawTensor]):
    if len(got) != len(specs):
        raise UserError(f"slot '{kernel.binding_id}': {len(got)} {label}s, the ABI has {len(specs)}")
    for i, (spec, t) in enumerate(zip(specs, got)):
        declared = spec["shape"]
        if t.dtype != spec["dtype"] or len(t.shape) != len(declared) or any(
                d != -1 and d != s for d, s in zip(declared, t.shape)):
            raise UserError(f"slot '{kernel.binding_id}': {label} {i} is {t.dtype} {list(t.shape)}, "
                            f"the ABI declares {spec['dtype']} {list(declared)}")


def launch(kernel: BoundKernel, inputs: Sequence[RawTensor], workspace: int,
           outputs: Sequence[RawTensor], device: tuple[str, int], stream: int) -> None:
    """Call `kernel` as fn(*inputs, [workspace], *outputs, *extras) on raw memory, with `stream`
    as the TVM-FFI environment stream of `device`, so a CUDA kernel launches on TensorRT's
    stream. Checks dtypes and static dims against the ABI first; never synchronizes."""
    abi = kernel.abi
    _check(kernel, "input", abi["inputs"], inputs)
    _check(kernel, "output", abi["outputs"], outputs)
    ws = abi["workspace_bytes"]
    args = call_order([dl_tensor(t.ptr, t.dtype, t.shape, device) for t in inputs],
                      dl_tensor(workspace, "UINT8", (ws,), device) if ws > 0 else None,
                      [dl_tensor(t.ptr, t.dtype, t.shape, device) for t in outputs],
                      abi["extra_args"])
    with tvm_ffi.use_raw_stream(tvm_ffi.device(*device), stream):
        kernel(*args)


def _raw(descs, ptrs) -> list[RawTensor]:
    return [RawTensor(dtype_name(d.type), tuple(d.dims), int(p)) for d, p in zip(descs, ptrs)]


def _current_device_id(device_type: str) -> int:
    if device_type == "cpu":
        return 0
    import torch
    return torch.cuda.current_device()


@functools.cache
def _chars(value: str) -> np.ndarray:
    """`value` as int8 bytes that live for the process: a PluginField keeps only the pointer."""
    data = np.frombuffer(value.encode(), dtype=np.int8).copy()
    data.flags.writeable = False
    return data


def plugin_fields(binding_id: str, abi_sha256: str) -> trt.PluginFieldCollection:
    """The plugin's serialized fields: both as CHAR (bytes) fields."""
    return trt.PluginFieldCollection([
        trt.PluginField(name, _chars(value), trt.PluginFieldType.CHAR)
        for name, value in zip(FIELDS, (binding_id, abi_sha256))])


class SlotPlugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild,
                 trt.IPluginV3OneRuntime):
    """One kernel slot in a TensorRT network; every answer comes from the bound kernel's ABI."""

    def __init__(self, kernel: BoundKernel, device_type: str):
        trt.IPluginV3.__init__(self)
        trt.IPluginV3OneCore.__init__(self)
        trt.IPluginV3OneBuild.__init__(self)
        trt.IPluginV3OneRuntime.__init__(self)
        self.plugin_name, self.plugin_version = PLUGIN_NAME, PLUGIN_VERSION
        self.plugin_namespace = PLUGIN_NAMESPACE
        self.num_outputs = len(kernel.abi["outputs"])
        self.kernel, self.device_type = kernel, device_type

    # IPluginV3
    def get_capability_interface(self, _type):
        return self

    def clone(self) -> "SlotPlugin":
        return SlotPlugin(self.kernel, self.device_type)

    # IPluginV3OneBuild
    def get_output_data_types(self, _input_types) -> list:
        return [data_type(o["dtype"]) for o in self.kernel.abi["outputs"]]

    def get_output_shapes(self, inputs, _shape_inputs, expr_builder) -> list:
        """A dynamic output takes the dims of the ABI's like-input; otherwise the declared dims."""
        like = self.kernel.abi["output_shape_like_input"]
        if like is not None:
            return [inputs[like] for _ in self.kernel.abi["outputs"]]
        return [trt.DimsExprs([expr_builder.constant(d) for d in o["shape"]])
                for o in self.kernel.abi["outputs"]]

    def supports_format_combination(self, pos: int, in_out, num_inputs: int) -> bool:
        abi = self.kernel.abi
        spec = abi["inputs"][pos] if pos < num_inputs else abi["outputs"][pos - num_inputs]
        desc = in_out[pos].desc
        return desc.format == trt.TensorFormat.LINEAR and desc.type == data_type(spec["dtype"])

    def configure_plugin(self, _inputs, _outputs) -> None:
        pass  # nothing depends on the concrete formats: supports_format_combination allows one

    def get_workspace_size(self, _inputs, _outputs) -> int:
        return self.kernel.abi["workspace_bytes"]

    def get_valid_tactics(self) -> list[int]:
        return []

    # IPluginV3OneRuntime
    def set_tactic(self, _tactic: int) -> None:
        pass

    def on_shape_change(self, _inputs, _outputs) -> None:
        pass  # enqueue reads the shapes from its descs

    def attach_to_context(self, _resource_context) -> "SlotPlugin":
        return self.clone()

    def get_fields_to_serialize(self) -> trt.PluginFieldCollection:
        return plugin_fields(self.kernel.binding_id, self.kernel.abi_sha256)

    def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream) -> None:
        device = (self.device_type, _current_device_id(self.device_type))
        launch(self.kernel, _raw(input_desc, inputs), int(workspace), _raw(output_desc, outputs),
               device, int(stream))


class SlotPluginCreator(trt.IPluginCreatorV3One):
    """Creates slot plugins for the bound kernels only. `device_type` is "cuda" inside TensorRT;
    "cpu" lets enqueue run on host memory (tests)."""

    def __init__(self, kernels: Mapping[str, BoundKernel], device_type: str = "cuda"):
        trt.IPluginCreatorV3One.__init__(self)
        if device_type not in DL_DEVICES:
            raise UserError(f"slot plugin device '{device_type}': expected one of "
                            f"{', '.join(DL_DEVICES)}")
        self.name, self.plugin_version = PLUGIN_NAME, PLUGIN_VERSION
        self.plugin_namespace = PLUGIN_NAMESPACE
        self.field_names = trt.PluginFieldCollection([
            trt.PluginField(f, _chars(""), trt.PluginFieldType.CHAR)
            for f in FIELDS])
        self.kernels, self.device_type = kernels, device_type

    def create_plugin(self, name: str, fc, _phase) -> SlotPlugin:
        fields: dict[str, Any] = {f.name: bytes(f.data).decode() for f in fc}
        missing = [f for f in FIELDS if f not in fields]
        if missing:
            raise UserError(f"{PLUGIN_NAME} plugin '{name}': missing field(s) {', '.join(missing)} "
                            f"(expected {', '.join(FIELDS)})")
        binding_id, sha = fields["binding_id"], fields["abi_sha256"]
        kernel = self.kernels.get(binding_id)
        if kernel is None:
            raise UserError(f"{PLUGIN_NAME} plugin '{name}': binding id '{binding_id}' has no bound "
                            f"kernel (bound: {', '.join(sorted(self.kernels)) or 'none'})")
        if sha != kernel.abi_sha256:
            raise UserError(f"{PLUGIN_NAME} plugin '{name}': ABI mismatch for '{binding_id}': the "
                            f"plan has {sha}, the bound kernel {kernel.abi_sha256} (rebuild the "
                            f"plan or re-export the kernel for the current selection)")
        return SlotPlugin(kernel, self.device_type)


_registered: list[SlotPluginCreator] = []  # the registry keeps a raw pointer: keep it alive


def register_slot_plugins(kernels: Mapping[str, BoundKernel],
                          device_type: str = "cuda") -> SlotPluginCreator:
    """Register a creator for `kernels` with TensorRT's plugin registry, replacing an earlier one
    (a new pipeline binds anew). Must run before a plan with slot plugins is deserialized."""
    registry = trt.get_plugin_registry()
    old = registry.get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    if old is not None:
        registry.deregister_creator(old)
    creator = SlotPluginCreator(kernels, device_type)
    if not registry.register_creator(creator, PLUGIN_NAMESPACE):
        raise UserError(f"{MODULE}: registering plugin creator {PLUGIN_NAMESPACE}::"
                        f"{PLUGIN_NAME} v{PLUGIN_VERSION} failed")
    _registered[:] = [creator]
    return creator


def _tensors_by_name(network) -> dict[str, Any]:
    tensors = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        for j in range(layer.num_outputs):
            tensors[layer.get_output(j).name] = layer.get_output(j)
    return tensors


def insert_slot_layer(network, receipt: SelectionReceipt, creator: SlotPluginCreator):
    """Full TensorRT only: add the slot plugin on the receipt's boundary inputs and rewire every
    consumer of the region's output to the plugin's output (the region's layers become dead and
    TensorRT drops them). Raises the seam's clear error where plugin layers do not exist."""
    capabilities().require("has_plugin_layers", f"inserting slot plugin '{receipt.binding_id}'")
    tensors = _tensors_by_name(network)
    names = [t.name for t in receipt.inputs] + [receipt.outputs[0].name]
    unknown = [n for n in names if n not in tensors]
    if unknown:
        raise UserError(f"selection {receipt.binding_id}: tensor(s) {', '.join(unknown)} not in "
                        f"the network (recapture and select again)")
    plugin = creator.create_plugin(receipt.binding_id,
                                   plugin_fields(receipt.binding_id, receipt.abi_sha256),
                                   trt.TensorRTPhase.BUILD)
    layer = network.add_plugin_v3([tensors[n] for n in names[:-1]], [], plugin)
    layer.name = f"slot:{receipt.binding_id}"
    old_out, new_out = names[-1], layer.get_output(0)
    for i in range(network.num_layers):
        consumer = network.get_layer(i)
        for j in range(consumer.num_inputs):
            t = consumer.get_input(j)
            if t is not None and t.name == old_out:
                consumer.set_input(j, new_out)
    return layer
