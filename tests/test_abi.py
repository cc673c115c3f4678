"""The kernel ABI hash: reproducible, sensitive to every ABI field, blind to ids and names; its
call signature; the schemas that carry it; a receipt checked against what its spec asks for."""
from __future__ import annotations

import copy
import hashlib
import json

import pytest

from pipeline.errors import UserError
from pipeline.families.capture import snapshot_of
from pipeline.graph.abi import (BINDING_ID_PATTERN, EXTRA_ARG_TYPES, Signature, abi_of,
                                abi_sha256, call_order)
from pipeline.graph.bounds import ABI_LIMITS
from pipeline.graph.receipt import SelectionReceipt
from pipeline.graph.select import (BINDING_ID, BOUNDARY_DTYPES, MAX_RANK, MAX_WORKSPACE_BYTES,
                                   format_contract, select_region)
from pipeline.jsonio import SCHEMA_DIR
from pipeline.trt import LOGGER, trt

INPUTS = [{"tensor_id": "tensor:3", "name": "hidden", "dtype": "FP16", "shape": [256, 768]},
          {"tensor_id": "tensor:9", "name": "proj", "dtype": "FP16", "shape": [256, 768]}]
OUTPUTS = [{"tensor_id": "tensor:10", "name": "sum", "dtype": "FP16", "shape": [256, 768]}]
EXTRA = [{"type": "int", "value": 3}, {"type": "float", "value": 0.125}, {"type": "ptr", "value": None},
         {"type": "none"}]


def base() -> dict:
    return {"inputs": copy.deepcopy(INPUTS), "outputs": copy.deepcopy(OUTPUTS),
            "workspace_bytes": 1024, "extra_args": copy.deepcopy(EXTRA),
            "output_shape_like_input": None}


def sha(**kw) -> str:
    return abi_sha256(abi_of(**kw))


def test_stable_and_canonical():
    abi = abi_of(**base())
    assert abi == abi_of(**base())
    canonical = json.dumps(abi, sort_keys=True, separators=(",", ":")).encode()
    assert abi_sha256(abi) == hashlib.sha256(canonical).hexdigest() == sha(**base())
    # key order of the inputs does not matter, only their content
    reordered = {k: abi[k] for k in reversed(list(abi))}
    assert abi_sha256(reordered) == abi_sha256(abi)


def _variants():
    def edit(fn):
        kw = base()
        fn(kw)
        return kw
    yield "input dtype", edit(lambda k: k["inputs"][1].update(dtype="BF16"))
    yield "input shape", edit(lambda k: k["inputs"][0].update(shape=[128, 768]))
    yield "input count", edit(lambda k: k["inputs"].pop())
    yield "output dtype", edit(lambda k: k["outputs"][0].update(dtype="FP32"))
    yield "output shape", edit(lambda k: k["outputs"][0].update(shape=[-1, 768]))
    yield "workspace", edit(lambda k: k.update(workspace_bytes=0))
    yield "extra arg value", edit(lambda k: k["extra_args"][0].update(value=4))
    yield "extra arg kind", edit(lambda k: k["extra_args"].__setitem__(3, {"type": "ptr", "value": None}))
    yield "extra arg count", edit(lambda k: k["extra_args"].pop())
    yield "like input", edit(lambda k: k.update(output_shape_like_input=0))


def test_every_field_changes_the_hash():
    hashes = {"base": sha(**base())}
    for name, kw in _variants():
        hashes[name] = sha(**kw)
    assert len(set(hashes.values())) == len(hashes), hashes


def test_swapping_differing_inputs_changes_the_hash():
    kw = base()
    kw["inputs"][0]["dtype"] = "FP32"
    swapped = base()
    swapped["inputs"] = list(reversed(kw["inputs"]))
    assert sha(**kw) != sha(**swapped)


def test_ids_and_names_do_not_change_the_hash():
    renamed = base()
    for i, t in enumerate(renamed["inputs"] + renamed["outputs"]):
        t.update(tensor_id=f"tensor:{100 + i}", name=f"other{i}")
    assert sha(**renamed) == sha(**base())


def test_float_extra_arg_written_as_int_hashes_the_same():
    as_int = base()
    as_int["extra_args"][1] = {"type": "float", "value": 2}
    as_float = base()
    as_float["extra_args"][1] = {"type": "float", "value": 2.0}
    assert sha(**as_int) == sha(**as_float)


def test_same_region_elsewhere_in_the_graph_has_the_same_abi():
    """Two identical ops at different nodes (different ids and names): one kernel binds both."""
    builder = trt.Builder(LOGGER)
    net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    x = net.add_input("x", trt.float16, (4, 8))
    a = net.add_unary(x, trt.UnaryOperation.ABS)
    a.name = "first"
    b = net.add_unary(a.get_output(0), trt.UnaryOperation.ABS)
    b.name = "second"
    net.mark_output(net.add_unary(b.get_output(0), trt.UnaryOperation.EXP).get_output(0))
    snap = snapshot_of(net, "decode", {"family": "bert", "model": "m", "revision": "r",
                                             "options": {}}, [])
    first = select_region(snap, ["node:0"], binding_id="a")
    second = select_region(snap, ["node:1"], binding_id="b")
    assert first.input_tensor_ids != second.input_tensor_ids
    assert first.abi_sha256 == second.abi_sha256


@pytest.mark.parametrize("kw, match", [
    ({"workspace_bytes": -1}, "expected an integer >= 0"),
    ({"workspace_bytes": True}, "expected an integer >= 0"),
    ({"extra_args": [{"type": "int", "value": 2 ** 31}]}, "not a signed 32-bit integer"),
    ({"extra_args": {"type": "none"}}, "expected a list of extra args"),
])
def test_invalid_abi_fields(kw, match):
    with pytest.raises(UserError, match=match):
        abi_of(**{**base(), **kw})


# -- the call signature: one order for calls, the binding check and the printed contract --------
def test_signature_orders_parameters_as_calls_are_made():
    abi = abi_of(**base())
    sig = Signature.of(abi, ["hidden", "proj", "sum"])
    assert [p.label for p in sig.params] == [
        "input 0", "input 1", "workspace", "output 0", "extra 0", "extra 1", "extra 2", "extra 3"]
    assert [p.type for p in sig.params] == [
        "tensor", "tensor", "tensor", "tensor", "int", "float", "ptr", "none"]
    assert [p.name for p in sig.params[:4]] == ["hidden", "proj", None, "sum"]
    assert sig.workspace.dtype == "UINT8" and sig.workspace.shape == (1024,)
    assert sig.of_kind("input")[1].shape == (256, 768)
    # a call's values come out in the signature's order
    values = call_order(["x0", "x1"], "ws", ["y0"], abi["extra_args"])
    assert values == ["x0", "x1", "ws", "y0", 3, 0.125, None, None]
    assert len(values) == len(sig.params)


def test_signature_without_workspace_or_extras():
    abi = abi_of(**{**base(), "workspace_bytes": 0, "extra_args": []})
    sig = Signature.of(abi)
    assert [p.label for p in sig.params] == ["input 0", "input 1", "output 0"]
    assert sig.workspace is None and all(p.name is None for p in sig.params)
    assert call_order(["a", "b"], None, ["c"], []) == ["a", "b", "c"]


def test_signature_of_a_receipt_names_its_boundary():
    abi = abi_of(**base())
    build = {"family": "f", "model": "m", "revision": "r", "options": {}, "trt_module": "t",
             "trt_version": "1"}
    receipt = SelectionReceipt.from_json(
        {"schema_version": 1, "binding_id": "k", "engine_role": "decode",
         "graph_fingerprint": "0" * 64, "build": build, "nodes": ["node:4"],
         "input_tensor_ids": [t["tensor_id"] for t in INPUTS],
         "output_tensor_ids": [t["tensor_id"] for t in OUTPUTS], **base(), "recipe": None,
         "abi": abi, "abi_sha256": abi_sha256(abi)}, "test")
    sig = receipt.signature()
    named = sig.of_kind("input") + sig.of_kind("output")
    assert [p.name for p in named] == ["hidden", "proj", "sum"]
    contract = format_contract(receipt)
    assert contract.splitlines() == [
        "input[0] hidden FP16 device [256,768]", "input[1] proj FP16 device [256,768]",
        "output[0] sum FP16 device [256,768]",
        "workspace 1024 bytes (uint8 device tensor after the inputs)",
        "extra args int 3, float 0.125, ptr null, none"]


# -- the schemas: one binding-id pattern, one ABI object, the code's bounds -----------------------
def _schema(name: str) -> dict:
    return json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())


def _resolved(node, defs: dict):
    """`node` with every local `$ref` replaced by the definition it names (recursively)."""
    if isinstance(node, dict):
        if set(node) == {"$ref"} and node["$ref"].startswith("#/$defs/"):
            return _resolved(defs[node["$ref"][len("#/$defs/"):]], defs)
        return {k: _resolved(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolved(v, defs) for v in node]
    return node


def test_every_schema_is_a_valid_draft_2020_12_schema():
    """Checked here, not each time a process first validates against one."""
    import jsonschema
    paths = sorted(SCHEMA_DIR.glob("*.schema.json"))
    assert len(paths) >= 10
    for path in paths:
        jsonschema.Draft202012Validator.check_schema(json.loads(path.read_text()))
    with pytest.raises(jsonschema.SchemaError):
        jsonschema.Draft202012Validator.check_schema({"type": "integr"})


def test_every_binding_id_in_the_schemas_is_the_codes_pattern():
    pattern = f"^{BINDING_ID_PATTERN}$"
    assert BINDING_ID.pattern == BINDING_ID_PATTERN
    holders = []
    for path in sorted(SCHEMA_DIR.glob("*.schema.json")):
        text = path.read_text()
        defs = json.loads(text).get("$defs", {})
        if "binding_id" in defs:
            holders.append(path.name)
            assert defs["binding_id"]["pattern"] == pattern, path.name
            assert text.count(BINDING_ID_PATTERN) == 1, f"{path.name} repeats the pattern"
    assert set(holders) >= {"selection.schema.json", "selection_set.schema.json",
                            "kernel_slots.schema.json", "binding.schema.json"}
    # a slot layer's id embeds it (a pattern cannot reference another)
    layer_id = _schema("network")["$defs"]["layer"]["properties"]["id"]["pattern"]
    assert layer_id == f"^(node:[0-9]+|slot:{BINDING_ID_PATTERN})$"


def test_the_abi_object_is_one_schema_in_both_files():
    sel, slots = _schema("selection"), _schema("kernel_slots")
    abi_sel = _resolved(sel["$defs"]["abi"], sel["$defs"])
    assert abi_sel == _resolved(slots["$defs"]["abi"], slots["$defs"])
    assert _resolved(sel["properties"]["abi"], sel["$defs"]) == abi_sel
    item = slots["properties"]["slots"]["items"]["properties"]
    assert _resolved(item["abi"], slots["$defs"]) == abi_sel
    for name in ("dtype", "shape", "workspace_bytes", "extra_arg", "binding_id", "sha256"):
        assert sel["$defs"][name] == slots["$defs"][name], name


def test_the_validators_bounds_are_the_schemas():
    defs = _schema("selection")["$defs"]
    assert ABI_LIMITS.dtypes == BOUNDARY_DTYPES == tuple(defs["dtype"]["enum"])
    assert ABI_LIMITS.max_rank == MAX_RANK == defs["shape"]["maxItems"]
    assert ABI_LIMITS.max_workspace_bytes == MAX_WORKSPACE_BYTES == 256 << 20
    recipe = _schema("graph")["$defs"]["recipe"]["properties"]["workspace_bytes"]
    spec_selection = _schema("pipeline_spec")["properties"]["selection"]["oneOf"][2]["properties"]
    for where in (recipe, spec_selection["workspace_bytes"]):
        assert where["maximum"] == MAX_WORKSPACE_BYTES
    assert len(EXTRA_ARG_TYPES) == len(defs["extra_arg"]["oneOf"])


# -- a receipt is the one its spec's selection block asks for ------------------------------------
def _abs_chain_snapshot() -> dict:
    """x -> abs (first) -> abs (second) -> exp, each abs recorded as an instance of one recipe."""
    builder = trt.Builder(LOGGER)
    net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    a = net.add_unary(net.add_input("x", trt.float16, (4, 8)), trt.UnaryOperation.ABS)
    a.name = "first"
    b = net.add_unary(a.get_output(0), trt.UnaryOperation.ABS)
    b.name = "second"
    net.mark_output(net.add_unary(b.get_output(0), trt.UnaryOperation.EXP).get_output(0))
    recipes = [{"recipe_id": "t.abs@1", "instance_id": name, "nodes": [node], "workspace_bytes": 0,
                "extra_args": [], "output_shape_like_input": None}
               for name, node in (("first", "node:0"), ("second", "node:1"))]
    return snapshot_of(net, "decode", {"family": "bert", "model": "m", "revision": "r",
                                       "options": {}}, recipes)


def _asks(selection: dict, receipts: list[dict], snap: dict) -> bool:
    from pipeline.flow.stages import _asked_for
    from pipeline.graph.selection_block import selection_block

    def no_names(names):
        raise AssertionError("these blocks name nodes by id")
    requests = selection_block(selection).requests(snap, "$.selection", no_names)
    return requests is not None and len(requests) == len(receipts) and all(
        _asked_for(r, q) for r, q in zip(receipts, requests))


def test_the_stage_knows_a_receipt_its_spec_did_not_ask_for():
    from pipeline.graph.select import from_recipe, from_recipe_instances
    snap = _abs_chain_snapshot()
    first = select_region(snap, ["node:0"], binding_id="a")
    assert _asks({"nodes": ["node:0"], "binding_id": "a"}, [first], snap)
    assert not _asks({"nodes": ["node:1"], "binding_id": "a"}, [first], snap)
    assert not _asks({"nodes": ["node:0"], "binding_id": "b"}, [first], snap)
    assert not _asks({"nodes": ["node:0"], "binding_id": "a", "workspace_bytes": 16}, [first],
                     snap)
    recipe = from_recipe(snap, "t.abs@1", "second")
    assert _asks({"recipe": "t.abs@1", "instance": "second"}, [recipe], snap)
    assert not _asks({"recipe": "t.abs@1", "instance": "first"}, [recipe], snap)
    assert not _asks({"recipe": "t.abs@1", "instance": "third"}, [recipe], snap)
    both = from_recipe_instances(snap, "t.abs@1", "all")
    assert _asks({"recipe": "t.abs@1", "instances": "all"}, both, snap)
    assert _asks({"recipe": "t.abs@1", "instances": "all", "expect_count": 2}, both, snap)
    assert not _asks({"recipe": "t.abs@1", "instances": "all", "expect_count": 3}, both, snap)
    assert not _asks({"recipe": "t.abs@1", "instances": ["second", "first"]}, both, snap)
