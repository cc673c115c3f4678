"""Bounded inputs: every count, size and wait has a limit, checked before the work it bounds, and
each refusal is one line naming the file, field or layer and the limit. Runs on a CPU."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.bundle import layout
from pipeline.bundle.reader import Bundle
from pipeline.bundle.writer import build_bundle
from pipeline.flow.spec import load_spec
from pipeline.gates import ledger
from pipeline.graph import listing, select, snapshot
from pipeline.kernels import load_manifest
from pipeline.kernels.build import build_kernel, local_includes
from pipeline.models.checkpoint import Checkpoint
from pipeline.models.synth import synthesize
from tests.conftest import process_gone
from test_hardening import (OPTIONS, ROOT, _spec, cli_refused, cli_refused_apart, refused, restamp,
                            snapshot_stub)

SHA = "0" * 64


def child_refusal(code: str, *needles: str, timeout: float = 120) -> str:
    """Run `code` (which may set a module's limit first) in a child process; it must end in one
    UserError line on stderr, exit status 2, within `timeout` s (a hang fails the test)."""
    wrapped = ("import sys\nfrom pipeline.errors import UserError\ntry:\n"
               + "".join(f"    {line}\n" for line in code.splitlines())
               + "except UserError as e:\n    print(e, file=sys.stderr)\n    sys.exit(2)\n")
    proc = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


# -- commands that never end --------------------------------------------------------------------
@pytest.mark.slow
def test_an_exporter_that_never_exits_is_killed_with_its_children(tmp_path):
    pids = tmp_path / "pids"
    exporter = _script(tmp_path / "export.sh",
                       f"#!/bin/sh\nsleep 300 &\necho $! > {pids}\nexec sleep 300\n")
    spec = _spec(tmp_path, lambda s: s.update(output=str(tmp_path / "out"), kernel={
        "exporter": [str(exporter), "{output}"], "sources": [str(exporter)]}))
    started = time.monotonic()
    child_refusal("from pipeline.flow.spec import load_spec\nfrom pipeline.flow import stages\n"
                  "from pipeline.kernels import build\nbuild.EXPORT_TIMEOUT_S = 1\n"
                  f"stages.export_dso(load_spec({str(spec)!r}))",
                  "$.kernel.exporter: ", "still running after 1 s", "EXPORT_TIMEOUT_S")
    assert time.monotonic() - started < 60
    grandchild = int(pids.read_text())
    deadline = time.monotonic() + 10
    while not process_gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(grandchild)
    assert list((tmp_path / "out" / "kernel").iterdir()) == []  # no stage left


@pytest.mark.slow
def test_a_compiler_that_never_exits_is_stopped(tmp_path):
    compiler = _script(tmp_path / "cxx", "#!/bin/sh\nexec sleep 300\n")
    source = tmp_path / "k.cc"
    source.write_text("int x;\n")
    child_refusal(f"import os\nos.environ['CXX'] = {str(compiler)!r}\n"
                  "from pipeline.kernels import build\nbuild.COMPILE_TIMEOUT_S = 1\n"
                  f"build.build_kernel({str(source)!r}, {str(tmp_path / 'k.so')!r}, cuda=False)",
                  "k.cc: cxx still running after 1 s", "COMPILE_TIMEOUT_S")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cxx", "k.cc"]


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "folder", "</dev/zero>"])
def test_an_include_that_is_no_regular_file_is_refused_before_compiling(tmp_path, kind):
    """A FIFO blocks the compiler for ever; /dev/zero grew it to 10 GB; an absolute path in
    angle brackets names the same file wherever the include path points."""
    name = {"fifo": "pipe.h", "/dev/zero": "/dev/zero", "folder": "sub",
            "</dev/zero>": "/dev/zero"}[kind]
    if kind == "fifo":
        os.mkfifo(tmp_path / name)
    elif kind == "folder":
        (tmp_path / name).mkdir()
    written = kind if kind.startswith("<") else f'"{name}"'
    (tmp_path / "h.h").write_text(f'#include {written}\n')
    source = tmp_path / "k.cc"
    source.write_text('#include "h.h"\nint x;\n')
    needles = [f'h.h: #include {written}: ', "expected a header file"]
    refused(lambda: local_includes([source]), *needles)
    refused(lambda: build_kernel(source, tmp_path / "k.so", cuda=False), *needles)
    assert not (tmp_path / "k.so").exists()


# -- sizes of synthetic models -------------------------------------------------------------------
SYNTH_CASES = {
    "layers": ("Qwen3-8B", {"num_hidden_layers": 10 ** 9}, "$.num_hidden_layers", 384),
    "distilbert layers": ("distilbert-base-uncased", {"n_layers": 10 ** 6}, "$.n_layers", 384),
    "hidden size": ("Qwen3-8B", {"hidden_size": 2 ** 20}, "$.hidden_size", 20480),
    "distilbert width": ("distilbert-base-uncased", {"dim": 10 ** 7}, "$.dim", 20480),
    "intermediate size": ("Qwen3-8B", {"intermediate_size": 10 ** 9}, "$.intermediate_size",
                          131072),
    "heads": ("Qwen3-8B", {"num_attention_heads": 4096}, "$.num_attention_heads", 256),
    "kv heads": ("Qwen3-8B", {"num_key_value_heads": 4096}, "$.num_key_value_heads", 256),
    "head dim": ("Qwen3-8B", {"head_dim": 65536}, "$.head_dim", 512),
    "positions": ("Qwen3-8B", {"max_position_embeddings": 10 ** 12},
                  "$.max_position_embeddings", 1048576),
}


@pytest.mark.parametrize("case", SYNTH_CASES)
def test_synth_sizes_are_bounded_before_any_work(tmp_path, case):
    config, overrides, field, limit = SYNTH_CASES[case]
    refused(lambda: synthesize(config, tmp_path / "m", weights=False, overrides=overrides),
            f"{field}: ", f"greater than the maximum of {limit}")
    assert not (tmp_path / "m").exists()


def test_synth_on_the_command_line_names_the_field_and_limit(tmp_path):
    cli_refused_apart("model", "synth", "Qwen3-8B", "--no-weights", "--override",
                      "num_hidden_layers=1000000000", "-o", tmp_path / "m",
                      needles=["$.num_hidden_layers: 1000000000 is greater than the maximum of 384"])


# -- counts in files -------------------------------------------------------------------------------
def _many_nodes(snap: dict, n: int) -> None:
    """A chain of `n` UNARY nodes after the stub's two."""
    t = snap["tensors"][-1]
    for i in range(n):
        snap["tensors"].append({**t, "id": f"tensor:{3 + i}", "name": f"t{3 + i}",
                                "is_network_output": False})
        snap["nodes"].append({"id": f"node:{2 + i}", "type": "UNARY", "name": f"n{i}",
                              "inputs": [f"tensor:{2 + i}"], "outputs": [f"tensor:{3 + i}"]})


def _recipes(snap: dict, n: int) -> None:
    snap["recipes"] = [{"recipe_id": "r", "instance_id": f"i{i}", "nodes": ["node:0"],
                        "workspace_bytes": 0, "extra_args": [], "output_shape_like_input": None}
                       for i in range(n)]


def _snapshot_file(tmp_path: Path, change) -> Path:
    snap = snapshot_stub()
    change(snap)
    snap["fingerprint"] = snapshot.fingerprint(snap["nodes"], snap["tensors"],
                                               snap["engine_role"], snap["build"], snap["recipes"])
    path = tmp_path / "g.json"
    path.write_bytes(orjson.dumps(snap))
    return path


@pytest.mark.parametrize("change, needle", [
    (lambda s: _many_nodes(s, 65535), "$.nodes: 65537 items, more than the limit of 65536"),
    (lambda s: _recipes(s, 4097), "$.recipes: 4097 items, more than the limit of 4096"),
])
@pytest.mark.slow
def test_snapshot_counts_are_checked_before_the_schema(tmp_path, change, needle):
    path = _snapshot_file(tmp_path, change)
    refused(lambda: snapshot.load(path), str(path), needle, "graph.schema.json")
    cli_refused("graph", "list", path, needles=[needle])


def test_a_manifest_with_too_many_bindings_is_refused(tmp_path):
    (tmp_path / "k.so").write_bytes(b"")
    path = tmp_path / "m.json"
    path.write_bytes(orjson.dumps({"schema_version": 1, "bindings": [
        {"id": f"s{i}", "abi_sha256": SHA, "library": "k.so", "function": "run"}
        for i in range(257)]}))
    refused(lambda: load_manifest(path), "$.bindings: 257 items, more than the limit of 256")


def _texts(n: int, length: int = 5):
    return lambda s: s["gates"].update(texts=["x" * length] * n)


@pytest.mark.parametrize("change, needle", [
    (_texts(257), "$.gates.texts: "),
    (_texts(1, 65537), "$.gates.texts[0]: "),
    (lambda s: s["gates"].update(prompts=["p"] * 257), "$.gates.prompts: "),
    (lambda s: s["selection"].update(node_names=["n"] * 4097), "$.selection.node_names: "),
    (lambda s: s["selection"].update(extra_args=[{"type": "none"}] * 65),
     "$.selection.extra_args: "),
])
def test_spec_lists_are_bounded(tmp_path, change, needle):
    path = _spec(tmp_path, change)
    refused(lambda: load_spec(path), f"{path}: {needle}", "is too long")


# -- the ledger --------------------------------------------------------------------------------
PERF = {"median_ratio": 1.0, "ci_low": 0.99, "ci_high": 1.01, "threshold": 0.98, "trials": 10,
        "stopped_at": None, "outputs_match": True, "kernel_roofline_fraction": [None]}


def _ledger_line(**figures) -> bytes:
    return orjson.dumps(ledger.LedgerEntry.now(
        "perf", name="n", binding_id="b", abi_sha256=SHA, environment={"cpu": "c", "gpu": None},
        verdict="pass", passed=True, figures={**PERF, **figures}).to_json()) + b"\n"


def test_a_ledger_past_its_line_limit_is_refused(tmp_path):
    path = tmp_path / ledger.FILE
    path.write_bytes(_ledger_line() * (ledger.MAX_LEDGER_LINES + 1))
    refused(lambda: ledger.read(path), f"{path}: 20001 lines, more than the limit of 20000",
            "MAX_LEDGER_LINES")
    path.write_bytes(b"\n" * (ledger.MAX_LEDGER_BYTES + 1))
    refused(lambda: ledger.read(path), "larger than the limit of 33554432 bytes",
            "MAX_LEDGER_BYTES")


@pytest.mark.parametrize("figures", [{"ci_low": 1.2}, {"ci_high": 0.5}])
def test_a_perf_interval_that_misses_its_median_is_refused(tmp_path, figures):
    path = tmp_path / ledger.FILE
    for line in (_ledger_line(), _ledger_line(**figures)):
        ledger.append(path, ledger.LedgerEntry.from_json(orjson.loads(line)))
    needles = [f"{path}:2: $.figures: the interval", "does not hold median_ratio 1.0"]
    refused(lambda: ledger.read(path), *needles)
    cli_refused("gate", "history", path, "--plot", tmp_path / "p.png", needles=needles)
    assert not (tmp_path / "p.png").exists()


# -- listings --------------------------------------------------------------------------------------
def test_one_long_name_pads_no_other_row(tmp_path):
    long = "n" * 4096
    path = _snapshot_file(tmp_path, lambda s: s["nodes"][0].update(name=long))
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "graph", "list", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    header, first, second = proc.stdout.splitlines()
    assert proc.returncode == 0 and long in first
    assert len(second) < 200 and second.startswith("node:1  LayerType.UNARY"), second
    assert header.split() == ["NODE", "OP", "NAME", "INPUTS", "->", "OUTPUTS"]
    too_long = _snapshot_file(tmp_path, lambda s: s["nodes"][0].update(name=long + "n"))
    cli_refused("graph", "list", too_long, needles=["$.nodes[0].name: ", "is too long"])


def test_recipe_ids_and_roles_are_printed_escaped(tmp_path):
    def change(s):
        _recipes(s, 1)
        s["recipes"][0].update(recipe_id="r\x1b[31mred", instance_id="i\nj")
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "graph", "recipes",
                           str(_snapshot_file(tmp_path, change))],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "\x1b" not in proc.stdout, proc.stdout
    assert proc.stdout.splitlines()[1].split() == ["r\\x1b[31mred", "i\\nj", "node:0"]
    role = _snapshot_file(tmp_path, lambda s: s.update(engine_role="de\x1b[2Jcode\n"))
    lines = list(listing.list_recipes(snapshot.load(role)))
    assert len(lines) == 1 and "engine role 'de\\x1b[2Jcode\\n'" in lines[0], lines


# -- workspaces ------------------------------------------------------------------------------------
def test_workspace_bytes_are_bounded_at_selection(tmp_path):
    refused(lambda: select.select_region(snapshot_stub(), ["node:0"], binding_id="k",
                                         workspace_bytes=2 ** 36),
            "workspace_bytes 68719476736 is more than the limit of 268435456",
            "MAX_WORKSPACE_BYTES")
    path = _spec(tmp_path, lambda s: s.update(selection={
        "nodes": ["node:1"], "binding_id": "k", "workspace_bytes": 2 ** 36}))
    refused(lambda: load_spec(path), "$.selection.workspace_bytes: 68719476736 is greater than "
                                     "the maximum of 268435456")
    receipt = select.select_region(snapshot_stub(), ["node:0"], binding_id="k",
                                   workspace_bytes=select.MAX_WORKSPACE_BYTES)
    assert receipt.workspace_bytes == 256 << 20


# -- bundles: writing and reading weights ----------------------------------------------------------
@pytest.fixture(scope="module")
def native(tiny_distilbert, tmp_path_factory) -> Path:
    return build_bundle(str(tiny_distilbert), None, OPTIONS,
                        tmp_path_factory.mktemp("bounds") / "n.bundle", build_plans=False)


@pytest.mark.slow
def test_a_weights_file_that_cannot_be_written_is_one_line_and_leaves_nothing(tiny_distilbert,
                                                                                tmp_path):
    """A file size limit fails the write as a full disk does (safetensors raises both as
    SafetensorError, not OSError)."""
    out = tmp_path / "x.bundle"
    child_refusal("import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                  "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
                  "from pipeline.bundle.writer import build_bundle\n"
                  f"build_bundle({str(tiny_distilbert)!r}, None, {OPTIONS!r}, {str(out)!r}, "
                  "build_plans=False)",
                  f"{out / layout.WEIGHTS}: cannot be written (", "File too large")
    assert list(tmp_path.iterdir()) == []


def _replace_weights(data: bytes):
    def mutate(b: Path):
        (b / layout.WEIGHTS).write_bytes(data)
        restamp(b)
    return mutate


def _reshaped(b: Path):
    tensors = load_file(b / layout.WEIGHTS)
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].reshape(-1)[:-1].clone()
    save_file(tensors, b / layout.WEIGHTS)
    restamp(b)


def _retyped(b: Path):
    tensors = {k: v.double() for k, v in load_file(b / layout.WEIGHTS).items()}
    save_file(tensors, b / layout.WEIGHTS)
    restamp(b)


WEIGHT_CASES = {
    "garbage": (_replace_weights(os.urandom(4096)), "not a readable safetensors file"),
    "empty": (_replace_weights(b""), "not a readable safetensors file"),
    "header only": (_replace_weights(b"\x02\x00\x00\x00\x00\x00\x00\x00{}"), "missing weight"),
    "truncated": (lambda b: _replace_weights((b / layout.WEIGHTS).read_bytes()[:100000])(b),
                  "not a readable safetensors file"),
    "a tensor of another shape": (_reshaped, "but manifest.json records FP32"),
    "tensors of another dtype": (_retyped, "is float64"),
}


@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_weights_replaced_under_a_new_digest_are_refused_at_load(native, tmp_path, case):
    mutate, needle = WEIGHT_CASES[case]
    bundle = shutil.copytree(native, tmp_path / "b.bundle")
    mutate(bundle)
    refused(lambda: Bundle.open(bundle).weights(), str(bundle / layout.WEIGHTS), needle)


def test_garbage_weights_are_one_line_on_the_command_line(native, tmp_path):
    bundle = shutil.copytree(native, tmp_path / "b.bundle")
    WEIGHT_CASES["garbage"][0](bundle)
    cli_refused("embed", bundle, "--device", "cpu", "--prompt", "hello",
                needles=[f"{bundle / layout.WEIGHTS}: not a readable safetensors file"])


def test_a_checkpoint_tensor_safetensors_refuses_is_one_line(tmp_path):
    """Offsets within the file, as the header check wants, but not covering its data."""
    header = orjson.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    (tmp_path / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + bytes(16))
    ck = Checkpoint(tmp_path, "m", "r", {})
    refused(lambda: ck.tensor("a"), f"{tmp_path / 'model.safetensors'}: not a readable "
                                    f"safetensors file")


# -- network exports -------------------------------------------------------------------------------
def _layer(net: dict, kind: str, nth: int = 0) -> dict:
    return [x for x in net["layers"] if x["type"] == kind][nth]


def _attrs(kind: str, change):
    return lambda net: change(_layer(net, kind)["attrs"])


def _drop(kind: str, key: str):
    return _attrs(kind, lambda a: a.pop(key))


def _set(kind: str, **values):
    return _attrs(kind, lambda a: a.update(values))


def _inputs(kind: str, change):
    return lambda net: change(_layer(net, kind)["inputs"])


NETWORK_CASES = {
    "CONSTANT without weights": _drop("CONSTANT", "weights"),
    "CONSTANT without shape": _drop("CONSTANT", "shape"),
    "CONSTANT weights of another type": _set("CONSTANT", weights=5),
    "CONSTANT shape of strings": _set("CONSTANT", shape=["a", "b"]),
    "SHUFFLE without first_transpose": _drop("SHUFFLE", "first_transpose"),
    "SHUFFLE transpose out of range": _set("SHUFFLE", first_transpose=[7]),
    "SHUFFLE transpose of another type": _set("SHUFFLE", first_transpose=3),
    "SHUFFLE reshape of another type": _set("SHUFFLE", reshape_dims="x"),
    "GATHER without mode": _drop("GATHER", "mode"),
    "GATHER without axis": _drop("GATHER", "axis"),
    "ELEMENTWISE without op": _drop("ELEMENTWISE", "op"),
    "ELEMENTWISE op of another type": _set("ELEMENTWISE", op=["SUM"]),
    "ELEMENTWISE with one input": _inputs("ELEMENTWISE", lambda i: i.pop()),
    "MATRIX_MULTIPLY without op0": _drop("MATRIX_MULTIPLY", "op0"),
    "MATRIX_MULTIPLY with no inputs": _inputs("MATRIX_MULTIPLY", lambda i: i.clear()),
    "NORMALIZATION without epsilon": _drop("NORMALIZATION", "epsilon"),
    "NORMALIZATION axes of another type": _set("NORMALIZATION", axes="2"),
    "SOFTMAX without axes": _drop("SOFTMAX", "axes"),
    "ACTIVATION without type": _drop("ACTIVATION", "type"),
    "CAST with three inputs": _inputs("CAST", lambda i: i.extend([i[0], i[0]])),
    "attrs missing": lambda net: _layer(net, "SOFTMAX").pop("attrs"),
    "a layer id of another kind": lambda net: _layer(net, "SOFTMAX").update(id="tensor:3"),
    "a name with a line break": lambda net: _layer(net, "SOFTMAX").update(name="a\nb"),
}


@pytest.mark.parametrize("case", NETWORK_CASES)
@pytest.mark.slow
def test_a_malformed_network_export_is_refused_at_load_naming_the_layer(native, tmp_path, case):
    from pipeline.runtime.pipeline import open_pipeline
    bundle = shutil.copytree(native, tmp_path / "b.bundle")
    rel = layout.network_path("decode")
    net = orjson.loads((bundle / rel).read_bytes())
    NETWORK_CASES[case](net)
    (bundle / rel).write_bytes(orjson.dumps(net))
    restamp(bundle)
    message = refused(lambda: open_pipeline(bundle, device="cpu"))
    assert re.search(r"node:[0-9]+ |\$\.layers\[[0-9]+\]", message), message


def test_an_intact_bundle_still_runs(native):
    from pipeline.runtime.pipeline import open_pipeline
    (out,) = open_pipeline(native, device="cpu").embed(["hello world"])
    assert torch.isfinite(out).all()


def test_a_file_size_limit_while_writing_json_is_one_line(tmp_path):
    """EFBIG (a process file size limit, RLIMIT_FSIZE) is the user's to fix, like a full disk."""
    import subprocess
    import sys
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000)); "
            "from pipeline import jsonio; from pipeline.errors import UserError\n"
            "try:\n    jsonio.write_json(sys.argv[1], {'x': 'y' * 5000}, None)\n"
            "except UserError as e:\n    print(e)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "big.json")],
                          capture_output=True, text=True, timeout=60)
    said = proc.stdout.strip()
    assert proc.returncode == 0 and said == f"{tmp_path / 'big.json'}: File too large", proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_layer_the_export_describes_wrongly_fails_at_run_naming_the_layer():
    """What only fails once the step runs (a reshape to a size the input does not have) is one
    line naming the layer, as torch.fx names the node that failed; the cause is kept."""
    from pipeline.errors import UserError
    from pipeline.runtime.program import Program
    from pipeline.trt.export import export_network
    from pipeline.trt.network import NetworkBuilder
    nb = NetworkBuilder()
    shuffle = nb.network.add_shuffle(nb.input("x", "FP32", (2, 3)))
    shuffle.reshape_dims = (3, 2)
    nb.mark_output(shuffle.get_output(0), "out")
    export = export_network(nb, "test")
    (layer,) = export["layers"]
    layer["attrs"]["reshape_dims"] = [4, 2]
    program = Program.lower(export, dict(nb.computed))
    with pytest.raises(UserError) as e:
        program(x=torch.zeros(2, 3))
    assert str(e.value) == ("node:0 SHUFFLE: RuntimeError: shape '[4, 2]' is invalid for input "
                            "of size 6")
    assert isinstance(e.value.__cause__, RuntimeError)
