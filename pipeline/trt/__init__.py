"""The one seam to TensorRT: full `tensorrt` when installed, else TensorRT-RTX.

No other module imports a TensorRT module. Capabilities are measured facts of the module and the
machine, so callers can refuse early with a message that says what is missing and where it exists.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

from pipeline import dtypes
from pipeline.errors import UserError
from pipeline.kernels.build import cuda_gpu_present
from pipeline.log import trt_severity_name


def _import():
    for name in ("tensorrt", "tensorrt_rtx"):
        try:
            return importlib.import_module(name), name
        except ImportError:
            continue
    raise UserError("no TensorRT module: pip install 'tensorrt-rtx-cu13>=1.7.1.116,<1.8' (or install "
                    "full TensorRT)")


trt, MODULE = _import()
VERSION: str = trt.__version__
# TensorRT's messages follow trtmc's verbosity (pipeline/log.py), set before this module loads.
LOGGER = trt.Logger(getattr(trt.Logger, trt_severity_name()))


@dataclass(frozen=True)
class Capabilities:
    builds_plans: bool        # build_serialized_network works (both modules, also on CPU)
    has_plugin_layers: bool   # INetworkDefinition.add_plugin_v3 exists (full TensorRT only)
    can_execute: bool         # a GPU this module can run engines on is present

    def require(self, name: str, purpose: str) -> None:
        if not getattr(self, name):
            raise UserError(f"{purpose} needs '{name}', which {MODULE} {VERSION} on this machine lacks"
                            + (": TensorRT-RTX has no plugin layers; use full TensorRT"
                               if name == "has_plugin_layers" else
                               ": no supported GPU here; use the reference runtime"))


@functools.cache
def capabilities() -> Capabilities:
    """Measured on first use: probing for a GPU initialises the CUDA driver, which importing
    this module must not do."""
    net_cls = trt.INetworkDefinition
    return Capabilities(
        builds_plans=hasattr(trt.Builder, "build_serialized_network"),
        has_plugin_layers=hasattr(net_cls, "add_plugin_v3"),
        can_execute=cuda_gpu_present(),
    )



def dtype_name(dt) -> str:
    """`DataType.HALF` -> "FP16": the names the snapshot and ABI use."""
    return dtypes.BY_TRT[dt.name].name


def data_type(name: str):
    """"FP16" -> `DataType.HALF`."""
    return getattr(trt.DataType, dtypes.BY_NAME[name].trt)


# LayerType -> subclass, so layer attributes (.op, .axes, ...) can be read: Polygraphy's trick.
def layer_class(layer_type):
    name = {
        "ELEMENTWISE": "IElementWiseLayer", "MATRIX_MULTIPLY": "IMatrixMultiplyLayer",
        "SHUFFLE": "IShuffleLayer", "CONSTANT": "IConstantLayer", "CAST": "ICastLayer",
        "REDUCE": "IReduceLayer", "NORMALIZATION": "INormalizationLayer",
        "ACTIVATION": "IActivationLayer", "UNARY": "IUnaryLayer", "SOFTMAX": "ISoftMaxLayer",
        "GATHER": "IGatherLayer", "SLICE": "ISliceLayer", "CONCATENATION": "IConcatenationLayer",
        "SELECT": "ISelectLayer", "IDENTITY": "IIdentityLayer", "SHAPE": "IShapeLayer",
        "ATTENTION_INPUT": "IAttentionInputLayer", "ATTENTION_OUTPUT": "IAttentionOutputLayer",
        "KV_CACHE_UPDATE": "IKVCacheUpdateLayer", "ROTARY_EMBEDDING": "IRotaryEmbeddingLayer",
        "FILL": "IFillLayer", "SCATTER": "IScatterLayer", "UNSQUEEZE": "IUnsqueezeLayer",
        "SQUEEZE": "ISqueezeLayer", "TOPK": "ITopKLayer", "CUMULATIVE": "ICumulativeLayer",
        "ONE_HOT": "IOneHotLayer", "EINSUM": "IEinsumLayer", "SCALE": "IScaleLayer",
        "DIST_COLLECTIVE": "IDistCollectiveLayer",
    }.get(layer_type.name)
    return getattr(trt, name, None) if name else None


def typed_layer(layer):
    cls = layer_class(layer.type)
    if cls is not None:
        layer.__class__ = cls
    return layer
