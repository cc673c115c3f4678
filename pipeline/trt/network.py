"""A thin wrapper over a strongly typed TensorRT network that remembers where constants come from.

Families build networks through it so that every large constant is a checkpoint tensor taken as
stored (no numpy re-layout: layers use their own transpose options), which lets a bundle embed it
or reference it by name + digest. Recipes are recorded here while the family builds.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline import dtypes
from pipeline.errors import UserError
from pipeline.trt import LOGGER, trt
from pipeline.trt import data_type as _trt_dtype


def _weights(dtype: str, array: np.ndarray):
    return trt.Weights(_trt_dtype(dtype), array.ctypes.data, array.size)


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return (t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy())


@dataclass
class Recipe:
    recipe_id: str
    instance_id: str
    nodes: list[str]
    workspace_bytes: int = 0
    extra_args: list = field(default_factory=list)
    output_shape_like_input: int | None = None

    def as_json(self) -> dict:
        return {"recipe_id": self.recipe_id, "instance_id": self.instance_id, "nodes": self.nodes,
                "workspace_bytes": self.workspace_bytes, "extra_args": self.extra_args,
                "output_shape_like_input": self.output_shape_like_input}


class NetworkBuilder:
    """Owns the TensorRT builder/network and the arrays its constants point at (kept alive)."""

    def __init__(self, checkpoint=None):
        self.checkpoint = checkpoint
        self.builder = trt.Builder(LOGGER)
        self.network = self.builder.create_network(
            1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        self.weights: dict[str, dict] = {}       # weight key -> record (source, dtype, shape, ...)
        self.computed: dict[str, torch.Tensor] = {}  # weight key -> data of computed constants
        self.constant_keys: dict[int, str] = {}  # CONSTANT layer index -> weight key
        self.recipes: list[Recipe] = []
        self._keep: list[np.ndarray] = []
        self._cache: dict[str, object] = {}

    # -- tensors ---------------------------------------------------------------------------
    def input(self, name: str, dtype: str, shape):
        return self.network.add_input(name, _trt_dtype(dtype), tuple(shape))

    def _constant(self, key: str, dtype: str, shape, array: np.ndarray):
        self._keep.append(array)
        layer = self.network.add_constant(tuple(shape), _weights(dtype, array))
        layer.name = key
        self.constant_keys[self.network.num_layers - 1] = key
        return layer.get_output(0)

    def checkpoint_constant(self, name: str, shape, dtype: str | None = None):
        """The checkpoint tensor `name` as stored; zeros of `shape` when the checkpoint has no
        weights (structure-only capture), which costs no memory until touched."""
        if name in self._cache:
            return self._cache[name]
        ck = self.checkpoint
        if ck is not None and ck.has_weights:
            ck_dtype, ck_shape = ck.tensor_info(name)
            if list(ck_shape) != list(shape):
                raise UserError(f"{ck.path}: tensor '{name}' has shape {ck_shape}, expected {list(shape)}")
            dtype = ck_dtype
            array = ck.array(name)  # mapped from the file: no copy of the weights in memory
        else:
            dtype = dtype or (ck.torch_dtype if ck is not None else "FP32")
            array = np.zeros(tuple(shape), dtypes.numpy_storage(dtype))
        self.weights[name] = {"source": "checkpoint", "tensor": name, "dtype": dtype,
                              "shape": list(shape)}
        self._cache[name] = out = self._constant(name, dtype, shape, array)
        return out

    def computed_constant(self, name: str, value: torch.Tensor):
        """A small constant computed by the family (rotary tables, position ids): always embedded."""
        key = f"computed/{name}"
        if key in self._cache:
            return self._cache[key]
        value = value.contiguous()
        dtype = dtypes.name_of(value.dtype)
        self.weights[key] = {"source": "computed", "dtype": dtype, "shape": list(value.shape)}
        self.computed[key] = value
        self._cache[key] = out = self._constant(key, dtype, value.shape, _numpy_view(value))
        return out

    def scalar(self, name: str, value: float, dtype: str, rank: int):
        return self.computed_constant(name, torch.full((1,) * rank, value, dtype=dtypes.torch_dtype(dtype)))

    # -- layers ----------------------------------------------------------------------------
    def layer_index(self) -> int:
        """Index the next layer will get: families use it to record recipe node ids."""
        return self.network.num_layers

    def record_recipe(self, recipe_id: str, instance_id: str, first: int, last: int, **kw) -> None:
        self.recipes.append(Recipe(recipe_id, instance_id,
                                   [f"node:{i}" for i in range(first, last)], **kw))

    @contextlib.contextmanager
    def scope(self, prefix: str):
        """Layers (and their output tensors) added inside that TensorRT left unnamed get
        `prefix.<type>_<n>`, so graph listings and contracts read as the model's structure."""
        first = self.network.num_layers
        yield
        counts: dict[str, int] = {}
        for i in range(first, self.network.num_layers):
            layer = self.network.get_layer(i)
            if not layer.name.startswith("(Unnamed"):
                continue
            kind = layer.type.name.lower()
            n = counts[kind] = counts.get(kind, -1) + 1
            layer.name = f"{prefix}.{kind}_{n}"
            for j in range(layer.num_outputs):
                out = layer.get_output(j)
                if out.name.startswith("(Unnamed"):
                    out.name = layer.name if layer.num_outputs == 1 else f"{layer.name}:{j}"

    def mark_output(self, tensor, name: str):
        tensor.name = name
        self.network.mark_output(tensor)
        return tensor
