"""Every region rule (docs/pipeline.md, "Region rules"), each on a small real TensorRT network."""
from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest

from pipeline.errors import UserError
from pipeline.families.capture import snapshot_of
from pipeline.graph.abi import abi_sha256
from pipeline.graph.receipt import ExtraArg, RecipeInstance
from pipeline.graph.select import (FORBIDDEN_TYPES, MAX_RANK, check_fresh, from_recipe,
                                   load_receipt, save_receipt, select_region)
from pipeline.trt import LOGGER, trt

BUILD = {"family": "bert", "model": "tiny", "revision": "r1", "options": {"precision": "fp16"}}
U, E = trt.UnaryOperation, trt.ElementWiseOperation


def capture(make, role="decode", build=BUILD, recipes=()):
    """Snapshot of the network `make(net)` builds (it marks its own outputs)."""
    builder = trt.Builder(LOGGER)
    net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    make(net)
    return snapshot_of(net, role, build, list(recipes))


def unary(net, x, op):
    return net.add_unary(x, op).get_output(0)


def chain(net, dtype=trt.float16, shape=(4, 8)):
    """x -> node:0 ABS -> node:1 NEG -> node:2 EXP -> output"""
    x = net.add_input("x", dtype, shape)
    net.mark_output(unary(net, unary(net, unary(net, x, U.ABS), U.NEG), U.EXP))


def diamond(net):
    """x -> node:0 ABS=a -> node:1 NEG=b; node:2 SUM(a, b) -> node:3 EXP -> output"""
    x = net.add_input("x", trt.float16, (4, 8))
    a = unary(net, x, U.ABS)
    b = unary(net, a, U.NEG)
    s = net.add_elementwise(a, b, E.SUM).get_output(0)
    net.mark_output(unary(net, s, U.EXP))


def select(snap, nodes, **kw):
    return select_region(snap, nodes, **{"binding_id": "k", **kw})


def rejected(snap, nodes, match, **kw):
    with pytest.raises(UserError, match=match):
        select(snap, nodes, **kw)


# -- valid selections -----------------------------------------------------------------------

def test_valid_region_receipt(tmp_path):
    snap = capture(chain)
    receipt = select(snap, ["node:1", "node:0"], workspace_bytes=64,
                     extra_args=[{"type": "int", "value": 7}, {"type": "none"}])
    assert receipt.nodes == ("node:0", "node:1")  # graph order, whatever order was given
    assert receipt.input_tensor_ids == ("tensor:0",)
    assert receipt.output_tensor_ids == ("tensor:2",)
    assert [t.to_json() for t in receipt.inputs] == [{"tensor_id": "tensor:0", "name": "x", "dtype": "FP16",
                                  "shape": [4, 8]}]
    assert receipt.outputs[0].dtype == "FP16" and receipt.outputs[0].shape == (4, 8)
    assert receipt.graph_fingerprint == snap["fingerprint"]
    assert receipt.engine_role == "decode" and receipt.recipe is None
    assert receipt.build.to_json() == snap["build"]
    assert receipt.abi_sha256 == abi_sha256(receipt.abi.to_json())
    path = tmp_path / "k.selection.json"
    save_receipt(receipt, path)
    assert load_receipt(path) == receipt


def test_edited_receipt_is_rejected_on_load(tmp_path):
    receipt = select(capture(chain), ["node:0"])
    receipt = dataclasses.replace(receipt, workspace_bytes=128)  # changes the ABI without recomputing its hash
    path = tmp_path / "k.selection.json"
    save_receipt(receipt, path)
    with pytest.raises(UserError, match="abi/abi_sha256 do not match"):
        load_receipt(path)


def test_boundary_inputs_in_order_of_first_use_constants_included():
    def make(net):
        x = net.add_input("x", trt.float16, (4, 8))
        y = net.add_input("y", trt.float16, (4, 8))
        n0 = unary(net, y, U.NEG)                                         # node:0
        n1 = net.add_elementwise(x, n0, E.SUM).get_output(0)              # node:1
        c = net.add_constant((1, 8), np.ones((1, 8), np.float16)).get_output(0)  # node:2
        n3 = net.add_elementwise(n1, c, E.PROD).get_output(0)             # node:3
        net.mark_output(unary(net, n3, U.EXP))                            # node:4
    snap = capture(make)
    receipt = select(snap, ["node:3", "node:0", "node:1"])
    names = {t["id"]: t["name"] for t in snap["tensors"]}
    const_out = next(n["outputs"][0] for n in snap["nodes"] if n["type"] == "CONSTANT")
    assert [names[t] for t in receipt.input_tensor_ids[:2]] == ["y", "x"]
    assert receipt.input_tensor_ids[2] == const_out


@pytest.mark.parametrize("dtype, name", [(trt.bfloat16, "BF16"), (trt.float16, "FP16"),
                                         (trt.float32, "FP32"), (trt.int32, "INT32")])
def test_allowed_boundary_dtypes(dtype, name):
    def make(net):
        x = net.add_input("x", dtype, (4, 8))
        s = net.add_elementwise(x, x, E.SUM).get_output(0)
        net.mark_output(net.add_elementwise(s, x, E.SUM).get_output(0))
    receipt = select(capture(make), ["node:0"])
    assert [t.dtype for t in receipt.inputs + receipt.outputs] == [name, name]


def test_dynamic_output_with_like_input():
    snap = capture(lambda net: chain(net, shape=(-1, 8)))
    receipt = select(snap, ["node:0"], output_shape_like_input=0)
    assert receipt.outputs[0].shape == (-1, 8)
    assert receipt.abi.output_shape_like_input == 0


# -- rejected selections --------------------------------------------------------------------

def test_unknown_node():
    rejected(capture(chain), ["node:0", "node:9"], r"node 'node:9' does not exist .*node:0\.\.node:2")


def test_repeated_node():
    rejected(capture(chain), ["node:0", "node:1", "node:0"], "node node:0 is selected twice")


def test_no_nodes():
    rejected(capture(chain), [], "no nodes selected")


def test_disconnected():
    def make(net):
        x = net.add_input("x", trt.float16, (4, 8))
        s = net.add_elementwise(unary(net, x, U.ABS), unary(net, x, U.NEG), E.SUM).get_output(0)
        net.mark_output(unary(net, s, U.EXP))
    rejected(capture(make), ["node:0", "node:1"], "not connected: node:1 shares no tensor")


def test_non_convex_names_the_path():
    rejected(capture(diamond), ["node:0", "node:2"],
             "not convex: the path node:0 -> node:1 -> node:2 leaves the region and re-enters it")


def test_two_output_tensors():
    rejected(capture(diamond), ["node:0", "node:1"], "has 2 output tensors: tensor:1 .* tensor:2")


def test_no_output_tensor():
    def make(net):
        x = net.add_input("x", trt.float16, (4, 8))
        unary(net, x, U.ABS)  # node:0: nothing uses its output
        net.mark_output(unary(net, x, U.NEG))
    rejected(capture(make), ["node:0"], "has 0 output tensors .*nothing outside it uses")


def test_network_output():
    rejected(capture(chain), ["node:1", "node:2"], "produces network output tensor:3")


def test_shape_tensor():
    def make(net):
        x = net.add_input("x", trt.float16, (4, 8))
        shape = net.add_shape(x).get_output(0)        # node:0
        r = net.add_shuffle(x)                         # node:1
        r.set_input(1, shape)
        net.mark_output(unary(net, r.get_output(0), U.EXP))
    rejected(capture(make), ["node:0"], "node:0 touches shape tensor tensor:1")


def test_host_tensor():
    def make(net):
        x = net.add_input("x", trt.float16, (4, 8))  # only its shape is used: a host tensor
        shape = net.add_shape(x).get_output(0)                         # node:0
        f = net.add_cast(shape, trt.float32).get_output(0)             # node:1
        net.mark_output(unary(net, f, U.ABS))                          # node:2
    snap = capture(make)
    assert snap["tensors"][0]["location"] == "HOST" and not snap["tensors"][0]["is_shape_tensor"]
    rejected(snap, ["node:0", "node:1"], "node:0 touches host tensor tensor:0 'x' .*device tensors")


def test_rank_above_8():
    """TensorRT's Dims hold at most 8 dims, so no network can have a rank-9 tensor; a snapshot
    file can (hand-edited, or from another TensorRT), and the validator still refuses it."""
    builder = trt.Builder(LOGGER)
    net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    assert trt.Dims.MAX_DIMS == MAX_RANK
    with pytest.raises(TypeError):
        net.add_input("x", trt.float16, (1,) * (MAX_RANK + 1))
    snap = capture(lambda n: chain(n, shape=(1,) * MAX_RANK))
    select(snap, ["node:0"])  # rank 8 is fine
    snap["tensors"][0]["shape"] = [1] * (MAX_RANK + 1)
    rejected(snap, ["node:0"], "boundary tensor tensor:0 'x' has rank 9, expected at most 8")


def test_dtype_not_allowed():
    def make(net):
        y = net.add_input("y", trt.bool, (4, 8))
        n = unary(net, y, U.NOT)                                         # node:0
        net.mark_output(unary(net, net.add_cast(n, trt.float16).get_output(0), U.ABS))
    rejected(capture(make), ["node:0"], "tensor:0 'y' has dtype BOOL, expected one of BF16, FP16")


def test_boundary_not_linear():
    def make(net):
        chain(net)
        net.get_input(0).allowed_formats = 1 << int(trt.TensorFormat.HWC8)
    rejected(capture(make), ["node:0"], "tensor:0 'x' has format HWC8, expected LINEAR")


def test_dynamic_output_needs_like_input():
    snap = capture(lambda net: chain(net, shape=(-1, 8)))
    rejected(snap, ["node:0"], r"dynamic shape \[-1, 8\]; give output_shape_like_input")
    rejected(snap, ["node:0"], "output_shape_like_input 1 is not an input index",
             output_shape_like_input=1)


def test_like_input_differs_in_dtype():
    def make(net):
        x = net.add_input("x", trt.float16, (-1, 8))
        net.mark_output(unary(net, net.add_cast(x, trt.float32).get_output(0), U.ABS))
    rejected(capture(make), ["node:0"], r"names input tensor:0 'x' FP16 \[-1, 8\], which differs",
             output_shape_like_input=0)


def test_like_input_differs_in_shape():
    def make(net):
        x = net.add_input("x", trt.float16, (-1, 8))
        y = net.add_input("y", trt.float16, (1, 8))
        net.mark_output(unary(net, net.add_elementwise(x, y, E.SUM).get_output(0), U.ABS))
    snap = capture(make)
    select(snap, ["node:0"], output_shape_like_input=0)
    rejected(snap, ["node:0"], r"names input tensor:1 'y' FP16 \[1, 8\], which differs",
             output_shape_like_input=1)


@pytest.mark.parametrize("arg, match", [
    ({"type": "tensor"}, "is not an extra arg"),
    ("3", "is not an extra arg"),
    ({"type": "int", "value": 2 ** 31}, "not a signed 32-bit integer"),
    ({"type": "int", "value": -(2 ** 31) - 1}, "not a signed 32-bit integer"),
    ({"type": "int", "value": 1.5}, "not a signed 32-bit integer"),
    ({"type": "int", "value": True}, "not a signed 32-bit integer"),
    ({"type": "float", "value": math.nan}, "not a finite number"),
    ({"type": "float", "value": math.inf}, "not a finite number"),
    ({"type": "float", "value": "1.0"}, "not a finite number"),
    ({"type": "ptr", "value": 4096}, "must be null"),
    ({"type": "none", "value": 0}, "has keys"),
])
def test_bad_extra_args(arg, match):
    rejected(capture(chain), ["node:0"], r"extra args\[1\]: .*" + match,
             extra_args=[{"type": "none"}, arg])


def test_bad_workspace_and_binding_id():
    snap = capture(chain)
    rejected(snap, ["node:0"], "workspace bytes -1: expected an integer >= 0", workspace_bytes=-1)
    rejected(snap, ["node:0"], "binding_id 'a b' must start", binding_id="a b")


def test_stale_fingerprint_and_wrong_role():
    receipt = select(capture(chain), ["node:0"])
    check_fresh(receipt, capture(chain), "test")  # same graph recaptured: fresh
    other_revision = capture(chain, build={**BUILD, "revision": "r2"})
    with pytest.raises(UserError, match="stale .*recapture after changing the revision or "
                                        "graph-producing options"):
        check_fresh(receipt, other_revision, "test")
    with pytest.raises(UserError, match="is for engine role 'decode', but the graph is engine "
                                        "role 'decoder'"):
        check_fresh(receipt, capture(chain, role="decoder"), "test")


def loop_net(net):
    """x -> node:1 TRIP_LIMIT, node:2 RECURRENCE <-> node:3 ABS (body), node:4 LOOP_OUTPUT -> NEG"""
    x = net.add_input("x", trt.float32, (2, 3))
    loop = net.add_loop()
    loop.add_trip_limit(net.add_constant((), np.array(3, np.int32)).get_output(0),
                        trt.TripLimit.COUNT)
    rec = loop.add_recurrence(x)
    body = net.add_unary(rec.get_output(0), U.ABS)
    rec.set_input(1, body.get_output(0))
    out = loop.add_loop_output(rec.get_output(0), trt.LoopOutput.LAST_VALUE)
    net.mark_output(unary(net, out.get_output(0), U.NEG))


def test_loop_layers():
    snap = capture(loop_net)
    assert [n["type"] for n in snap["nodes"][1:5]] == ["TRIP_LIMIT", "RECURRENCE", "UNARY",
                                                        "LOOP_OUTPUT"]
    rejected(snap, ["node:2", "node:3"], r"node:2 \(RECURRENCE .* is a loop layer")
    rejected(snap, ["node:3"], r"node:3 \(UNARY .* is inside a loop body \(opened by node:2")


def test_conditional_layers():
    def make(net):
        x = net.add_input("x", trt.float32, (2, 3))
        cond = net.add_if_conditional()
        cond.set_condition(net.add_input("c", trt.bool, ()))
        inp = cond.add_input(x)                                                # node:1
        then, other = unary(net, inp.get_output(0), U.ABS), unary(net, inp.get_output(0), U.NEG)
        out = cond.add_output(then, other)                                     # node:4
        net.mark_output(unary(net, out.get_output(0), U.EXP))
    snap = capture(make)
    rejected(snap, ["node:1", "node:2"], r"node:1 \(CONDITIONAL_INPUT .* is a conditional layer")
    rejected(snap, ["node:3"], r"node:3 \(UNARY .* inside a conditional branch")


def test_collective_layer():
    def make(net):
        x = net.add_input("x", trt.float16, (4, 8))
        d = net.add_dist_collective(x, trt.CollectiveOperation.ALL_REDUCE, trt.ReduceOperation.SUM,
                                    -1, None)
        net.mark_output(unary(net, d.get_output(0), U.ABS))
    rejected(capture(make), ["node:0"], r"node:0 \(DIST_COLLECTIVE .* is a collective layer")


def test_plugin_layer_types_are_refused():
    """TensorRT-RTX cannot add plugin layers (no add_plugin*), so a plugin node can only come from
    a snapshot file made elsewhere; every plugin LayerType is refused by name."""
    plugin_types = {n for n in trt.LayerType.__members__ if "PLUGIN" in n}
    assert plugin_types == {"PLUGIN", "PLUGIN_V2", "PLUGIN_V3"}
    assert all(FORBIDDEN_TYPES[t] == "a plugin layer" for t in plugin_types)
    snap = capture(chain)
    for t in sorted(plugin_types):
        edited = copy.deepcopy(snap)
        edited["nodes"][1]["type"] = t
        rejected(edited, ["node:1"], rf"node:1 \({t} .* is a plugin layer")


# -- recipes --------------------------------------------------------------------------------

RECIPES = [
    {"recipe_id": "t.abs_neg@1", "instance_id": "block.0", "nodes": ["node:0", "node:1"],
     "workspace_bytes": 32, "extra_args": [{"type": "float", "value": 0.5}],
     "output_shape_like_input": None},
    {"recipe_id": "t.abs_neg@1", "instance_id": "block.1", "nodes": ["node:1"],
     "workspace_bytes": 0, "extra_args": [], "output_shape_like_input": None},
    {"recipe_id": "t.bad@1", "instance_id": "block.0", "nodes": ["node:0"],
     "workspace_bytes": 0, "extra_args": [{"type": "ptr", "value": 1}],
     "output_shape_like_input": None},
]


def test_from_recipe_exact_instance():
    snap = capture(chain, recipes=RECIPES)
    receipt = from_recipe(snap, "t.abs_neg@1", "block.0")
    assert receipt.binding_id == "t.abs_neg@1"  # a recipe binds under its recipe id
    assert receipt.nodes == ("node:0", "node:1")
    assert receipt.workspace_bytes == 32
    assert receipt.extra_args == (ExtraArg("float", 0.5),)
    assert receipt.recipe == RecipeInstance("t.abs_neg@1", "block.0")
    assert from_recipe(snap, "t.abs_neg@1", "block.1", binding_id="mine").nodes == ("node:1",)
    assert from_recipe(snap, "t.abs_neg@1", "block.1", binding_id="mine").binding_id == "mine"


def test_from_recipe_unknown_lists_what_exists():
    snap = capture(chain, recipes=RECIPES)
    with pytest.raises(UserError, match=r"no recipe 't.x@1' .*recipes: t.abs_neg@1, t.bad@1"):
        from_recipe(snap, "t.x@1", "block.0")
    with pytest.raises(UserError, match="has no instance 'block.9' .*instances: block.0, block.1"):
        from_recipe(snap, "t.abs_neg@1", "block.9")


def test_recipe_goes_through_the_validator():
    with pytest.raises(UserError, match=r"recipe t.bad@1 block.0: extra args\[0\]: .*must be null"):
        from_recipe(capture(chain, recipes=RECIPES), "t.bad@1", "block.0")


# -- a real encoder -------------------------------------------------------------------------

def test_distilbert_attention_residual_contract(tmp_path):
    """Full-size DistilBERT from config.json alone: the first attention residual add is a
    two-input FP16 [256, 768] slot (hidden state + attention projection)."""
    from transformers import DistilBertConfig

    from pipeline.families.capture import capture_role
    DistilBertConfig().save_pretrained(tmp_path)
    snap = capture_role(str(tmp_path), None, "decode",
                        {"precision": "fp16", "sequence_length": 256}).snapshot
    node = next(n for n in snap["nodes"] if n["name"] == "encoder.layers.0.attention_residual_add")
    receipt = select(snap, [node["id"]])
    producer = {t: n for n in snap["nodes"] for t in n["outputs"]}
    hidden, proj = (producer[t.tensor_id] for t in receipt.inputs)
    assert hidden["type"] == "NORMALIZATION"  # the embeddings LayerNorm
    assert proj["op"] == "ElementWiseOperation.SUM"  # the out_lin bias add
    assert [(t.dtype, t.shape) for t in receipt.inputs] == [("FP16", (256, 768))] * 2
    assert [(t.dtype, t.shape) for t in receipt.outputs] == [("FP16", (256, 768))]
    assert receipt.workspace_bytes == 0 and receipt.extra_args == ()
    assert receipt.output_shape_like_input is None
