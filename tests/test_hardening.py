"""Integrity and hardening: nothing is used unverified, and every hostile input is a
UserError (exit status 2, one stderr line for a command) naming the file and field, with nothing
written. One table per class: bundles, receipts and snapshots, names, JSON, OS errors and numbers,
DSOs, kills and locks."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
import torch
from safetensors.torch import load_file

from pipeline import jsonio
from pipeline.bundle import layout
from pipeline.bundle.reader import Bundle
from pipeline.bundle.writer import build_bundle
from pipeline.errors import UserError
from pipeline.families.capture import capture_role
from pipeline.files import (atomic_write_bytes, hold_lock, sha256_file, staged_dir, staged_file)
from pipeline.flow.spec import DEFAULT_SPEC, load_spec
from pipeline.graph import select, snapshot
from pipeline.graph.abi import abi_of, abi_sha256
from pipeline.graph.receipt import Abi, ExtraArg, SelectionReceipt
from pipeline.graph.patch import apply_selection
from pipeline.kernels import bind, load_manifest
from pipeline.models.checkpoint import Checkpoint
from pipeline.flow.tasks import _remove

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {"precision": "fp32", "sequence_length": 16}
NODE_NAME = "encoder.layers.{}.attention_residual_add"
ROOT_USER = os.geteuid() == 0  # permissions do not stop root


def refused(call, *needles) -> str:
    """`call()` raises a one-line UserError containing every needle; returns the message."""
    with pytest.raises(UserError) as e:
        call()
    message = str(e.value)
    assert len(message.splitlines()) == 1, message
    for needle in needles:
        assert needle in message, message
    return message


def _one_error_line(rc: int, stderr: str, needles) -> str:
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def cli_refused_apart(*argv, needles=()) -> str:
    """`trtmc ARGV`, run as its own process, exits 2 with exactly one stderr line and no traceback."""
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", *map(str, argv)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    return _one_error_line(proc.returncode, proc.stderr, needles)


def cli_refused(*argv, needles=()) -> str:
    """`trtmc ARGV` run in this process (`cli.main`, as the entry point calls it) exits 2 with
    exactly one stderr line and no traceback. What reaches the stderr file descriptor (native
    code's writes) counts as well as sys.stderr and log records."""
    import contextlib
    import io
    import tempfile

    from pipeline import cli, progress
    err = io.StringIO()
    with tempfile.TemporaryFile() as fd_err, contextlib.chdir(ROOT):
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(fd_err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                try:
                    rc = cli.main([str(a) for a in argv])
                except SystemExit as e:  # argparse
                    rc = e.code
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            progress.ask(None)
        fd_err.seek(0)
        stderr = err.getvalue() + fd_err.read().decode(errors="replace")
    return _one_error_line(rc, stderr, needles)


def node_id(snap: dict, layer: int) -> str:
    return next(n["id"] for n in snap["nodes"] if n["name"] == NODE_NAME.format(layer))


@pytest.fixture(scope="module")
def built(tiny_distilbert, tmp_path_factory):
    """A tiny DistilBERT snapshot, its layer-0 residual-add receipt, a native and a slot bundle."""
    root = tmp_path_factory.mktemp("hardening")
    snap = capture_role(str(tiny_distilbert), None, "decode", OPTIONS).snapshot
    receipt = select.select_region(snap, [node_id(snap, 0)], binding_id="res")
    native = build_bundle(str(tiny_distilbert), None, OPTIONS, root / "native.bundle",
                          build_plans=False)
    slot = build_bundle(str(tiny_distilbert), None, OPTIONS, root / "slot.bundle",
                        selection=receipt, build_plans=False)
    return SimpleNamespace(model=tiny_distilbert, snap=snap, receipt=receipt, native=native,
                           slot=slot)


# -- 1. bundles are verified before use ----------------------------------------------------------
def _manifest(bundle: Path) -> dict:
    return orjson.loads((bundle / layout.MANIFEST).read_bytes())


def _write_manifest(bundle: Path, manifest: dict) -> None:
    (bundle / layout.MANIFEST).write_bytes(orjson.dumps(manifest))


def restamp(bundle: Path) -> None:
    """Record every file's current digest, as a forger would."""
    manifest = _manifest(bundle)
    manifest["content_digests"] = {
        p.relative_to(bundle).as_posix(): sha256_file(p) for p in bundle.rglob("*")
        if p.is_file() and not p.is_symlink() and p.name != layout.MANIFEST}
    _write_manifest(bundle, manifest)


def flip(rel):
    def mutate(b: Path):
        data = bytearray((b / rel).read_bytes())
        data[len(data) // 2] ^= 0x01
        (b / rel).write_bytes(bytes(data))
    return mutate


def digests(change):
    def mutate(b: Path):
        manifest = _manifest(b)
        change(manifest["content_digests"], b)
        _write_manifest(b, manifest)
    return mutate


def _symlink_config(b: Path):
    shutil.move(b / layout.CONFIG, b.parent / f"{b.name}-config.json")
    (b / layout.CONFIG).symlink_to(b.parent / f"{b.name}-config.json")


def _symlink_tokenizer(b: Path):
    shutil.move(b / layout.TOKENIZER, b.parent / f"{b.name}-tok")
    (b / layout.TOKENIZER).symlink_to(b.parent / f"{b.name}-tok")


SHA = "0" * 64
BUNDLE_CASES = {
    "weights byte flipped": (flip(layout.WEIGHTS), [layout.WEIGHTS, "modified since"]),
    "network byte flipped": (flip("roles/decode/network.json"), ["network.json", "modified"]),
    "config byte flipped": (flip(layout.CONFIG), [layout.CONFIG, "modified"]),
    "tokenizer byte flipped": (flip("tokenizer/tokenizer.json"), ["tokenizer.json", "modified"]),
    "file not listed": (lambda b: (b / "extra.bin").write_bytes(b"x"),
                        ["extra.bin", "not listed in manifest.json"]),
    "listed file missing": (lambda b: (b / layout.CONFIG).unlink(),
                            [layout.CONFIG, "listed in manifest.json but missing"]),
    "entry removed": (digests(lambda d, b: (d.pop(layout.WEIGHTS), (b / layout.WEIGHTS).unlink())),
                      ["$.content_digests: no entry for weights.safetensors"]),
    "entry removed, file kept": (digests(lambda d, b: d.pop(layout.WEIGHTS)),
                                 [layout.WEIGHTS, "not listed"]),
    "absolute path": (digests(lambda d, b: d.update({"/etc/hostname": SHA})),
                      ["'/etc/hostname'", "not a plain relative path"]),
    "path leaves the bundle": (digests(lambda d, b: d.update({"../x.json": SHA})),
                               ["'../x.json'", "not a plain relative path"]),
    "path not normalized": (digests(lambda d, b: d.update({"./config.json": SHA})),
                            ["'./config.json'", "not a plain relative path"]),
    "symlinked file": (_symlink_config, [layout.CONFIG, "a symlink"]),
    "symlinked folder": (_symlink_tokenizer, [layout.TOKENIZER, "a symlink"]),
    "fifo": (lambda b: os.mkfifo(b / "pipe"), ["pipe", "not a regular file"]),
}


@pytest.mark.parametrize("case", BUNDLE_CASES)
def test_bundle_files_are_verified_before_use(built, tmp_path, case):
    refused(lambda: Bundle.open(tmp_path / "nowhere.bundle"), "no such bundle directory")
    mutate, needles = BUNDLE_CASES[case]
    bundle = shutil.copytree(built.native, tmp_path / "b.bundle")
    Bundle.open(bundle)  # intact
    mutate(bundle)
    refused(lambda: Bundle.open(bundle), *needles)


def test_a_bundle_path_that_is_a_file_is_named_so(tmp_path):
    (tmp_path / "x.bundle").write_text("")
    refused(lambda: Bundle.open(tmp_path / "x.bundle"), "x.bundle: not a directory; a bundle is")


def test_embed_refuses_a_flipped_weight_byte(built, tmp_path):
    """Before: NaNs on stdout and exit 0."""
    bundle = shutil.copytree(built.native, tmp_path / "b.bundle")
    flip(layout.WEIGHTS)(bundle)
    cli_refused("embed", bundle, "--device", "cpu", "--prompt", "hello",
                needles=[f"{bundle / layout.WEIGHTS}: modified since the bundle was built"])


def test_an_open_bundle_uses_the_bytes_it_verified(built, tmp_path):
    """Files replaced after open (a rebuild in the same place, say) are never read: the bundle
    uses the bytes it hashed, and the weights through the file it hashed."""
    bundle = shutil.copytree(built.native, tmp_path / "b.bundle")
    b = Bundle.open(bundle)
    network = orjson.loads((bundle / "roles/decode/network.json").read_bytes())
    config = orjson.loads((bundle / layout.CONFIG).read_bytes())
    weights = load_file(bundle / layout.WEIGHTS)
    ids = Checkpoint(bundle / layout.TOKENIZER, "m", "r", {}).tokenizer().encode("hello")
    for rel in ("roles/decode/network.json", layout.CONFIG, "tokenizer/tokenizer.json",
                "tokenizer/tokenizer_config.json", layout.WEIGHTS):
        (tmp_path / "new").write_bytes(b"{}")
        os.replace(tmp_path / "new", bundle / rel)  # a new file at the same path
    assert b.network("decode") == network and b.config == config
    assert b.tokenizer().encode("hello") == ids
    got = b.weights()
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in got)
    refused(lambda: Bundle.open(bundle), "modified since the bundle was built")


def test_a_role_whose_network_is_the_weights_file_is_refused(built, tmp_path):
    bundle = shutil.copytree(built.native, tmp_path / "b.bundle")
    manifest = _manifest(bundle)
    manifest["roles"][0]["network"] = layout.WEIGHTS
    _write_manifest(bundle, manifest)
    role = manifest["roles"][0]["role"]
    refused(lambda: Bundle.open(bundle).network(role),
            f"{bundle / layout.MANIFEST}: {layout.WEIGHTS} is read as JSON (network)")


def test_a_broken_tokenizer_is_named_by_its_place_in_the_bundle(built, tmp_path):
    bundle = shutil.copytree(built.native, tmp_path / "b.bundle")
    for rel in ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"):
        (bundle / rel).write_bytes(b'{"not": "a tokenizer"}')
    restamp(bundle)
    message = refused(lambda: Bundle.open(bundle).tokenizer(),
                      f"{bundle / layout.TOKENIZER}: no usable tokenizer")
    assert "trtmc-tokenizer-" not in message  # not the private copy's folder
    # its configuration is read as every JSON file is: a key given twice is refused
    shutil.copy(built.native / "tokenizer/tokenizer.json", bundle / "tokenizer/tokenizer.json")
    (bundle / "tokenizer/tokenizer_config.json").write_bytes(b'{"eos_token": "a", "eos_token": "b"}')
    restamp(bundle)
    refused(lambda: Bundle.open(bundle).tokenizer(),
            f"{bundle / layout.TOKENIZER / 'tokenizer_config.json'}: duplicate key \"eos_token\"")


@pytest.mark.parametrize("change, said", [
    (lambda d: d.update(eos_token_id="2"), "$.eos_token_id"),
    (lambda d: d.update(num_hidden_layers=100_000), "$.num_hidden_layers")])
def test_a_bundles_config_is_checked_when_it_opens(built, tmp_path, change, said):
    bundle = shutil.copytree(built.native, tmp_path / "b.bundle")
    _edit_json(bundle, layout.CONFIG, change)
    restamp(bundle)
    refused(lambda: Bundle.open(bundle), f"{bundle / layout.CONFIG}: {said}")


def _slots_doc(b: Path) -> dict:
    return orjson.loads((b / layout.SLOTS).read_bytes())


def _edit_json(b: Path, rel: str, change) -> None:
    doc = orjson.loads((b / rel).read_bytes())
    change(doc)
    (b / rel).write_bytes(orjson.dumps(doc))
    restamp(b)


def _slot_layer(doc: dict) -> dict:
    return next(layer for layer in doc["layers"] if layer["type"] == "SLOT")


def _slot_shape(doc):
    slot = doc["slots"][0]
    slot["abi"]["inputs"][0]["shape"] = [8, 128]
    slot["abi_sha256"] = abi_sha256(slot["abi"])


NETWORK = layout.network_path("decode")
SLOT_CASES = {
    "slot ABI differs from the SLOT layer": (
        lambda b: _edit_json(b, layout.SLOTS, _slot_shape), [NETWORK, "does not match its entry"]),
    "slot abi_sha256 edited": (
        lambda b: _edit_json(b, layout.SLOTS, lambda d: d["slots"][0].update(abi_sha256=SHA)),
        [layout.SLOTS, "$.slots[0].abi_sha256: not the sha256 of its abi"]),
    "SLOT layer workspace edited": (
        lambda b: _edit_json(b, NETWORK, lambda d: _slot_layer(d)["attrs"].update(workspace_bytes=64)),
        [NETWORK, "SLOT layer 'slot:res' does not match"]),
    "SLOT layer of another binding id": (
        lambda b: _edit_json(b, NETWORK, lambda d: _slot_layer(d)["attrs"].update(binding_id="x")),
        [NETWORK, "is not one of the kernel slots of role decode"]),
    "role no longer slot-ready": (
        lambda b: _write_manifest(b, {**_manifest(b), "roles": [
            {**r, "slot_ready": False} for r in _manifest(b)["roles"]]}),
        ["$.roles: the slot-ready roles (none)"]),
}


@pytest.mark.parametrize("case", SLOT_CASES)
def test_kernel_slots_agree_with_the_network(built, tmp_path, case):
    mutate, needles = SLOT_CASES[case]
    bundle = shutil.copytree(built.slot, tmp_path / "s.bundle")
    mutate(bundle)
    refused(lambda: Bundle.open(bundle), *needles)


def test_a_native_network_has_no_slot_layer(built, tmp_path):
    bundle = shutil.copytree(built.native, tmp_path / "n.bundle")
    shutil.copy(built.slot / NETWORK, bundle / NETWORK)
    restamp(bundle)
    refused(lambda: Bundle.open(bundle).network("decode"), "SLOT layer 'slot:res' is not one")


# -- 2. receipts are re-derived, snapshots re-fingerprinted ----------------------------------------
def _with_abi(r: SelectionReceipt) -> SelectionReceipt:
    """`r` with its abi recomputed, so load_receipt's own check passes."""
    abi = r.derived_abi()
    return replace(r, abi=Abi.from_json(abi), abi_sha256=abi_sha256(abi))


def _other_input(r: SelectionReceipt, snap: dict) -> SelectionReceipt:
    """input 1 replaced by the same-shape residual input of layer 1: the same ABI hash."""
    layer1 = select.select_region(snap, [node_id(snap, 1)], binding_id="x")
    return replace(r, input_tensor_ids=(r.input_tensor_ids[0], layer1.input_tensor_ids[1]))


RECEIPT_CASES = {
    "input_tensor_ids swapped": (
        lambda r, s: replace(r, input_tensor_ids=r.input_tensor_ids[::-1]), "input_tensor_ids is"),
    "input_tensor_ids of another layer": (_other_input, "input_tensor_ids is"),
    "output_tensor_ids edited": (
        lambda r, s: replace(r, output_tensor_ids=("tensor:3",)), "output_tensor_ids is"),
    "boundary dtype edited": (
        lambda r, s: _with_abi(replace(r, inputs=(replace(r.inputs[0], dtype="FP16"), r.inputs[1]))),
        "inputs is"),
    "boundary shape edited": (
        lambda r, s: _with_abi(replace(r, inputs=(replace(r.inputs[0], shape=(16, -1)), r.inputs[1]))),
        "inputs is"),
    "workspace edited, not its abi": (lambda r, s: replace(r, workspace_bytes=64), "abi is"),
    "extra args edited, not the abi": (
        lambda r, s: replace(r, extra_args=(ExtraArg("int", 1),)), "abi is"),
    "binding id with a newline": (lambda r, s: replace(r, binding_id="my.add@1\n"),
                                  "binding_id 'my.add@1\\n' must start"),
}


@pytest.mark.parametrize("case", RECEIPT_CASES)
def test_receipts_are_rederived(built, case):
    edit, needle = RECEIPT_CASES[case]
    refused(lambda: select.rederive(edit(built.receipt, built.snap), built.snap, "sel.json"),
            "sel.json: ", needle)
    assert select.rederive(built.receipt, built.snap, "sel.json") == built.receipt


def test_build_refuses_an_edited_receipt_and_writes_nothing(built, tmp_path):
    edited = RECEIPT_CASES["input_tensor_ids swapped"][0](built.receipt, built.snap)
    refused(lambda: build_bundle(str(built.model), None, OPTIONS, tmp_path / "x.bundle",
                                 selection=edited, build_plans=False), "input_tensor_ids")
    sel = tmp_path / "sel.json"
    sel.write_bytes(orjson.dumps(RECEIPT_CASES["input_tensor_ids of another layer"][0](
        built.receipt, built.snap).to_json()))
    cli_refused("build", built.model, "--precision", "fp32", "--sequence-length", "16",
                "--graph-patch", sel, "-o", tmp_path / "x.bundle", needles=["input_tensor_ids"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sel.json"]


def _snapshot_edit(change, restamp_fingerprint: bool):
    def edit(snap):
        snap = orjson.loads(orjson.dumps(snap))
        change(snap)
        if restamp_fingerprint:
            snap["fingerprint"] = snapshot.fingerprint(snap["nodes"], snap["tensors"],
                                                       snap["engine_role"], snap["build"],
                                                       snap["recipes"])
        return snap
    return edit


SNAPSHOT_CASES = {
    "node renamed": (_snapshot_edit(lambda s: s["nodes"][3].update(name="x"), False),
                     "$.fingerprint: "),
    "engine role edited": (_snapshot_edit(lambda s: s.update(engine_role="prefill"), False),
                           "the file was edited"),
    "dangling tensor": (_snapshot_edit(lambda s: s["nodes"][3]["inputs"].append("tensor:99999"),
                                       True), "tensor:99999 is not in $.tensors"),
    "node id repeated": (_snapshot_edit(lambda s: s["nodes"][4].update(id=s["nodes"][3]["id"]),
                                        True), "$.nodes[4].id: node:3 repeats $.nodes[3]"),
    "tensor produced twice": (
        _snapshot_edit(lambda s: s["nodes"][4].update(outputs=s["nodes"][3]["outputs"]), True),
        "also produced by node:3"),
}


@pytest.mark.parametrize("case", SNAPSHOT_CASES)
def test_snapshots_are_checked_on_load(built, tmp_path, case):
    edit, needle = SNAPSHOT_CASES[case]
    path = tmp_path / "graph.json"
    path.write_bytes(orjson.dumps(edit(built.snap)))
    refused(lambda: snapshot.load(path), str(path), needle)
    cli_refused("graph", "list", path, needles=[needle])


def test_a_patch_says_missing_producer_not_cycle(built):
    """A boundary input produced inside the region: after patching, nothing produces it."""
    export = Bundle.open(built.native).network("decode")
    inner = replace(built.receipt, nodes=(node_id(built.snap, 0),),
                    input_tensor_ids=(built.receipt.output_tensor_ids[0],),
                    output_tensor_ids=(export["outputs"][0],))
    message = refused(lambda: apply_selection(export, inner), "selection res: the patched decode",
                      "missing producer")
    assert "cycle" not in message


# -- 3. names never become code ----------------------------------------------------------------
def _receipt_file(tmp_path, **changes) -> Path:
    path = tmp_path / "sel.json"
    path.write_bytes(orjson.dumps({**select.select_region(
        snapshot_stub(), ["node:0"], binding_id="k").to_json(), **changes}))
    return path


def snapshot_stub() -> dict:
    """x -> node:0 (ELEMENTWISE) -> y -> node:1 -> z: the smallest selectable graph."""
    def tensor(i, **kw):
        return {"id": f"tensor:{i}", "name": f"t{i}", "dtype": "FP32", "shape": [4], "location":
                "DEVICE", "format": "LINEAR", "is_shape_tensor": False, "is_network_input": False,
                "is_network_output": False, **kw}
    nodes = [{"id": "node:0", "type": "ELEMENTWISE", "name": "a", "inputs": ["tensor:0", "tensor:0"],
              "outputs": ["tensor:1"]},
             {"id": "node:1", "type": "UNARY", "name": "b", "inputs": ["tensor:1"],
              "outputs": ["tensor:2"]}]
    tensors = [tensor(0, is_network_input=True), tensor(1), tensor(2, is_network_output=True)]
    build = {"family": "bert", "model": "m", "revision": "r", "options": {}, "trt_module": "t",
             "trt_version": "1"}
    return {"schema_version": snapshot.SCHEMA_VERSION, "engine_role": "decode", "build": build,
            "fingerprint": snapshot.fingerprint(nodes, tensors, "decode", build, []), "nodes": nodes,
            "tensors": tensors, "recipes": []}


@pytest.mark.parametrize("name", ["my.add@1\n", "a\rb", "a b", "", "-x", "ok\u2028"])
def test_binding_ids_match_in_full(name):
    refused(lambda: select.select_region(snapshot_stub(), ["node:0"], binding_id=name),
            "binding_id", "must start with a letter or digit")


NAME_FILE_CASES = {
    "receipt binding id": (lambda p: _receipt_file(p, binding_id="k\n"), select.load_receipt,
                           "$.binding_id: 'k\\n' does not match"),
    "manifest function": (lambda p: _binding_file(p, function="run\n"), load_manifest,
                          "$.bindings[0].function: 'run\\n' does not match"),
    "manifest id": (lambda p: _binding_file(p, id="res\n"), load_manifest,
                    "$.bindings[0].id: 'res\\n' does not match"),
    "spec package (finding a dotted one imports its parent)": (
        lambda p: _spec(p, lambda s: s.update(model={"package": "antigravity.x", "path": "m"})),
        load_spec, "$.model"),
}


def _binding_file(folder: Path, **changes) -> Path:
    (folder / "k.so").write_bytes(b"")
    path = folder / "m.json"
    path.write_bytes(orjson.dumps({"schema_version": 1, "bindings": [
        {"id": "res", "abi_sha256": SHA, "library": "k.so", "function": "run", **changes}]}))
    return path


@pytest.mark.parametrize("case", NAME_FILE_CASES)
def test_names_in_files_match_in_full(tmp_path, case):
    write, load, needle = NAME_FILE_CASES[case]
    path = write(tmp_path)
    refused(lambda: load(path), str(path), needle)


def test_a_layer_id_never_becomes_code(built, tmp_path):
    """A network export whose layer id holds a line break: refused on read; and were it given
    in memory, the generated program still holds it only inside one comment."""
    from pipeline.runtime.program import Program
    evil = "slot:x\r      raise SystemExit(3)  #"
    bundle = shutil.copytree(built.native, tmp_path / "n.bundle")
    _edit_json(bundle, NETWORK, lambda d: d["layers"][-1].update(id=evil))
    refused(lambda: Bundle.open(bundle).network("decode"), "$.layers[", "does not match")
    native = Bundle.open(built.native)
    export = orjson.loads(orjson.dumps(native.network("decode")))
    export["layers"][-1]["id"] = evil
    program = Program.lower(export, native.weights())
    assert "\r" not in program.source and "SystemExit(3)  #" in program.source
    assert program(**{s.name: torch.ones(16, dtype=torch.int32) for s in program.input_specs})


# -- 4. strict JSON --------------------------------------------------------------------------------
def _fifo(p: Path) -> Path:
    os.mkfifo(p)
    return p


JSON_CASES = {
    "duplicate key": (b'{"a": 1, "a": 2}', 'duplicate key "a"'),
    "duplicate nested key": (b'{"x":{"k":1,"k":1}}', 'duplicate key "k"'),
    "duplicate behind a space": (b'{"k" : 1, "k":2}', 'duplicate key "k"'),
    "duplicate beside an escaped quote": (b'{"s":"a\\":b","k":1,"k":2}', 'duplicate key "k"'),
    "duplicate by escape": (b'{"\\u006b":1,"k":2}', 'duplicate key "k"'),
    "too deep": (b"[" * 300 + b"]" * 300, "nested more than 255 levels deep"),
    "truncated": (b'{"a": [1, 2', "not valid JSON"),
    "NaN": (b'{"a": NaN}', "not valid JSON"),
    "infinite number": (b'{"a": 1e400}', "not valid JSON"),
}


@pytest.mark.parametrize("case", JSON_CASES)
def test_strict_json(tmp_path, case):
    data, needle = JSON_CASES[case]
    path = tmp_path / "x.json"
    path.write_bytes(data)
    refused(lambda: jsonio.read_json(path, None), str(path), needle)


def test_quote_colon_inside_strings_is_not_a_duplicate(tmp_path):
    path = tmp_path / "x.json"
    path.write_bytes(b'{"s": "\\" :", "t": "\\":", "k": 1}')
    assert jsonio.read_json(path, None) == {"s": '" :', "t": '":', "k": 1}


def test_only_regular_files_are_read(tmp_path, monkeypatch):
    refused(lambda: jsonio.read_json(_fifo(tmp_path / "f.json"), None), "not a regular file")
    refused(lambda: jsonio.read_json(tmp_path, None), f"{tmp_path}: is a directory")
    path = tmp_path / "big.json"
    path.write_bytes(b"[" + b"1," * 100 + b"1]")
    monkeypatch.setattr(jsonio, "MAX_JSON_BYTES", 64)
    refused(lambda: jsonio.read_json(path, None), "larger than", "MAX_JSON_BYTES")


def test_a_schema_error_quotes_an_excerpt(tmp_path):
    """Before: a wrong top-level type echoed the whole document."""
    path = tmp_path / "m.json"
    path.write_bytes(orjson.dumps(list(range(200_000))))
    message = refused(lambda: load_manifest(path), f"{path}: $: [0, 1, 2", "is not of type")
    assert len(message) < 1000


def test_an_integer_field_takes_no_float(tmp_path):
    refused(lambda: load_spec(_spec(tmp_path, lambda s: s["gates"].update(cpu_threads=2.0))),
            "$.gates.cpu_threads: 2.0 is not of type 'integer'")


def _header_length(n: int):
    def mutate(d: Path):
        f = d / "model.safetensors"
        f.write_bytes(n.to_bytes(8, "little") + f.read_bytes()[8:])
    return mutate


def _garbled_header(d: Path):
    f = d / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    f.write_bytes(data[:8] + b"x" * n + data[8 + n:])


def _index(weight_map) -> callable:
    return lambda d: (d / "model.safetensors.index.json").write_bytes(
        orjson.dumps({"weight_map": weight_map}))


CHECKPOINT_CASES = {
    "config duplicate key": (lambda d: (d / "config.json").write_bytes(
        b'{"model_type": "bert", ' + (d / "config.json").read_bytes()[1:]),
        ['config.json: duplicate key "model_type"']),
    "config not an object": (lambda d: (d / "config.json").write_bytes(b"[]"),
                             ["config.json: $: [] is not of type 'object'"]),
    "config dtype not a string": (lambda d: (d / "config.json").write_bytes(
        orjson.dumps({**orjson.loads((d / "config.json").read_bytes()), "torch_dtype": 3})),
        ["config.json: $.torch_dtype: 3 is not of type 'string', 'null'"]),
    "config size missing": (lambda d: (d / "config.json").write_bytes(orjson.dumps(
        {k: v for k, v in orjson.loads((d / "config.json").read_bytes()).items() if k != "dim"})),
        ["config.json: $.dim: missing; expected a positive integer (the distilbert family needs it)"]),
    "config size a string": (lambda d: (d / "config.json").write_bytes(orjson.dumps(
        {**orjson.loads((d / "config.json").read_bytes()), "n_heads": "two"})),
        ["config.json: $.n_heads: 'two'; expected a positive integer"]),
    "header length past the file": (_header_length(1 << 62),
                                    ["model.safetensors: not a safetensors file", "header length"]),
    "header not JSON": (_garbled_header, ["model.safetensors: not valid JSON"]),
    "file truncated": (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-4096]), ["data_offsets", "not a range within"]),
    "weights a FIFO": (lambda d: ((d / "model.safetensors").unlink(), _fifo(d / "model.safetensors")),
                       ["model.safetensors: not a regular file"]),
    "index leaves the folder": (_index({"x": "../../etc/hostname"}),
                                ["index.json: $.weight_map.x: '../../etc/hostname' does not match"]),
    "index not a map": (_index(3), ["index.json: $.weight_map: 3 is not of type 'object'"]),
}


def test_a_checkpoint_without_weights_names_its_dtype_it_cannot_build(tmp_path):
    from pipeline.models.synth import synthesize
    from tests.conftest import TINY_BERT_CONFIG
    model = synthesize({**TINY_BERT_CONFIG, "torch_dtype": "float64"}, tmp_path / "m", weights=False)
    refused(lambda: capture_role(str(model), None, "decode", OPTIONS),
            f"{model / 'config.json'}: $.torch_dtype: 'float64'; a checkpoint without weights needs "
            f"one of float32, float16, bfloat16")


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_checkpoint_files_are_read_strictly(built, tmp_path, case):
    """Before: a traceback (or a MemoryError, or a read outside the folder) for most, a hang on
    a FIFO, and a duplicate key silently kept its last value."""
    mutate, needles = CHECKPOINT_CASES[case]
    model = shutil.copytree(built.model, tmp_path / "model")
    mutate(model)
    refused(lambda: capture_role(str(model), None, "decode", OPTIONS), str(model), *needles)


def test_an_output_reached_through_a_link_is_still_refused(tmp_path):
    """A hub snapshot's files are links to blobs outside the snapshot folder; a rename replaces
    the link itself, so the link is what is compared."""
    from pipeline.files import refuse_overwriting
    snapshot = tmp_path / "models--o--n" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (tmp_path / "blob").write_text("{}")
    (snapshot / "config.json").symlink_to(tmp_path / "blob")
    refused(lambda: refuse_overwriting(snapshot / "config.json", [snapshot], "--snapshot"),
            "--snapshot", "config.json: lies inside", "which is read here")
    refuse_overwriting(tmp_path / "elsewhere.json", [snapshot], "--snapshot")  # allowed
    # /dev/stdout is a link to /proc/self/fd/1; a rename there would replace that link. (A path
    # under /proc: had the check failed, nothing can be created there anyway.)
    refused(lambda: atomic_write_bytes(Path("/proc/self/fd/1"), b"x"),
            "/proc/self/fd/1: under /dev, /proc, /sys (devices and process files are never replaced)")


# -- 5. OS errors and numbers ----------------------------------------------------------------------
def _loop(p: Path) -> Path:
    (p.parent / "loop_a").symlink_to(p.parent / "loop_b")
    (p.parent / "loop_b").symlink_to(p.parent / "loop_a")
    return p.parent / "loop_a"


def _unreadable(p: Path) -> Path:
    p.write_bytes(b"{}")
    p.chmod(0)
    return p


def _under_a_file(p: Path) -> Path:
    p.write_bytes(b"{}")
    return p / "x.json"


READ_CASES = {
    "ENOENT": (lambda p: p, "No such file or directory"),
    "ENOTDIR": (_under_a_file, "Not a directory"),
    "ELOOP": (_loop, "Too many levels of symbolic links"),
    "ENAMETOOLONG": (lambda p: p.parent / ("x" * 300), "File name too long"),
    "EACCES": (_unreadable, "Permission denied"),
}
READERS = {"read_json": lambda p: jsonio.read_json(p, None), "sha256_file": sha256_file,
           "load_manifest": load_manifest, "load_receipt": select.load_receipt,
           "snapshot.load": snapshot.load, "load_spec": load_spec}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", READ_CASES)
def test_read_errors_are_one_line(tmp_path, case, reader):
    if case == "EACCES" and ROOT_USER:
        pytest.skip("root reads any file")
    make, reason = READ_CASES[case]
    path = make(tmp_path / "f.json")
    refused(lambda: READERS[reader](path), reason)


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _read_only(p: Path) -> Path:
    p.mkdir()
    p.chmod(0o500)
    return p / "x.json"


WRITE_CASES = {
    "target is a folder": (lambda p: (p.mkdir(), p)[1], "is a directory, expected the path of a file"),
    "parent is a file": (lambda p: (p.write_bytes(b""), p / "x.json")[1], "t: File exists"),
    "name too long": (lambda p: p.parent / ("x" * 300), "File name too long"),
    "read-only folder": (_read_only, "Permission denied"),
}


@pytest.mark.parametrize("case", WRITE_CASES)
def test_write_errors_are_one_line_and_write_nothing(tmp_path, case):
    if case == "read-only folder" and ROOT_USER:
        pytest.skip("root writes anywhere")
    make, needle = WRITE_CASES[case]
    target = make(tmp_path / "t")
    before = sorted(tmp_path.rglob("*"))
    refused(lambda: jsonio.write_json(target, {"a": 1}, None), needle)
    assert sorted(tmp_path.rglob("*")) == before


def test_a_full_disk_names_the_target_and_leaves_no_stage(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", _enospc)
    refused(lambda: atomic_write_bytes(tmp_path / "x.json", b"{}"),
            f"{tmp_path / 'x.json'}: No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_target_must_be_a_folder(tmp_path):
    (tmp_path / "x.bundle").write_bytes(b"")
    with pytest.raises(UserError, match="exists and is not a folder"):
        with staged_dir(tmp_path / "x.bundle", replace=True):
            pass


def test_cli_output_naming_a_folder_or_a_foreign_folder(built, tmp_path):
    graph = tmp_path / "graph.json"
    snapshot.save(built.snap, graph)
    (tmp_path / "out").mkdir()
    cli_refused("graph", "select", graph, "--nodes", node_id(built.snap, 0), "--binding-id", "k",
                "--workspace-bytes", "0", "-o", tmp_path / "out", needles=["is a directory"])
    (tmp_path / "mine.bundle").mkdir()
    (tmp_path / "mine.bundle" / "notes.txt").write_text("keep me")
    cli_refused("build", built.model, "-o", tmp_path / "mine.bundle",
                needles=["-o", "not a bundle", "refusing to replace it"])
    (tmp_path / "file.bundle").write_bytes(b"")
    cli_refused("build", built.model, "-o", tmp_path / "file.bundle",
                needles=["exists and is not a folder"])
    assert (tmp_path / "mine.bundle" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []
    inner = shutil.copytree(built.native, tmp_path / "b.bundle") / "roles" / "x.bundle"
    cli_refused("build", built.model, "-o", inner, needles=["-o", "lies inside the bundle",
                                                              str(tmp_path / "b.bundle")])
    assert not inner.exists()


def _spec(tmp_path, change) -> Path:
    raw = orjson.loads(DEFAULT_SPEC.read_bytes())
    raw["kernel"] = {"source": str(ROOT / "examples" / "byok" / "residual_add.cu")}
    change(raw)
    path = tmp_path / "s.json"
    path.write_bytes(orjson.dumps(raw))
    return path


def _gate(**kw):
    return lambda s: s["gates"].update(kw)


def _perf(**kw):
    return lambda s: s["gates"].setdefault("perf", {}).update(kw)


NUMBER_CASES = {
    "cpu_threads 10^6 (SIGSEGV before)": (_gate(cpu_threads=10 ** 6), "$.gates.cpu_threads"),
    "cpu_threads 0": (_gate(cpu_threads=0), "$.gates.cpu_threads"),
    "max_new_tokens 10^9": (_gate(max_new_tokens=10 ** 9), "$.gates.max_new_tokens"),
    "perf seed 2^32": (_perf(seed=2 ** 32), "$.gates.perf.seed"),
    "probe seed -1": (_gate(correctness={"probe_seed": -1}), "$.gates.correctness.probe_seed"),
    "trials 10^7": (_perf(trials=10 ** 7), "$.gates.perf.trials"),
    "warmup 10^6": (_perf(warmup=10 ** 6), "$.gates.perf.warmup"),
    "resamples 10^9": (_perf(resamples=10 ** 9), "$.gates.perf.resamples"),
    "sequence_length 10^9": (lambda s: s.setdefault("build", {}).update(sequence_length=10 ** 9),
                             "$.build.sequence_length"),
    "workspace 2^41": (lambda s: s.update(selection={"nodes": ["node:1"], "binding_id": "k",
                                                     "workspace_bytes": 2 ** 41}),
                       "$.selection"),
    "synth seed 2^32": (lambda s: s.update(model={"synth": {"config": "x", "seed": 2 ** 32}}),
                        "$.model"),
}


@pytest.mark.parametrize("case", NUMBER_CASES)
def test_spec_numbers_are_bounded(tmp_path, case):
    change, where = NUMBER_CASES[case]
    path = _spec(tmp_path, change)
    refused(lambda: load_spec(path), f"{path}: {where}")


def test_workspace_bytes_are_bounded(tmp_path):
    refused(lambda: select.select_region(snapshot_stub(), ["node:0"], binding_id="k",
                                         workspace_bytes=2 ** 41), "is more than the limit of 268435456")
    path = _receipt_file(tmp_path, workspace_bytes=2 ** 41)
    refused(lambda: select.load_receipt(path), "$.workspace_bytes: 2199023255552 is greater")


# -- 6. DSOs are checked before dlopen; kernel errors are one line --------------------------------
@pytest.fixture(scope="module")
def dso(kernel_builds) -> Path:
    return kernel_builds("examples/byok/residual_add.cu")


SPEC = {"dtype": "FP32", "shape": [2, 8]}
ABI = abi_of([SPEC, SPEC], [SPEC], 0, [], None)
SLOT = {"binding_id": "res", "abi_sha256": abi_sha256(ABI), "engine_role": "decode", "abi": ABI}


def _folder_with(tmp_path: Path, data: bytes) -> Path:
    (tmp_path / "k.so").write_bytes(data)
    path = tmp_path / "m.json"
    path.write_bytes(orjson.dumps({"schema_version": 1, "bindings": [
        {"id": "res", "abi_sha256": SLOT["abi_sha256"], "library": "k.so", "function": "run"}]}))
    return path


def _patched(offset: int, value: bytes):
    return lambda d: d[:offset] + value + d[offset + len(value):]


DSO_CASES = {
    "truncated (SIGBUS before)": (lambda d: d[: len(d) // 2], "truncated"),
    "no ELF magic": (lambda d: b"MZ" + d[2:], "not an ELF file"),
    "empty": (lambda d: b"", "not an ELF file"),
    "32-bit": (_patched(4, b"\x01"), "not a 64-bit little-endian ELF file"),
    "big-endian": (_patched(5, b"\x02"), "not a 64-bit little-endian ELF file"),
    "executable, not shared": (_patched(16, b"\x02\x00"), "ELF type 2, not a shared object"),
    "other machine": (_patched(18, (183 if os.uname().machine == "x86_64" else 62).to_bytes(2, "little")),
                      "ELF machine"),
    "section headers past the end": (_patched(60, b"\xff\xff"), "truncated: section headers"),
    "program headers past the end": (_patched(56, b"\xff\xff"), "program headers end past"),
}


@pytest.mark.parametrize("case", DSO_CASES)
@pytest.mark.slow
def test_dsos_are_checked_before_loading(dso, tmp_path, case):
    mutate, needle = DSO_CASES[case]
    manifest = _folder_with(tmp_path, mutate(dso.read_bytes()))
    code = ("import sys\nfrom pipeline.kernels import bind\nfrom pipeline.errors import UserError\n"
            f"try:\n    bind(sys.argv[1], [{SLOT!r}])\nexcept UserError as e:\n"
            "    print(e, file=sys.stderr)\n    sys.exit(2)\n")
    # a child process: were the check missing, the SIGBUS would kill it, not the test run
    proc = subprocess.run([sys.executable, "-c", code, str(manifest)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert "$.bindings[0].library:" in lines[0] and "k.so failed to load: " in lines[0]
    assert needle in lines[0], lines[0]


KERNEL_CALL_CASES = {
    "too few arguments": lambda a: (a, a),
    "mismatched shapes": lambda a: (a, torch.zeros(3, 8), torch.zeros(2, 8)),
    "wrong dtype": lambda a: (a, a.double(), torch.zeros(2, 8)),
}


@pytest.mark.parametrize("case", KERNEL_CALL_CASES)
@pytest.mark.slow
def test_a_kernel_that_raises_is_one_line(dso, tmp_path, case):
    kernel = bind(_folder_with(tmp_path, dso.read_bytes()), [SLOT])["res"]
    kernel(torch.ones(2, 8), torch.ones(2, 8), torch.zeros(2, 8))
    refused(lambda: kernel(*KERNEL_CALL_CASES[case](torch.ones(2, 8))),
            "kernel 'res' (k.so:run) raised: ")


# -- 7. kills and concurrency ------------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _stage(folder: Path, name: str, pid: int, as_dir: bool) -> Path:
    stage = folder / f".{name}.{pid}.abc123.tmp"
    stage.mkdir() if as_dir else stage.write_bytes(b"half")
    return stage


def _write_dir(folder: Path) -> None:
    with staged_dir(folder / "x.bundle", replace=True):
        pass


STAGE_CASES = {
    "file": (lambda t: atomic_write_bytes(t / "x.json", b"{}"), "x.json", False),
    "folder": (_write_dir, "x.bundle", True),
    "doit clean": (lambda t: _remove([str(t / "x.json")], str(t)), "x.json", False),
}


@pytest.mark.parametrize("case", STAGE_CASES)
def test_a_killed_writes_stage_is_removed_by_the_next_write(tmp_path, case):
    write, name, as_dir = STAGE_CASES[case]
    dead = _stage(tmp_path, name, _dead_pid(), as_dir)
    live = _stage(tmp_path, name, os.getppid(), as_dir)     # a writer still running
    other = _stage(tmp_path, f"{name}.b", _dead_pid(), as_dir)  # another target's stage
    write(tmp_path)
    assert not dead.exists() and live.exists() and other.exists()


def test_staged_file_refuses_a_folder_before_writing(tmp_path):
    (tmp_path / "k.so").mkdir()
    with pytest.raises(UserError, match="is a directory"):
        with staged_file(tmp_path / "k.so"):
            raise AssertionError("the block must not run")


def test_a_second_run_on_the_same_output_is_refused(tmp_path):
    lock = tmp_path / "out" / ".lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pipeline.files import hold_lock\n"
         "hold_lock(sys.argv[1], 'x')\nprint('held', flush=True)\ntime.sleep(60)", str(lock)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused(lambda: hold_lock(lock, "another doit run on this output folder"),
                f"{tmp_path / 'out'}: another doit run on this output folder (pid {holder.pid})")
    finally:
        holder.send_signal(signal.SIGKILL)  # a kill releases the lock
        holder.wait()
        holder.stdout.close()
    proc = subprocess.run([sys.executable, "-c", "import sys\nfrom pipeline.files import hold_lock"
                           "\nhold_lock(sys.argv[1], 'x')", str(lock)], cwd=ROOT, timeout=60)
    assert proc.returncode == 0


@pytest.mark.parametrize("kind, problem", [("missing", "not found"), ("folder", "is a directory"),
                                           ("fifo", "not a regular file")])
def test_an_input_file_of_the_wrong_kind_is_refused_in_one_wording(tmp_path, kind, problem):
    """A kernel source, a manifest's library and a config file: each refusal says what the file is
    for, its path and files.file_problem's reason."""
    from pipeline.kernels.build import build_kernel
    from pipeline.models.synth import synthesize
    target = tmp_path / "x"
    {"missing": lambda: None, "folder": target.mkdir, "fifo": lambda: os.mkfifo(target)}[kind]()
    manifest = tmp_path / "m.json"
    manifest.write_text(orjson.dumps({"schema_version": 1, "bindings": [
        {"id": "s@1", "abi_sha256": "0" * 64, "library": "x", "function": "run"}]}).decode())
    refused(lambda: build_kernel(target, tmp_path / "k.so"), f"{target}: kernel source {problem}")
    refused(lambda: load_manifest(manifest), f"library file {target} {problem}")
    config = target / "config.json" if kind == "folder" else target  # a folder: its config.json
    refused(lambda: synthesize(target, tmp_path / "o"),
            f"{config}: config file {'not found' if kind == 'folder' else problem}")


# -- the CLI and doit against bad input ---------------------------------------------------------
def _minilm_model_dir() -> Path:
    return load_spec(DEFAULT_SPEC).model_dir


SPEC_FIELD_CASES = {
    "a NUL in a path (ValueError before)": (
        lambda s: s["kernel"].update(source="a\0b"),
        "$.kernel.source: holds a NUL character (\\u0000); trtmc reads no JSON string"),
    "a bad function, in the spec (in a temp file's name at bind before)": (
        lambda s: s["kernel"].update(function="bad-name"),
        "$.kernel.function: 'bad-name' does not match"),
    "a field inside a oneOf block (the whole block before)": (
        lambda s: s["selection"].update(binding_id=5), "$.selection.binding_id: 5 is not of type"),
    "output: the spec's folder": (lambda s: s.update(output="."), "$.output: ", "holds the spec"),
    "output: inside the model folder (its identity changed on every run)": (
        lambda s: s.update(output=str(_minilm_model_dir() / "out")), "$.output: ",
        "lies inside the model folder"),
}


@pytest.mark.parametrize("case", SPEC_FIELD_CASES)
def test_spec_fields_are_named_when_refused(tmp_path, case):
    change, *needles = SPEC_FIELD_CASES[case]
    path = _spec(tmp_path, change)
    refused(lambda: load_spec(path), f"{path}: ", *needles)


def test_a_doit_run_has_a_spec_and_each_spec_its_own_output(tmp_path):
    from pipeline.flow.spec import load_specs
    refused(lambda: load_specs(""), "spec=: no spec file given")
    refused(lambda: load_specs(" , "), "no spec file given")
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, name in ((a, "one"), (b, "two")):
        folder.mkdir()
        (folder / "s.json").write_bytes(_spec(folder, lambda s, n=name: s.update(
            name=n, output=str(tmp_path / "shared"))).read_bytes())
    refused(lambda: load_specs(f"{a / 's.json'},{b / 's.json'}"), "overlaps the output folder")


@pytest.mark.parametrize("script, needle", [
    ("echo no interpreter line\n", "cannot be run: Exec format error"),
    ("#!/bin/sh\nmkdir \"$1\"\n", "wrote no DSO"),
    ("#!/bin/sh\nkill -9 $$\n", "was killed by signal 9"),
])
def test_an_exporter_that_fails_is_one_line_and_leaves_no_stage(tmp_path, script, needle):
    from pipeline.flow.stages import export_dso
    exporter = tmp_path / "export.sh"
    exporter.write_text(script)
    exporter.chmod(0o755)
    path = _spec(tmp_path, lambda s: s.update(
        output=str(tmp_path / "out"), kernel={"exporter": [str(exporter), "{output}"],
                                              "sources": [str(exporter)]}))
    spec = load_spec(path)
    refused(lambda: export_dso(spec), "$.kernel.exporter: ", needle)
    assert list(spec.paths.dso.parent.iterdir()) == []


def test_quoted_includes_no_file_can_have_are_left_to_the_compiler(tmp_path):
    from pipeline.kernels.build import local_includes
    (tmp_path / "h.h").write_text("")
    (tmp_path / "l1.h").symlink_to("l2.h")
    (tmp_path / "l2.h").symlink_to("l1.h")
    source = tmp_path / "k.cc"
    source.write_bytes(b'#include "' + b"a" * 300 + b'.h"\n#include "l1.h"\n#include "a\0b.h"\n'
                       b'#include "h.h"\n')
    assert local_includes([source]) == [tmp_path / "h.h"]


def _snapshot_file(tmp_path, change) -> Path:
    snap = snapshot_stub()
    change(snap)
    snap["fingerprint"] = snapshot.fingerprint(snap["nodes"], snap["tensors"], "decode",
                                               snap["build"], snap["recipes"])
    path = tmp_path / "g.json"
    path.write_bytes(orjson.dumps(snap))
    return path


@pytest.mark.parametrize("change, needle", [
    (lambda s: s["nodes"][0].update(name="evil\nsecond line"), "$.nodes[0].name: 'evil\\nsecond line'"),
    (lambda s: s["tensors"][1].update(name="\x1b[31mred"), "$.tensors[1].name: '\\x1b[31mred'"),
    (lambda s: s["nodes"][1].update(inputs=["tensor:2"]), "$.nodes: node:1 (UNARY 'b'): input "
                                                          "tensor:2 has a cycle"),
    (lambda s: s["nodes"][0].update(inputs=["tensor:0", "tensor:2"]), "$.nodes: node:0 "
                                                                      "(ELEMENTWISE 'a'): input "
                                                                      "tensor:2 has a cycle"),
    (lambda s: s["nodes"].reverse(), None),  # out of order but no cycle: loads
])
def test_a_snapshot_with_a_cycle_or_an_unprintable_name_is_refused(tmp_path, change, needle):
    path = _snapshot_file(tmp_path, change)
    if needle is None:
        assert len(snapshot.load(path)["nodes"]) == 2
    else:
        refused(lambda: snapshot.load(path), needle)


@pytest.mark.slow
def test_a_stage_error_names_the_spec_and_its_json_path(tmp_path):
    """Before: `inspect: error: precision fp8: ...`, naming neither the spec nor the field."""
    path = _spec(tmp_path, lambda s: s.update(output=str(tmp_path / "out"),
                                              build={**s.get("build", {}), "precision": "fp8"}))
    proc = subprocess.run([sys.executable, "-m", "pipeline.flow", "inspect", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert (proc.returncode, proc.stderr.splitlines()[-1]) == (
        2, f"inspect: error: {path}: $.build.precision fp8: expected one of fp16, fp32"), proc.stderr


def test_a_spec_output_that_is_a_file_or_holds_the_kernel_is_refused(tmp_path):
    """Before: `dodo.py: error: X: File exists`, and doit's own 'Cyclic/recursive dependencies'
    for a DSO that is the export stage's target."""
    (tmp_path / "afile").write_text("")
    path = _spec(tmp_path, lambda s: s.update(output=str(tmp_path / "afile")))
    refused(lambda: load_spec(path), "$.output: ", "exists and is not a folder")
    dso = tmp_path / "out" / "kernel" / "kernel.so"
    dso.parent.mkdir(parents=True)
    dso.write_bytes(b"")
    path = _spec(tmp_path, lambda s: s.update(output=str(tmp_path / "out"), kernel={"dso": str(dso)}))
    refused(lambda: load_spec(path), "$.kernel.dso: ", "lies in the output folder")


def test_an_exported_or_given_dso_that_is_no_shared_library_fails_its_stage(tmp_path):
    from pipeline.flow.stages import export_dso
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not an ELF file")
    exporter = tmp_path / "export.sh"
    exporter.write_text(f"#!/bin/sh\ncp {junk} \"$1\"\n")
    exporter.chmod(0o755)
    for kernel, needle in (({"dso": str(junk)}, "is not a shared library"),
                           ({"exporter": [str(exporter), "{output}"], "sources": [str(exporter)]},
                            "wrote no shared library")):
        spec = load_spec(_spec(tmp_path, lambda s, k=kernel: s.update(
            output=str(tmp_path / "out"), kernel=k)))
        refused(lambda: export_dso(spec), needle, "not an ELF file")
        assert not spec.paths.dso.exists()


def test_bytes_that_validated_are_not_validated_again_and_others_still_are(tmp_path, monkeypatch):
    calls = []
    check = jsonio.validate
    monkeypatch.setattr(jsonio, "validate", lambda *a: calls.append(a[1]) or check(*a))
    good = orjson.dumps({"schema_version": 1, "bindings": [
        {"id": "x@1", "abi_sha256": "0" * 64, "library": "./k.so", "function": "run"}]})
    for _ in range(3):
        assert jsonio.parse_json(good, "binding", tmp_path / "b.json")["bindings"][0]["id"] == "x@1"
    assert calls == ["binding"]  # once for these bytes
    bad = good.replace(b'"run"', b'"r un"')
    for _ in range(2):
        with pytest.raises(UserError, match="b.json"):
            jsonio.parse_json(bad, "binding", tmp_path / "b.json")
    assert calls == ["binding"] * 3  # a refusal is never remembered
    # the count limits are checked every time, before the schema, which runs once for these bytes
    from pipeline.graph import bounds
    other = good.replace(b'"x@1"', b'"y@1"')
    for _ in range(2):
        assert bounds.parse_counted(other, "binding", tmp_path / "c.json")["bindings"][0]["id"] == "y@1"
    assert calls == ["binding"] * 4
    monkeypatch.setattr(bounds, "_top_limits", lambda schema: [("bindings", 0)])
    with pytest.raises(UserError, match=r"c.json: \$.bindings: 1 items, more than the limit of 0"):
        bounds.parse_counted(other, "binding", tmp_path / "c.json")


def test_schemas_validate_the_same_with_their_references_inlined(built):
    """Validation inlines a schema's local references (one lookup per value in a big file): a
    reference back to itself stays one, one beside other keywords stays as written, and real
    files (a graph snapshot, a selection, a slot bundle's network and slots, the example specs)
    give the same errors either way, as they are and with every string spoiled."""
    import jsonschema

    from pipeline import jsonio
    defs = {"node": {"type": "object", "properties": {"kids": {"items": {"$ref": "#/$defs/node"}}}},
            "leaf": {"type": "integer"}}
    schema = {"$defs": defs, "properties": {"a": {"$ref": "#/$defs/leaf"}, "n": {"$ref": "#/$defs/node"},
                                            "b": {"$ref": "#/$defs/leaf", "minimum": 3}}}
    inlined = jsonio._inlined(schema, defs)
    assert inlined["properties"]["a"] == {"type": "integer"}
    assert inlined["properties"]["n"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/node"}
    assert inlined["properties"]["b"] == {"$ref": "#/$defs/leaf", "minimum": 3}
    documents = {"a": "x", "n": {"kids": [{"kids": [5]}]}, "b": 2}
    for s in (schema, inlined):
        assert sorted(e.message for e in jsonio._Validator(s).iter_errors(documents)) == \
            ["'x' is not of type 'integer'", "2 is less than the minimum of 3", "5 is not of type 'object'"]
    def spoiled(x):  # every string a number: errors deep inside referenced definitions
        return {k: spoiled(v) for k, v in x.items()} if isinstance(x, dict) else \
            [spoiled(v) for v in x] if isinstance(x, list) else 7 if isinstance(x, str) else x
    files = {"graph": [built.snap], "selection": [built.receipt.to_json()],
             "network": [orjson.loads(p.read_bytes()) for p in built.slot.glob("roles/*/network.json")],
             "kernel_slots": [orjson.loads((built.slot / "kernel_slots.json").read_bytes())],
             "pipeline_spec": [orjson.loads(p.read_bytes())
                               for p in sorted((ROOT / "examples/pipelines").glob("*.json"))]}
    for name, docs in files.items():
        raw = orjson.loads((jsonio.SCHEMA_DIR / f"{name}.schema.json").read_bytes())
        validators = [jsonschema.Draft202012Validator(s) for s in (raw, jsonio._inlined(raw, raw["$defs"]))]
        assert docs and "$ref" in str(raw)
        for doc in docs:
            for d in (doc, spoiled(doc)):
                got = [sorted((list(e.absolute_path), e.message) for e in v.iter_errors(d)) for v in validators]
                assert got[0] == got[1] and (d is doc) == (not got[0]), (name, got[0][:3], got[1][:3])
