"""A selection's region as a FlashInfer-Bench Definition (pipeline/families/definition.py): the
decode-attention recipe of a tiny Qwen3 gives the Definition its ABI states, its reference computes
what the native region computes (the probe's own expected output, on a CPU pipeline of a slot
bundle), a region without a reference is refused in one line with nothing written, and the file
keeps the rules FlashInfer-Bench checks."""
from __future__ import annotations

import ast
import json
import re

import pytest
import torch

from pipeline import cli, dtypes, jsonio
from pipeline.bundle.writer import build_bundle
from pipeline.errors import UserError
from pipeline.families.capture import capture_role
from pipeline.families.definition import SCHEMA, check_definition, definition_of, write_definition
from pipeline.gates.harness import expected_output, random_inputs
from pipeline.gates.probe import compare
from pipeline.graph import select
from pipeline.runtime.pipeline import open_pipeline
from tests.conftest import QWEN3_OPTIONS

RECIPE = "qwen.decode_attention_region@2"
INSTANCE = "decoder.layers.1.decode_attention"
CAPACITY = QWEN3_OPTIONS["max_cache_length"]  # 64; the tiny model: 4 query heads, 2 KV heads, D 16
# FlashInfer-Bench's dtypes (its TensorSpec), stated here without the package
TAIL = 1000.0  # the caches past the length for more than one query position (see the test)
FIB_DTYPES = {"float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2", "float4_e2m1",
              "int64", "int32", "int16", "int8", "bool"}


@pytest.fixture(scope="module")
def decode(tiny_qwen3, tmp_path_factory):
    """The decode role's snapshot, the attention recipe's receipt and its set of every layer, the
    receipt and the set written as files."""
    root = tmp_path_factory.mktemp("definition")
    snap = capture_role(str(tiny_qwen3), None, "decode", QWEN3_OPTIONS).snapshot
    receipt = select.from_recipe(snap, RECIPE, INSTANCE)
    instances = select.from_recipe_instances(snap, RECIPE, "all")
    select.save_selection(receipt, root / "attention.selection.json")
    select.save_selection(instances, root / "attention.set.json")
    snapshot = root / "decode.graph.json"
    jsonio.write_json(snapshot, snap, "graph")
    return {"root": root, "snap": snap, "receipt": receipt, "instances": instances,
            "snapshot": snapshot}


def _run_of(doc: dict):
    """The reference's `run`, executed from the document's text (our own constant)."""
    scope: dict = {}
    exec(compile(doc["reference"], "<reference>", "exec"), scope)  # noqa: S102
    return scope["run"]


def test_the_attention_recipe_gives_its_definition(decode):
    doc = definition_of(decode["receipt"], "attention.selection.json")
    assert doc["name"] == "gqa_linear_decode_h4_kv2_d16_c64_bfloat16" and doc["type"] == "gqa_linear"
    assert {k: (v["type"], v.get("value")) for k, v in doc["axes"].items()} == {
        "batch_size": ("const", 1), "num_qo_heads": ("const", 4), "qo_len": ("var", None),
        "head_dim": ("const", 16), "num_kv_heads": ("const", 2), "kv_capacity": ("const", CAPACITY)}
    assert {k: (v["shape"], v["dtype"]) for k, v in doc["inputs"].items()} == {
        "q": (["batch_size", "num_qo_heads", "qo_len", "head_dim"], "bfloat16"),
        "k_cache": (["batch_size", "num_kv_heads", "kv_capacity", "head_dim"], "bfloat16"),
        "v_cache": (["batch_size", "num_kv_heads", "kv_capacity", "head_dim"], "bfloat16"),
        "kv_length": (["batch_size"], "int32")}
    assert list(doc["inputs"]) == ["q", "k_cache", "v_cache", "kv_length"]  # the ABI's call order
    assert {k: (v["shape"], v["dtype"]) for k, v in doc["outputs"].items()} == {
        "output": (["batch_size", "num_qo_heads", "qo_len", "head_dim"], "bfloat16")}
    # the ABI's dims, axis by axis, in call order
    for spec, tensor in zip([*doc["inputs"].values(), *doc["outputs"].values()],
                            [*decode["receipt"].abi.inputs, *decode["receipt"].abi.outputs]):
        assert [doc["axes"][a].get("value", -1) for a in spec["shape"]] == list(tensor.shape)
    assert doc["constraints"] == ["num_qo_heads % num_kv_heads == 0"]
    # nothing of the receipt is in the reference: no tensor name, no node, no binding id
    receipt = decode["receipt"]
    for name in [t.name for t in (*receipt.inputs, *receipt.outputs)] + [receipt.binding_id,
                                                                         *receipt.nodes]:
        assert name not in doc["reference"]
    # a set of every layer's instance is one Definition, the same
    assert definition_of(decode["instances"], "attention.set.json") == doc


def test_the_reference_computes_what_the_native_region_computes(decode, tiny_qwen3, tmp_path):
    """The reference's `run` against the native region the probe compares a kernel with
    (harness.expected_output on the slot's region of a CPU pipeline), on the probe's seeded random
    inputs, within the BF16 tolerance the gates use: one query position (decode) at lengths from
    1 to the capacity, the caches NaN past the length; and more than one (the ABI's query length
    is dynamic), the caches past the length a large finite value, which moves every output if
    read: the native region's multi-query path (runtime/decoder_ops.py: _prompt_attention) masks
    the scores of keys past the length but still multiplies them, so NaN there would reach its
    output, on either side of the comparison."""
    doc = definition_of(decode["receipt"], "attention.selection.json")
    run = _run_of(doc)
    bundle = build_bundle(str(tiny_qwen3), None, QWEN3_OPTIONS, tmp_path / "slot.bundle",
                          selection=decode["receipt"], build_plans=False)

    def never(*args):
        raise AssertionError("the kernel is not called: only the native region is")
    pipe = open_pipeline(bundle, device="cpu", kernels={decode["receipt"].binding_id: never})
    (region,) = pipe.regions.values()
    assert list(region.abi["inputs"]) == [t.to_json() for t in decode["receipt"].abi.inputs]
    cases = [(1, n) for n in (1, 2, 3, 17, 32, 33, 63, CAPACITY)] + \
            [(q, n) for q in (2, 5) for n in (1, 9, 40, CAPACITY)]
    worst = 0.0
    for i, (q_len, length) in enumerate(cases):
        gen = torch.Generator().manual_seed(1000 + i)
        inputs = random_inputs(region, pipe.family.io, {"dim": q_len, "kv_length": length}, gen,
                               torch.device("cpu"))
        q, k, v, n = inputs
        assert list(q.shape) == [1, 4, q_len, 16] and int(n[0]) == length
        for cache in (k, v):  # never read: a side that reads them is far off, or NaN
            cache[:, :, length:] = float("nan") if q_len == 1 else TAIL
        expected = expected_output(region, inputs)
        got = run(*[x.clone() for x in inputs])
        assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
        c = compare(got, expected, "BF16")  # dtypes.TOLERANCE["BF16"], the gates' per-element rule
        assert torch.isfinite(expected.float()).all(), (q_len, length)
        assert c["non_finite"] == 0 and c["max_error_ratio"] <= 1.0, (q_len, length, c["worst"])
        worst = max(worst, c["max_error_ratio"])
    print(f"reference vs native region: {len(cases)} cases, worst error ratio {worst:.3g} "
          f"(BF16 tolerance {dtypes.TOLERANCE['BF16']})")


def _trtmc(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_region_without_a_reference_is_refused_in_one_line(decode, capsys):
    root, snapshot = decode["root"], decode["snapshot"]
    residual = next(n["id"] for n in decode["snap"]["nodes"]
                    if n["name"] == "decoder.layers.0.attention_residual_add")
    logits = next(r for r in decode["snap"]["recipes"] if r["recipe_id"] == "qwen.decode_logits_copy@1")
    for nodes, like, expected in (
            ([residual], ["--output-shape-like-input", "0"],
             "a selection of nodes that is no recorded recipe instance"),
            (logits["nodes"], [], "recipe qwen.decode_logits_copy@1, whose family states no "
                                  "reference for it")):
        rc, out, err = _trtmc(capsys, "graph", "select", snapshot, "--nodes", *nodes, *like,
                              "--binding-id", "k", "--workspace-bytes", "0",
                              "-o", root / "k.selection.json", "--definition", root / "k.def.json")
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"trtmc: error: {root / 'k.selection.json'}: {expected}; ")
        assert err.strip().endswith("stated only for qwen.decode_attention_region@2")
        assert not (root / "k.selection.json").exists() and not (root / "k.def.json").exists()
    # a receipt made by node ids names no recipe: `graph definition` has no snapshot to look in
    select.save_receipt(select.select_region(decode["snap"], [residual], binding_id="r",
                                             output_shape_like_input=0),
                        root / "r.selection.json")
    rc, out, err = _trtmc(capsys, "graph", "definition", root / "r.selection.json",
                          "-o", root / "r.def.json")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "names no recipe" in err
    assert not (root / "r.def.json").exists()


def test_graph_select_and_graph_definition_write_the_same_definition(decode, capsys):
    root, snapshot = decode["root"], decode["snapshot"]
    rc, out, err = _trtmc(capsys, "graph", "select", snapshot, "--nodes", *decode["receipt"].nodes,
                          "--binding-id", "att", "--workspace-bytes", "0",
                          "--output-shape-like-input", "0", "-o", root / "att.selection.json",
                          "--definition", root / "att.def.json")
    assert rc == 0, err
    assert f"wrote {root / 'att.def.json'}: FlashInfer-Bench Definition " \
           f"gqa_linear_decode_h4_kv2_d16_c64_bfloat16" in out
    for source in ("attention.selection.json", "attention.set.json"):
        rc, out, err = _trtmc(capsys, "graph", "definition", root / source, "-o", root / f"{source}.def")
        assert rc == 0 and out.startswith(f"wrote {root / f'{source}.def'}: "), err
        assert (root / f"{source}.def").read_bytes() == (root / "att.def.json").read_bytes()
    # the output never replaces the selection it reads
    rc, _, err = _trtmc(capsys, "graph", "definition", root / "att.selection.json",
                        "-o", root / "att.selection.json")
    assert rc == 2 and "-o " in err and "which is read here" in err


def test_the_written_file_keeps_flashinfer_benchs_rules(decode, tmp_path):
    out = tmp_path / "def.json"
    written = write_definition(decode["root"] / "attention.selection.json", out)
    doc = json.loads(out.read_text())  # as FlashInfer-Bench reads it: keys in the file's order
    assert doc == written
    assert list(doc) == ["name", "type", "description", "axes", "inputs", "outputs", "reference",
                         "tags", "constraints"]
    assert set(doc) >= {"name", "type", "axes", "inputs", "outputs", "reference"}
    assert re.fullmatch(r"[a-z_]+(_[a-z]+\d+)+_bfloat16", doc["name"])  # words and integers only
    for axis in doc["axes"].values():
        assert axis["type"] in ("const", "var")
        if axis["type"] == "const":
            assert isinstance(axis["value"], int) and axis["value"] > 0
    for spec in [*doc["inputs"].values(), *doc["outputs"].values()]:
        assert spec["dtype"] in FIB_DTYPES and all(a in doc["axes"] for a in spec["shape"])
    module = ast.parse(doc["reference"])
    (run,) = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "run"]
    assert [a.arg for a in run.args.args] == list(doc["inputs"])  # run takes the inputs in order
    assert all(isinstance(t, str) and t.strip() for t in doc["tags"])
    for constraint in doc["constraints"]:
        ast.parse(constraint, mode="eval")
    # what check_definition refuses beyond the schema
    for spoil, message in ((lambda d: d["inputs"]["q"]["shape"].append("seq"), "names axis 'seq'"),
                           (lambda d: d.update(reference="def other(): pass"), "no top-level function run"),
                           (lambda d: d.update(reference="def run(:"), "not Python"),
                           (lambda d: d["outputs"]["output"].update(dtype="uint8"), "uint8")):
        bad = json.loads(out.read_text())
        spoil(bad)
        with pytest.raises(UserError, match=re.escape(message)):
            check_definition(bad, "def.json")


def test_every_dtype_flashinfer_bench_names_is_in_the_schema():
    schema = json.loads((jsonio.SCHEMA_DIR / f"{SCHEMA}.schema.json").read_text())
    enum = set(schema["$defs"]["tensors"]["additionalProperties"]["properties"]["dtype"]["enum"])
    assert enum == FIB_DTYPES
    named = {d.flashinfer_bench for d in dtypes.TABLE if d.flashinfer_bench}
    assert named <= enum and {"float32", "float16", "bfloat16", "int32"} <= named
