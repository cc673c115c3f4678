"""Read a live TensorRT network back into plain data: nodes, tensors and each layer's attributes.

The snapshot (graph/) uses nodes and tensors; the bundle's network export adds the attributes and
weight keys, which is everything the reference runtime needs to execute exactly this network.
"""
from __future__ import annotations

import enum

from pipeline.trt import dtype_name, trt, typed_layer

# Attributes read per layer type; anything an executor needs beyond the inputs.
_ATTRS = {
    "ELEMENTWISE": ["op"],
    "MATRIX_MULTIPLY": ["op0", "op1"],
    "SHUFFLE": ["first_transpose", "reshape_dims", "second_transpose", "zero_is_placeholder"],
    "CONSTANT": ["shape"],
    "CAST": ["to_type"],
    "REDUCE": ["op", "axes", "keep_dims"],
    "NORMALIZATION": ["axes", "epsilon", "num_groups"],
    "ACTIVATION": ["type", "alpha", "beta"],
    "UNARY": ["op"],
    "SOFTMAX": ["axes"],
    "GATHER": ["axis", "mode", "num_elementwise_dims"],
    "SLICE": ["start", "shape", "stride", "mode"],
    "CONCATENATION": ["axis"],
    "KV_CACHE_UPDATE": ["cache_mode"],
    "ROTARY_EMBEDDING": ["interleaved", "rotary_embedding_dim"],
    "UNSQUEEZE": [], "SQUEEZE": [], "IDENTITY": [], "SELECT": [], "SHAPE": [],
}
_ATTENTION_ATTRS = ["norm_op", "causal", "causal_kind", "decomposable"]


def _plain(value):
    if isinstance(value, enum.Enum) or type(value).__name__ in (
            "ElementWiseOperation", "MatrixOperation", "DataType", "ReduceOperation",
            "ActivationType", "UnaryOperation", "GatherMode", "SampleMode", "KVCacheMode",
            "AttentionNormalizationOp", "CausalMaskKind"):
        return value.name
    if isinstance(value, (trt.Dims,)) or type(value).__name__.startswith("Dims"):
        return [int(d) for d in value]
    if isinstance(value, (bool, int, float, str, list)) or value is None:
        return value
    return str(value)


def _permutation(value, rank: int) -> list[int]:
    return [int(value[i]) for i in range(rank)]


def layer_attrs(layer, t: str, input_rank: int | None) -> dict:
    """Executor-relevant attributes of one typed layer of LayerType name `t`, as JSON-able values."""
    out = {}
    for name in _ATTRS.get(t, ()):
        value = getattr(layer, name)
        if name in ("first_transpose", "second_transpose"):
            continue
        if name == "reshape_dims" and value is not None:
            value = [int(d) for d in value]
        out[name] = _plain(value)
    if t == "SHUFFLE":
        out["first_transpose"] = _permutation(layer.first_transpose, input_rank or 0)
        rank2 = len(out["reshape_dims"]) if out.get("reshape_dims") is not None else input_rank or 0
        out["second_transpose"] = _permutation(layer.second_transpose, rank2)
    if t in ("ATTENTION_INPUT", "ATTENTION_OUTPUT"):
        att = layer.attention
        out = {name: _plain(getattr(att, name)) for name in _ATTENTION_ATTRS}
    return out


def walk(network):
    """-> (nodes, tensors): ids are "node:<layer index>" and "tensor:<n>" in order of appearance
    (network inputs first, then each layer's outputs), so equal networks give equal ids."""
    ids: dict[str, str] = {}
    tensors: list[dict] = []
    outputs = {network.get_output(i).name for i in range(network.num_outputs)}
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}

    def tid(tensor) -> str:
        name = tensor.name
        if name not in ids:
            ids[name] = f"tensor:{len(tensors)}"
            fmt = tensor.allowed_formats
            linear = 1 << int(trt.TensorFormat.LINEAR)
            tensors.append({
                "id": ids[name], "name": name, "dtype": dtype_name(tensor.dtype),
                "shape": [int(d) for d in tensor.shape],
                "location": _location(tensor),
                "format": "LINEAR" if fmt & linear else _format_names(fmt),
                "is_shape_tensor": bool(tensor.is_shape_tensor),
                "is_network_input": name in inputs, "is_network_output": name in outputs,
            })
        return ids[name]

    for i in range(network.num_inputs):
        tid(network.get_input(i))
    nodes = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        ltype = layer.type.name
        layer = typed_layer(layer)
        node_inputs = [tid(layer.get_input(j)) if layer.get_input(j) is not None else None
                       for j in range(layer.num_inputs)]
        node = {"id": f"node:{i}", "type": ltype, "name": layer.name,
                "inputs": node_inputs, "outputs": [tid(layer.get_output(j))
                                                   for j in range(layer.num_outputs)]}
        if ltype in ("ELEMENTWISE", "UNARY", "REDUCE"):
            node["op"] = f"{type(layer.op).__name__}.{layer.op.name}"
        elif ltype == "ACTIVATION":
            node["op"] = f"ActivationType.{layer.type.name}"
        nodes.append((layer, node))
    return nodes, tensors


def _location(tensor) -> str:
    """HOST for tensors that only exist as shape values (not execution tensors)."""
    if hasattr(tensor, "location"):
        return tensor.location.name
    return "DEVICE" if tensor.is_execution_tensor else "HOST"


def _format_names(mask: int) -> str:
    names = [f.name for f in trt.TensorFormat.__members__.values() if mask & (1 << int(f))]
    return "|".join(names) or "NONE"


def export_network(nb, engine_role: str) -> dict:
    """The bundle's network export of a NetworkBuilder's network (attributes + weight keys)."""
    net = nb.network
    layers, tensors = walk(net)
    rank = {t["id"]: len(t["shape"]) for t in tensors}
    out_layers = []
    for layer, node in layers:
        first = node["inputs"][0] if node["inputs"] else None
        attrs = layer_attrs(layer, node["type"], rank.get(first))
        index = int(node["id"].split(":")[1])
        if node["type"] == "CONSTANT":
            attrs["weights"] = nb.constant_keys[index]
        out_layers.append({**node, "attrs": attrs})
    return {
        "schema_version": 1, "engine_role": engine_role,
        "inputs": [t["id"] for t in tensors if t["is_network_input"]],
        "outputs": [t["id"] for t in tensors if t["is_network_output"]],
        "tensors": tensors, "layers": out_layers, "weights": nb.weights,
    }
