"""The kernel ABI hash: reproducible, sensitive to every ABI field, blind to ids and names."""
from __future__ import annotations

import copy
import hashlib
import json

import pytest

from pipeline.errors import UserError
from pipeline.families.capture import snapshot_of
from pipeline.graph.abi import abi_of, abi_sha256
from pipeline.graph.select import select_region
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
    assert first["input_tensor_ids"] != second["input_tensor_ids"]
    assert first["abi_sha256"] == second["abi_sha256"]


@pytest.mark.parametrize("kw, match", [
    ({"workspace_bytes": -1}, "expected an integer >= 0"),
    ({"workspace_bytes": True}, "expected an integer >= 0"),
    ({"extra_args": [{"type": "int", "value": 2 ** 31}]}, "not a signed 32-bit integer"),
    ({"extra_args": {"type": "none"}}, "expected a list of extra args"),
])
def test_invalid_abi_fields(kw, match):
    with pytest.raises(UserError, match=match):
        abi_of(**{**base(), **kw})
