"""Nothing a verdict rests on can be changed without `trtmc gate verify`, `promote` or doit
noticing: every file of both bundles, the report files, the ledger line and every cross-reference
inside a receipt are checked; a report edited after its gate wrote it re-runs that gate; a recipe
edited in a snapshot makes the snapshot refuse to load.

The pipeline runs for real (`doit -f dodo.py` in a process of its own) on a tiny DistilBERT, as in
tests/test_doit_pipeline.py; the tests of this module share its workspace and run in order. Each
edit is undone before the next test. Receipts and reports are fuzzed with a fixed seed.
"""
from __future__ import annotations

import copy
import dataclasses
import random
import subprocess
from pathlib import Path

import orjson
import pytest

from pipeline import jsonio
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.gates import environment
from pipeline.gates.promotion import REPORT_FILES, report_problem, verify
from pipeline.graph import snapshot
from test_doit_pipeline import ALL, ROOT, Workspace, one_layer_workspace
from tests.forked_python import python_m

# the workspace runs every stage first (a minute or two on a CPU), once: on one worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("laundering_workspace")]

CASES = 50


@pytest.fixture(scope="module")
def ws(tiny_distilbert, tmp_path_factory) -> Workspace:
    """A workspace whose pipeline has run once (`ws.first`: that run's doit result), so each test
    stands alone, whichever runs first and wherever."""
    ws = one_layer_workspace(tmp_path_factory.mktemp("laundering"), tiny_distilbert)
    ws.first = ws.doit()
    return ws


@pytest.fixture(autouse=True)
def this_machine(monkeypatch):
    """Verify on the machine the gates ran on: no environment override."""
    monkeypatch.delenv(environment.OVERRIDE, raising=False)


def _verify_cli(capsys, receipt: Path) -> tuple[int, list[str]]:
    rc = main(["gate", "verify", str(receipt)])
    return rc, capsys.readouterr().out.splitlines()


def _diffs(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("DIFF")]


class Edited:
    """Change a file's bytes for the `with` block; its bytes are put back after."""

    def __init__(self, path: Path, change):
        self.path, self.change = path, change

    def __enter__(self):
        self.before = self.path.read_bytes()
        after = self.change(self.before)
        assert after != self.before, f"{self.path}: the edit changed nothing"
        self.path.write_bytes(after)
        return self.path

    def __exit__(self, *exc):
        self.path.write_bytes(self.before)


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


def _json_edit(change):
    def edit(data: bytes) -> bytes:
        doc = orjson.loads(data)
        change(doc)
        return orjson.dumps(doc)
    return edit


def test_the_pipeline_promotes_and_its_receipt_verifies(ws, capsys):
    rc, stages, out = ws.first
    assert (rc, stages) == (0, ALL), out
    receipt = jsonio.read_json(ws.out / "promotion.json", "promotion")
    assert receipt["graph"]["path"] == "out/graph.json" and receipt["ledger"] is not None
    assert sorted(Path(f["path"]).name for f in receipt["gates"]["perf"]["files"]) == \
        ["perf.md", "perf.png", "perf.xml"]
    rc, lines = _verify_cli(capsys, ws.out / "promotion.json")
    assert rc == 0 and not _diffs(lines), lines
    assert any("native bundle file weights.safetensors" in line for line in lines)


@pytest.mark.parametrize("rel, change", [
    ("slot.bundle/kernel_slots.json", _json_edit(lambda d: d["slots"][0]["abi"].update(
        workspace_bytes=64))),
    ("native.bundle/weights.safetensors", _flip_last_byte),
    ("slot.bundle/roles/decode/network.json", _json_edit(lambda d: d["layers"][0].update(
        name="renamed"))),
    ("native.bundle/tokenizer/tokenizer_config.json", _json_edit(lambda d: d.update(
        model_max_length=7))),
    ("reports/correctness.md", lambda b: b + b"\nAll good.\n"),
    ("reports/perf.xml", lambda b: b.replace(b'failures="0"', b'failures="00"')),
    ("reports/perf.png", _flip_last_byte),
])
def test_an_edited_file_under_the_receipt_is_one_diff_line(ws, capsys, rel, change):
    with Edited(ws.out / rel, change) as path:
        rc, lines = _verify_cli(capsys, ws.out / "promotion.json")
    assert rc == 1 and lines[-1].startswith("NOT verified"), lines
    assert _diffs(lines) and all(str(path) in line for line in _diffs(lines)), lines
    assert _verify_cli(capsys, ws.out / "promotion.json")[0] == 0


def test_an_unlisted_file_in_a_bundle_is_a_difference(ws, capsys):
    extra = ws.out / "slot.bundle" / "extra.bin"
    extra.write_bytes(b"not built by trtmc")
    try:
        rc, lines = _verify_cli(capsys, ws.out / "promotion.json")
    finally:
        extra.unlink()
    assert rc == 1 and any(str(extra) in line and "not listed" in line for line in _diffs(lines))


def test_an_edited_ledger_line_is_a_difference(ws, capsys):
    ledger = ws.out / "ledger.jsonl"

    def change(data: bytes) -> bytes:
        lines = data.splitlines()
        i = max(i for i, line in enumerate(lines) if b'"event":"promote"' in line)
        entry = orjson.loads(lines[i])
        entry["figures"]["perf"]["median_ratio"] = 1.5
        lines[i] = orjson.dumps(entry)
        return b"\n".join(lines) + b"\n"
    with Edited(ledger, change):
        rc, lines = _verify_cli(capsys, ws.out / "promotion.json")
    assert rc == 1 and [line for line in _diffs(lines) if "ledger line" in line], lines


def test_a_ledger_line_before_the_promotion_rewritten_or_removed_breaks_the_chain(ws, capsys):
    ledger = ws.out / "ledger.jsonl"

    def rewritten(data: bytes) -> bytes:
        lines = data.splitlines()
        entry = orjson.loads(lines[0])
        entry["verdict"], entry["passed"] = "fail", False
        return b"\n".join([orjson.dumps(entry), *lines[1:]]) + b"\n"
    for change in (rewritten, lambda data: b"\n".join(data.splitlines()[1:]) + b"\n"):
        with Edited(ledger, change):
            rc, lines = _verify_cli(capsys, ws.out / "promotion.json")
            assert main(["gate", "history", str(ledger)]) == 2
        assert rc == 1 and [d for d in _diffs(lines) if "ledger chain" in d and
                            "the chain breaks" in d], lines
    capsys.readouterr()


def test_a_recipe_added_to_the_graph_is_a_difference(ws, capsys):
    graph = ws.out / "graph.json"
    recipe = {"recipe_id": "residual", "instance_id": "0", "nodes": ["node:0"],
              "workspace_bytes": 0, "extra_args": [], "output_shape_like_input": None}
    with Edited(graph, _json_edit(lambda d: d["recipes"].append(recipe))):
        rc, lines = _verify_cli(capsys, ws.out / "promotion.json")
    diffs = _diffs(lines)
    assert rc == 1 and any("re-derived from the graph" in d and "$.fingerprint" in d
                           for d in diffs), lines


def test_a_gate_policy_holds_the_verdicts_to_its_floors(ws, capsys, tmp_path):
    """The spec's lax perf gate (threshold 0.001, five trials, on a CPU) promotes; a CI job's
    policy at the default floors, on a GPU, refuses the receipt, naming each setting below its
    floor; a policy the settings meet verifies; a policy that is not one is one line."""
    receipt, policy = ws.out / "promotion.json", tmp_path / "policy.json"
    strict = {"schema_version": 1, "device": "cuda",
              "correctness": {"max_abs_diff": 0.02, "min_cosine": 0.999, "max_tie_steps": 4},
              "perf": {"min_threshold": 0.98, "min_confidence": 0.95, "min_trials": 20}}
    policy.write_bytes(orjson.dumps(strict))
    rc = main(["gate", "verify", str(receipt), "--policy", str(policy)])
    diffs = _diffs(capsys.readouterr().out.splitlines())
    assert rc == 1 and [d.split("  ")[1] for d in diffs] == [
        "policy device", "policy perf threshold", "policy perf trials"], diffs
    assert diffs[1].endswith("the verdict's 0.001, the policy's at least 0.98"), diffs[1]
    met = {**strict, "device": "cpu", "perf": {"min_threshold": 0.001, "min_confidence": 0.95,
                                               "min_trials": 5}}
    policy.write_bytes(orjson.dumps(met))
    rc = main(["gate", "verify", str(receipt), "--policy", str(policy)])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0 and sum(line.startswith("ok    policy ") for line in lines) == 7, lines
    policy.write_bytes(b'{"schema_version": 1, "perf": {"threshold": 0.9}}')
    assert main(["gate", "verify", str(receipt), "--policy", str(policy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(policy) in err[0] and "threshold" in err[0], err


# -- signed receipts ----------------------------------------------------------------------------
def _signed_verify(capsys, receipt: Path, key: Path) -> tuple[int, list[str]]:
    rc = main(["gate", "verify", str(receipt), "--trusted-key", str(key)])
    return rc, capsys.readouterr().out.splitlines()


def test_a_receipt_signed_in_one_job_verifies_in_another_with_the_public_key_only(ws, capsys,
                                                                                  tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    assert main(["gate", "keygen", str(keys / "ci.pem")]) == 0
    assert (keys / "ci.pem").stat().st_mode & 0o077 == 0
    assert main(["gate", "keygen", str(keys / "other.pem")]) == 0
    receipt = ws.out / "promotion.json"
    rc, lines = _signed_verify(capsys, receipt, keys / "ci.pem.pub")
    assert rc == 1 and [d for d in _diffs(lines) if "signature" in d and "not signed" in d], lines
    assert main(["gate", "sign", str(receipt), "--key", str(keys / "ci.pem")]) == 0
    capsys.readouterr()
    # the other job: a process of its own, with the public key only
    (keys / "ci.pem").unlink()
    proc = python_m("pipeline.cli", "gate", "verify", receipt, "--trusted-key", keys / "ci.pem.pub",
                    cwd=ROOT)
    assert proc.returncode == 0 and "DIFF" not in proc.stdout, proc.stdout + proc.stderr
    assert "ok    signed subjects (" in proc.stdout, proc.stdout
    statement = orjson.loads(__import__("base64").b64decode(
        orjson.loads(receipt.with_name("promotion.json.dsse").read_bytes())["payload"]))
    names = [s["name"] for s in statement["subject"]]
    assert names[0] == "out/promotion.json" and "kernel.cu" in names and any(
        n.endswith("slot.bundle/weights.safetensors") for n in names), names
    rc, lines = _signed_verify(capsys, receipt, keys / "other.pem.pub")
    assert rc == 1 and [d for d in _diffs(lines) if "no valid signature by the trusted key" in d]
    # a receipt edited consistently with its files still differs from what was signed
    with Edited(receipt, _json_edit(lambda d: d["gates"]["perf"].update(message="edited"))):
        rc, lines = _signed_verify(capsys, receipt, keys / "ci.pem.pub")
    assert rc == 1 and [d for d in _diffs(lines) if "signed subject out/promotion.json" in d and
                        "signed as" in d], lines


def test_a_receipt_that_does_not_verify_is_not_signed(ws, capsys, tmp_path):
    key = tmp_path / "k.pem"
    assert main(["gate", "keygen", str(key)]) == 0
    with Edited(ws.out / "slot.bundle" / "weights.safetensors", _flip_last_byte):
        rc = main(["gate", "sign", str(ws.out / "promotion.json"), "--key", str(key),
                   "-o", str(tmp_path / "env.dsse")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "does not verify" in err[0] and \
        "weights.safetensors" in err[0], err
    assert not (tmp_path / "env.dsse").exists()
    assert main(["gate", "sign", str(ws.out / "promotion.json"), "--key", str(key) + ".pub"]) == 2
    assert "not an unencrypted PEM private key" in capsys.readouterr().err


# -- reports pinned by their gate ---------------------------------------------------------------
def _flow(stage: str, ws: Workspace) -> subprocess.CompletedProcess:
    return python_m("pipeline.flow", stage, ws.spec_path, cwd=ROOT)


def test_an_edited_verdict_reruns_its_gate_and_is_never_promoted(ws, capsys):
    perf = ws.out / "reports" / "perf.json"
    report = orjson.loads(perf.read_bytes())
    report["summary"]["median_ratio"] = 1.5
    jsonio.write_json(perf, report, "gate_report")
    proc = _flow("promote", ws)
    assert proc.returncode != 0, proc.stderr
    assert f"{perf}: edited after its gate wrote it; run the gate again" in proc.stderr
    assert "Traceback" not in proc.stderr
    rc, stages, out = ws.doit()
    assert rc == 0 and {"perf", "promote"} <= stages and "correctness" not in stages, out
    assert ws.report("perf")["summary"]["median_ratio"] != 1.5
    assert _verify_cli(capsys, ws.out / "promotion.json")[0] == 0


def test_an_edited_markdown_report_reruns_its_gate(ws, capsys):
    with (ws.out / "reports" / "correctness.md").open("a") as f:
        f.write("\n**Verdict: PASS** (edited)\n")
    rc, stages, out = ws.doit()
    assert rc == 0 and "correctness" in stages and "perf" not in stages, out
    assert "(edited)" not in (ws.out / "reports" / "correctness.md").read_text()
    assert _verify_cli(capsys, ws.out / "promotion.json")[0] == 0


def test_a_gate_report_is_computed_again_from_its_own_figures(ws):
    """verify takes no verdict on trust: the perf report's, computed again from its trials under
    the spec's settings, must be the same verdict and message; the correctness report's pass must
    follow from its cases under the spec's thresholds; and the gates must have run the pinned
    DSO."""
    from pipeline.gates import promotion
    from pipeline.gates.performance import rederived
    from pipeline.gates.settings import GateSettings, PerfSettings
    from pipeline.gates.report_types import GateReport, read_report
    at = ws.out / "reports/perf.json"
    report = jsonio.read_json(at, "gate_report")
    typed = read_report(at)
    receipt = promotion.PromotionReceipt.read(ws.out / "promotion.json")
    spec = GateSettings.from_json(receipt.spec.content["gates"])
    again = rederived(typed)
    assert (again.verdict, again.message) == (report["verdict"], report["message"])
    assert promotion._perf_rederived(typed, spec, at).match
    # trials 10,000 times slower than native (the spec's threshold is 0.001), the pass left as
    # it was (its pins made again by whoever edited it)
    slow = copy.deepcopy(report)
    for t in slow["trials"]:
        t.update(external_s=1e4 * t["native_s"], external_throughput=t["native_throughput"] / 1e4,
                 ratio=1e-4)
    slow = GateReport.from_json(slow)
    assert rederived(slow).verdict == "fail"
    check = promotion._perf_rederived(slow, spec, at)
    assert not check.match and "give 'fail'" in check.detail, check
    # a threshold other than the one the report shows
    assert rederived(typed, PerfSettings(threshold=100.0)).verdict == "fail"
    # the correctness report likewise: a case passed beyond the thresholds, or thresholds other
    # than the spec's
    at = ws.out / "reports/correctness.json"
    report = jsonio.read_json(at, "gate_report")
    assert promotion._correctness_rederived(read_report(at), spec, at).match
    far = copy.deepcopy(report)
    far["cases"][0]["cosine"] = 0.5
    check = promotion._correctness_rederived(GateReport.from_json(far), spec, at)
    assert not check.match and "case 0 passes at max |diff|" in check.detail, check
    loose = copy.deepcopy(report)
    loose["thresholds"]["max_abs_diff"] = 10.0
    assert "the spec's" in promotion._correctness_rederived(GateReport.from_json(loose), spec,
                                                           at).detail
    # a receipt whose DSO is not the library the gates ran
    other = dataclasses.replace(receipt, dso=dataclasses.replace(receipt.dso, sha256="0" * 64))
    base = (ws.out / receipt.spec_folder).resolve()
    kernel_checks = [c for c in promotion._gate_references(
                         other, base, promotion._gate_reports(other, base), spec)[1]
                     if c.what.endswith(" kernel")]
    assert [c.what for c in kernel_checks] == ["gates.correctness kernel", "gates.perf kernel"]
    assert not any(c.match for c in kernel_checks)


def test_fuzzed_report_edits_are_each_refused(ws):
    rng = random.Random(20260)
    reports = ws.out / "reports"
    receipt = ws.out / "promotion.json"
    for case in range(CASES):
        gate = rng.choice(sorted(REPORT_FILES))
        path = reports / f"{gate}.{rng.choice(REPORT_FILES[gate])}"
        at = rng.randrange(len(path.read_bytes()))

        kind = rng.choice(["flip", "insert", "truncate"])

        def change(data: bytes, kind=kind) -> bytes:
            if kind == "flip":
                return data[:at] + bytes([data[at] ^ 0x20]) + data[at + 1:]
            return data[:at] + b" " + data[at:] if kind == "insert" else data[:at]
        with Edited(path, change):
            assert report_problem(reports, gate) == \
                f"{path}: edited after its gate wrote it; run the gate again", case
            result = verify(receipt)
            assert not result.ok, case
            assert [c.path for c in result.files + result.report_files
                    if not c.match] == [str(path)], case
        assert report_problem(reports, gate) is None


# -- receipts -----------------------------------------------------------------------------------
def _leaves(obj, at=()):
    """JSON paths of every scalar, empty list and empty object in `obj`."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, list) else None
    if not items:
        yield at
        return
    for key, value in items:
        yield from _leaves(value, (*at, key))


def _changed(value, rng: random.Random):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + rng.choice([1, -1])
    if isinstance(value, str):
        return value + rng.choice(["x", "/", "0"])
    if value in ([], {}):
        return ["x"] if value == [] else {"x": 1}
    return "x"  # None


def _set_leaf(doc: dict, root: tuple, rng: random.Random) -> None:
    obj = doc
    for key in root:
        obj = obj[key]
    *parent, key = rng.choice(list(_leaves(obj)))
    for k in parent:
        obj = obj[k]
    obj[key] = _changed(obj[key], rng)


def _remove_pin(doc: dict, rng: random.Random) -> None:
    lists = [("kernel_sources",), ("gates", "correctness", "files"), ("gates", "perf", "files")]
    choice = rng.randrange(4)
    if choice == 0:
        doc[rng.choice(["graph", "ledger"])] = None
    elif choice == 1:
        del doc[rng.choice(["graph", "ledger", "kernel_sources", "selection", "dso"])]
    else:
        at = rng.choice(lists)
        pins = doc
        for key in at:
            pins = pins[key]
        pins.pop(rng.randrange(len(pins)))


def _edit_selection(doc: dict, rng: random.Random) -> None:
    key = rng.choice(["abi", "binding_id", "graph_fingerprint", "abi_sha256"])
    if key == "abi":
        _set_leaf(doc, ("selection", "abi"), rng)
    elif key == "binding_id":
        doc["selection"][key] += rng.choice(["x", ".1"])
    else:
        doc["selection"][key] = "%064x" % rng.getrandbits(256)


EDITS = {
    "pin rereceipt": _remove_pin,
    "spec.content edited": lambda doc, rng: _set_leaf(doc, ("spec", "content"), rng),
    "selection edited": _edit_selection,
    "gate message edited": lambda doc, rng: doc["gates"][rng.choice(["correctness", "perf"])]
    .update(message="pass, trust me"),
    "ledger digest edited": lambda doc, rng: doc["ledger"].update(
        sha256="%064x" % rng.getrandbits(256)),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_fuzzed_receipts_are_each_refused(ws, edit):
    rng = random.Random(f"{edit}:7")
    original = jsonio.read_json(ws.out / "promotion.json", "promotion")
    assert verify(ws.out / "promotion.json").ok
    fuzzed = ws.out / "promotion.fuzzed.json"
    for case in range(CASES):
        doc = copy.deepcopy(original)
        EDITS[edit](doc, rng)
        assert doc != original, case
        fuzzed.write_bytes(orjson.dumps(doc))
        try:
            result = verify(fuzzed)
        except UserError as e:  # the schema refuses it: a required pin left out
            assert "promotion.fuzzed.json" in str(e), case
            continue
        assert not result.ok, (case, doc)
    fuzzed.unlink()


# -- recipes in the fingerprint -----------------------------------------------------------------
def test_a_recipe_added_or_edited_in_a_snapshot_is_refused(tiny_distilbert, tmp_path):
    from pipeline.families.capture import capture_role
    snap = capture_role(str(tiny_distilbert), None, "decode", {"sequence_length": 8}).snapshot
    node = next(n["id"] for n in snap["nodes"] if n["name"].endswith("attention_residual_add"))
    path = tmp_path / "graph.json"
    snapshot.save(snap, path)
    assert snapshot.load(path)["recipes"] == snap["recipes"]

    added = {**snap, "recipes": [*snap["recipes"], {
        "recipe_id": "residual", "instance_id": "0", "nodes": [node], "workspace_bytes": 0,
        "extra_args": [], "output_shape_like_input": None}]}
    path.write_bytes(orjson.dumps(added))
    with pytest.raises(UserError, match=r"\$\.fingerprint: .* recipes"):
        snapshot.load(path)

    added["fingerprint"] = snapshot.fingerprint(added["nodes"], added["tensors"], "decode",
                                                added["build"], added["recipes"])
    path.write_bytes(orjson.dumps(added))
    assert snapshot.load(path)["recipes"][-1]["recipe_id"] == "residual"
    edited = copy.deepcopy(added)
    edited["recipes"][-1]["workspace_bytes"] = 4096
    path.write_bytes(orjson.dumps(edited))
    with pytest.raises(UserError, match=r"\$\.fingerprint"):
        snapshot.load(path)
