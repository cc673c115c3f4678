"""The typed selection receipt (pipeline/graph/receipt.py) writes the bytes the plain dict did:
a promotion receipt pins the selection file's digest, so the file must not change."""
from __future__ import annotations

import orjson
import pytest

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.graph import select, snapshot
from pipeline.graph.abi import abi_of, abi_sha256
from pipeline.graph.receipt import SelectionReceipt, SelectionSet

EXTRA = [{"type": "int", "value": 7}, {"type": "float", "value": 2.0}, {"type": "float", "value": 0.5},
         {"type": "ptr", "value": None}, {"type": "none"}]
RECIPES = [{"recipe_id": "t.add@1", "instance_id": f"block.{i}", "nodes": [f"node:{2 * i + 1}"],
            "workspace_bytes": 64, "extra_args": EXTRA, "output_shape_like_input": None}
           for i in range(2)]


def _snapshot() -> dict:
    """x -> node:0 -> t1 -> ... -> node:4 -> t5, every add also reading x."""
    def tensor(i, **kw):
        return {"id": f"tensor:{i}", "name": f"t{i}", "dtype": "FP16", "shape": [2, 8],
                "location": "DEVICE", "format": "LINEAR", "is_shape_tensor": False,
                "is_network_input": False, "is_network_output": False, **kw}
    nodes = [{"id": f"node:{i}", "type": "ELEMENTWISE", "name": f"add{i}",
              "inputs": [f"tensor:{i}", "tensor:0"], "outputs": [f"tensor:{i + 1}"]} for i in range(5)]
    tensors = [tensor(0, is_network_input=True), *(tensor(i) for i in (1, 2, 3, 4)),
               tensor(5, is_network_output=True)]
    build = {"family": "bert", "model": "m", "revision": "r", "trt_module": "t", "trt_version": "1",
             "options": {"precision": "fp16", "sequence_length": 16, "scale": 1.5, "flag": True,
                         "none": None}}
    return {"schema_version": snapshot.SCHEMA_VERSION, "engine_role": "decode", "build": build,
            "fingerprint": snapshot.fingerprint(nodes, tensors, "decode", build, RECIPES),
            "nodes": nodes, "tensors": tensors, "recipes": RECIPES}


def _as_the_dict_was(snap: dict, recipe: dict) -> dict:
    """The receipt of one recipe instance as select_region built it before the receipt was typed:
    a plain dict, field by field."""
    n = int(recipe["nodes"][0].split(":")[1])
    ins = [f"tensor:{n}", "tensor:0"]
    desc = [{"tensor_id": t, "name": f"t{t.split(':')[1]}", "dtype": "FP16", "shape": [2, 8]}
            for t in ins + [f"tensor:{n + 1}"]]
    abi = abi_of(desc[:2], desc[2:], 64, EXTRA, None)
    return {"schema_version": 1, "binding_id": recipe["recipe_id"], "engine_role": "decode",
            "graph_fingerprint": snap["fingerprint"], "build": snap["build"],
            "nodes": recipe["nodes"], "input_tensor_ids": ins, "output_tensor_ids": [f"tensor:{n + 1}"],
            "inputs": desc[:2], "outputs": desc[2:], "workspace_bytes": 64, "extra_args": EXTRA,
            "output_shape_like_input": None,
            "recipe": {"recipe_id": recipe["recipe_id"], "instance_id": recipe["instance_id"]},
            "abi": abi, "abi_sha256": abi_sha256(abi)}


def test_a_receipt_writes_the_bytes_the_dict_did(tmp_path):
    snap = _snapshot()
    receipt = select.from_recipe(snap, "t.add@1", "block.0")
    old = _as_the_dict_was(snap, RECIPES[0])
    assert receipt.to_json() == old
    jsonio.write_json(tmp_path / "old.json", old, "selection")
    select.save_receipt(receipt, tmp_path / "new.json")
    data = (tmp_path / "new.json").read_bytes()
    assert data == (tmp_path / "old.json").read_bytes()
    assert b'"value": 2.0' in data  # a float extra arg stays a float
    loaded = select.load_receipt(tmp_path / "old.json")
    assert loaded == receipt
    select.save_receipt(loaded, tmp_path / "again.json")  # read and written again: the same file
    assert (tmp_path / "again.json").read_bytes() == data


def test_a_selection_set_writes_the_bytes_the_dicts_did(tmp_path):
    snap = _snapshot()
    receipts = select.from_recipe_instances(snap, "t.add@1", "all")
    olds = [_as_the_dict_was(snap, r) for r in RECIPES]
    jsonio.write_json(tmp_path / "old.json", {"schema_version": 1, "binding_id": "t.add@1",
                                              "recipe_id": "t.add@1",
                                              "abi_sha256": olds[0]["abi_sha256"],
                                              "instances": olds}, "selection_set")
    select.save_selection(receipts, tmp_path / "new.json")
    data = (tmp_path / "new.json").read_bytes()
    assert data == (tmp_path / "old.json").read_bytes()
    assert select.load_selection(tmp_path / "old.json") == receipts
    doc = orjson.loads(data)
    assert SelectionSet.from_json(doc, "set").to_json() == doc


def test_from_json_names_the_file_of_an_edited_abi():
    doc = _as_the_dict_was(_snapshot(), RECIPES[1])
    assert SelectionReceipt.from_json(doc, "sel.json").to_json() == doc
    with pytest.raises(UserError, match=r"^sel.json: abi/abi_sha256 do not match"):
        SelectionReceipt.from_json({**doc, "workspace_bytes": 0}, "sel.json")
