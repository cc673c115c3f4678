"""A seeded mutation fuzzer over every JSON format the project reads: graph snapshot, selection
receipt, binding manifest, pipeline spec, bundle manifest, kernel_slots.json and network export.
Each mutated file (a flipped bit, a truncation, a deleted, duplicated or retyped key, a huge number,
a hostile name) either loads or is refused with a one-line UserError, never another exception.
Where a digest or fingerprint would refuse every edit, the fuzzer restamps it, so the checks
behind it are reached too."""
from __future__ import annotations

import copy
import json
import random
import shutil

import orjson
import pytest

from pipeline.bundle import layout
from pipeline.bundle.reader import Bundle
from pipeline.errors import UserError
from pipeline.flow.spec import DEFAULT_SPEC, load_spec
from pipeline.graph import select, snapshot
from pipeline.kernels.bind import elf_problem
from pipeline.kernels.manifest import load_manifest
from test_hardening import ROOT, built, restamp  # noqa: F401 - `built` is a fixture

SEED = 10
CASES = 40  # per format: 8 formats, 320 cases
HOSTILE = ["", "x\n", "a\rb", "p\u2028q", "../../etc/passwd", "/abs", "node:1\n", "tensor:0\n",
           "slot:res\n", "é", "x" * 5000]
VALUES = [None, True, 0, -1, 1.5, 2 ** 31, 2 ** 63 - 1, 2 ** 64, 10 ** 30, -(2 ** 63) - 1, 1e308,
          "", "x", [], {}, [1, "a"], {"k": None}]
KINDS = ("flip", "truncate", "delete", "duplicate", "retype", "huge", "name")
_SENTINEL = "\x00fuzz-duplicate\x00"


def _dumps(obj) -> bytes:
    """Big integers included (orjson stops at 64 bits); non-ASCII written raw."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _places(obj) -> list[tuple]:
    """Every (container, key) that holds a value."""
    out, stack = [], [obj]
    while stack:
        c = stack.pop()
        items = c.items() if isinstance(c, dict) else enumerate(c) if isinstance(c, list) else ()
        for k, v in items:
            out.append((c, k))
            stack.append(v)
    return out


def mutate(rng: random.Random, obj, kind: str, restamp_obj=None) -> bytes:
    if kind in ("flip", "truncate"):
        data = bytearray(_dumps(obj))
        i = rng.randrange(len(data))
        if kind == "truncate":
            return bytes(data[:i])
        data[i] ^= 1 << rng.randrange(8)
        return bytes(data)
    obj = copy.deepcopy(obj)
    places = _places(obj)
    if kind == "duplicate":
        c, k = rng.choice([(c, k) for c, k in places if isinstance(c, dict)])
        value, c[k] = c[k], _SENTINEL
        twice = _dumps(value) + b"," + _dumps(k) + b":" + _dumps(rng.choice([value, 0, "x"]))
        return _dumps(obj).replace(_dumps(_SENTINEL), twice)
    top = [(obj, k) for k in (obj if isinstance(obj, dict) else ())]
    c, k = rng.choice(top if top and rng.random() < 0.25 else places)
    if kind == "delete":
        del c[k]
    else:
        pool = {"retype": VALUES, "huge": [2 ** 64, 10 ** 30, -(2 ** 63) - 1, 1e308, 2 ** 40 + 1],
                "name": HOSTILE}[kind]
        c[k] = rng.choice(pool)
    if restamp_obj is not None:
        restamp_obj(obj)
    return _dumps(obj)


def _refingerprint(snap) -> None:
    try:
        snap["fingerprint"] = snapshot.fingerprint(snap["nodes"], snap["tensors"],
                                                   snap["engine_role"], snap["build"],
                                                   snap["recipes"])
    except (KeyError, TypeError, AttributeError):
        pass  # too broken to fingerprint: the schema refuses it


@pytest.fixture(scope="module")
def formats(built, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """name -> (original object, file to write, loader(path), restamp of the object or None)."""
    root = tmp_path_factory.mktemp("fuzz")
    bundle = shutil.copytree(built.slot, root / "slot.bundle")
    (root / "k.so").write_bytes(b"")
    spec = orjson.loads(DEFAULT_SPEC.read_bytes())
    spec["kernel"] = {"source": str(ROOT / "examples" / "byok" / "residual_add.cu")}
    spec["selection"] = {"node_names": ["encoder.layers.0.attention_residual_add"],
                         "binding_id": "res", "workspace_bytes": 0}

    def graph(path):
        snap = snapshot.load(path)
        select.select_region(snap, list(built.receipt.nodes), binding_id="f")

    def receipt(path):
        select.rederive(select.load_receipt(path), built.snap, "fuzz")

    def binding(path):
        for b in load_manifest(path).bindings:
            elf_problem(b.library.read_bytes())

    def in_bundle(rel, stamp):
        def load(path):
            for pristine in (layout.MANIFEST, layout.SLOTS, layout.network_path("decode")):
                shutil.copy(built.slot / pristine, bundle / pristine)
            shutil.copy(path, bundle / rel)
            if stamp:
                restamp(bundle)
            b = Bundle.open(bundle)
            b.network("decode")
            b.weights()
        return load

    def bundle_json(rel):
        return orjson.loads((built.slot / rel).read_bytes())

    return {
        "graph": (built.snap, root / "graph.json", graph, None),
        "graph, fingerprint restamped": (built.snap, root / "graph.json", graph, _refingerprint),
        "selection receipt": (built.receipt.to_json(), root / "sel.json", receipt, None),
        "binding manifest": ({"schema_version": 1, "bindings": [
            {"id": "res", "abi_sha256": built.receipt.abi_sha256, "library": "k.so",
             "function": "run"}]}, root / "m.json", binding, None),
        "pipeline spec": (spec, root / "spec.json", load_spec, None),
        "bundle manifest": (bundle_json(layout.MANIFEST), root / "manifest.json",
                            in_bundle(layout.MANIFEST, False), None),
        "kernel_slots.json, restamped": (bundle_json(layout.SLOTS), root / "slots.json",
                                         in_bundle(layout.SLOTS, True), None),
        "network export, restamped": (bundle_json(layout.network_path("decode")),
                                      root / "network.json",
                                      in_bundle(layout.network_path("decode"), True), None),
    }


FORMATS = ["graph", "graph, fingerprint restamped", "selection receipt", "binding manifest",
           "pipeline spec", "bundle manifest", "kernel_slots.json, restamped",
           "network export, restamped"]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.slow
def test_mutations_load_or_are_refused_in_one_line(formats, name):
    original, path, load, restamp_obj = formats[name]
    path.write_bytes(_dumps(original))
    load(path)  # the unmutated file loads
    rng = random.Random(f"{SEED}:{name}")
    refusals = 0
    for case in range(CASES):
        kind = KINDS[case % len(KINDS)]
        path.write_bytes(mutate(rng, original, kind, restamp_obj))
        try:
            load(path)
        except UserError as e:
            message = str(e)
            assert message and len(message.splitlines()) == 1, (case, kind, message)
            assert kind != "duplicate" or "duplicate key" in message, (case, message)
            refusals += 1
        except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
            raise AssertionError(f"{name} case {case} ({kind}): {type(e).__name__}: {e}") from e
    assert refusals > CASES // 2  # the mutations mostly break something
