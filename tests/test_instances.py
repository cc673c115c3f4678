"""One kernel in every instance of a recipe: the instances selected explicitly (all, or by id,
with an expected count), one slot each under one binding id and ABI, bound once, and the tokens
of the native bundle with the kernel in every layer."""
from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import torch

from pipeline import jsonio
from pipeline.bundle.reader import Bundle
from pipeline.bundle.writer import build_bundle
from pipeline.errors import UserError
from pipeline.families.capture import capture_role
from pipeline.families.cases import Comparison, DecoderCase, DecoderThresholds
from pipeline.graph import select
from pipeline.host import open_pipeline
from tests.conftest import QWEN3_OPTIONS as OPTIONS, QWEN3_PROMPTS as PROMPTS
from tests.forked_python import python_m
from tests.test_qwen3_kernels import binding

RECIPE = "qwen.decode_attention_region@2"


@pytest.fixture(scope="module")
def snapshot(tiny_qwen3):
    return capture_role(str(tiny_qwen3), None, "decode", OPTIONS).snapshot


@pytest.fixture(scope="module")
def layers(tiny_qwen3):
    return orjson.loads((tiny_qwen3 / "config.json").read_bytes())["num_hidden_layers"]


def test_all_instances_one_receipt_each_in_graph_order(snapshot, layers):
    receipts = select.from_recipe_instances(snapshot, RECIPE, "all", expect_count=layers)
    assert [r.instance for r in receipts] == \
        [f"decoder.layers.{i}.decode_attention" for i in range(layers)]
    assert {r.binding_id for r in receipts} == {RECIPE}
    assert len({r.abi_sha256 for r in receipts}) == 1
    assert not set(receipts[0].nodes) & set(receipts[1].nodes)


def test_a_wrong_count_is_refused_naming_both_numbers(snapshot, layers):
    with pytest.raises(UserError, match=rf"selects {layers} instances, but {layers + 1} were expected"):
        select.from_recipe_instances(snapshot, RECIPE, "all", expect_count=layers + 1)


def test_overlapping_or_differing_instances_are_refused(snapshot):
    one = select.from_recipe(snapshot, RECIPE, "decoder.layers.0.decode_attention")
    with pytest.raises(UserError, match="overlap at node:"):
        select.check_instances([one, one], "test")
    with pytest.raises(UserError, match="named twice"):
        select.from_recipe_instances(snapshot, RECIPE, ["decoder.layers.0.decode_attention"] * 2)
    logits = select.from_recipe(snapshot, "qwen.decode_logits_copy@1", "decoder.logits_zero_bias",
                                binding_id=RECIPE)
    with pytest.raises(UserError, match="decoder.logits_zero_bias has another ABI than "
                                        "decoder.layers.0.decode_attention"):
        select.check_instances([one, logits], "test")


@pytest.mark.slow
def test_kernel_in_every_layer_gives_the_native_tokens(tiny_qwen3, snapshot, layers, qwen3_kernels,
                                                       qwen3_native_tokens, tmp_path):
    receipts = select.from_recipe_instances(snapshot, RECIPE, "all", expect_count=layers)
    bundle = build_bundle(str(tiny_qwen3), None, OPTIONS, tmp_path / "all.bundle",
                          selection=receipts, build_plans=False)
    slots = Bundle.open(bundle).slots
    assert [s["instance_id"] for s in slots] == [r.instance for r in receipts]
    assert all(s["nodes"] == list(r.nodes) for s, r in zip(slots, receipts))
    manifest = binding(receipts[0], qwen3_kernels["decode_attention"], tmp_path, "run")  # one id
    pipe = open_pipeline(bundle, manifest)
    assert sorted(pipe.regions) == sorted(f"{RECIPE}:{r.instance}" for r in receipts)
    assert [r["token_ids"] for r in pipe.generate(PROMPTS, 24, greedy=True)] == qwen3_native_tokens


def test_selection_set_round_trips_and_refuses_an_edit(snapshot, tmp_path):
    receipts = select.from_recipe_instances(snapshot, RECIPE, "all")
    path = tmp_path / "all.selection.json"
    select.save_selection(receipts, path)
    assert select.load_selection(path) == receipts
    raw = orjson.loads(path.read_bytes())
    raw["instances"][1]["workspace_bytes"] = 64
    path.write_bytes(orjson.dumps(raw))
    with pytest.raises(UserError, match=r"instances\[1\]: abi/abi_sha256 do not match"):
        select.load_selection(path)


@pytest.mark.slow
def test_cli_all_instances_with_expect_count(tiny_qwen3, layers, tmp_path, capsys):
    from pipeline.cli import main
    out = tmp_path / "all.bundle"
    args = ["build", str(tiny_qwen3), "--max-cache-length", "64", "--precision", "bf16",
            "--recipe", RECIPE, "--all-instances", "-o", str(out)]
    assert main(args + ["--expect-count", str(layers + 1)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"selects {layers} instances, but {layers + 1} were expected" in err[0]
    assert not out.exists() and not (tmp_path / "all.selection.json").exists()
    assert main(args + ["--expect-count", str(layers)]) == 0
    assert f"({layers} instances: decoder.layers.0.decode_attention" in capsys.readouterr().out
    assert len(select.load_selection(tmp_path / "all.selection.json")) == layers
    assert main(["build", str(tiny_qwen3), "--max-cache-length", "64", "--precision", "bf16",
                 "--recipe", RECIPE, "-o", str(tmp_path / "none.bundle")]) == 2
    assert "give INSTANCE_ID... or --all-instances" in capsys.readouterr().err


def test_bisection_finds_the_first_breaking_slot_in_log2_runs():
    from pipeline.gates.correctness import first_breaking
    keys = [f"id:layer{i}" for i in range(36)]
    seen = []

    def breaks(subset):  # layer 20's kernel breaks the tokens on its own
        seen.append(len(subset))
        return "id:layer20" in subset
    found = first_breaking(keys, breaks)
    assert found == {"slot": "id:layer20", "breaks_alone": True, "runs": len(seen), "slots": 36}
    assert len(seen) <= 7  # ceil(log2 36) prefixes, then the slot alone
    drift = first_breaking(keys, lambda subset: len(subset) >= 5)  # only together with others
    assert drift["slot"] == "id:layer4" and not drift["breaks_alone"]


def test_bisection_names_no_slot_when_the_native_regions_alone_break_the_tokens():
    """Every slot on its native region first: when the tokens break then too, the break is not
    the kernels' (rounding outside them, a near tie), and blaming a slot would be a guess."""
    from pipeline.gates.correctness import _report, locate
    keys = [f"id:layer{i}" for i in range(36)]
    assert locate(keys, lambda subset: True) == {
        "slot": None, "breaks_alone": None, "runs": 1, "slots": 36, "without_kernels_breaks": True}
    found = locate(keys, lambda subset: "id:layer20" in subset)
    assert found["slot"] == "id:layer20" and found["without_kernels_breaks"] is False
    report = _report("t", Comparison("decoder", DecoderThresholds(4), (DecoderCase(
        0, "p", False, (1,), (2,), "first mismatch at generated token 0", 0.0, None),)),
        None, [], None, locate(keys, lambda subset: True))
    assert not report.passed and "no slot is named" in report.message
    jsonio.validate(report.as_dict(), "gate_report", "correctness.json")


def test_predicted_ratio_from_region_timings():
    from pipeline.gates.performance import predicted_ratio
    from pipeline.gates.report_types import RegionOutputs, RegionTiming
    region = RegionTiming("b", "static", "perf_counter", "eager", 5, 0, 4096, 1e10, 4.096e-7,
                          native_median_s=2e-4, kernel_median_s=1e-4, kernel_speedup=2.0,
                          kernel_roofline_fraction=4.096e-3, native_roofline_fraction=2.048e-3,
                          outputs=RegionOutputs(5, 0.0, None))
    regions = [region] * 10  # 1 ms saved a step
    assert predicted_ratio(100.0, regions) == pytest.approx(0.01 / 0.009)
    assert predicted_ratio(100.0, []) is None
    assert predicted_ratio(1e4, regions) is None  # regions longer than the step: no prediction


@pytest.fixture(scope="module")
def instances_workspace(tmp_path_factory) -> Path:
    """One doit workspace for both functions of the kernel: the second run rebuilds from the
    binding on (the function is a binding's, not the DSO's), as a user's would."""
    return tmp_path_factory.mktemp("instances")


@pytest.mark.slow
@pytest.mark.xdist_group("instances_workspace")
@pytest.mark.parametrize("function", ["run", "run_slot1"])
def test_doit_gates_every_instance(tiny_qwen3, layers, instances_workspace, function):
    """The spec's `instances` form through doit: one slot per layer, every instance shadowed,
    probed and timed; a kernel wrong only in layer 1 fails, shadow execution and the bisection
    naming layer 1."""
    root, tmp_path = Path(__file__).resolve().parent.parent, instances_workspace
    spec = {"schema_version": 1, "name": "all_layers", "model": str(tiny_qwen3),
            "build": {**OPTIONS}, "engine_role": "decode",
            "selection": {"recipe": RECIPE, "instances": "all", "expect_count": layers},
            "kernel": {"source": str(root / "tests/kernels/decode_attention_one_slot.cu"),
                       "function": function},
            "gates": {"prompts": PROMPTS, "max_new_tokens": 4,
                      "perf": {"trials": 5, "warmup": 1, "threshold": 0.001}},
            "output": str(tmp_path / "out")}
    (tmp_path / "spec.json").write_bytes(orjson.dumps(spec))
    done = python_m("doit", "-f", root / "dodo.py", "--db-file", tmp_path / "doit.db",
                    f"spec={tmp_path / 'spec.json'}", cwd=root, stderr_to_stdout=True)
    keys = [f"{RECIPE}:decoder.layers.{i}.decode_attention" for i in range(layers)]
    assert (tmp_path / "out/reports/correctness.json").is_file(), done.stdout[-4000:]
    report = orjson.loads((tmp_path / "out/reports/correctness.json").read_bytes())
    assert [s["binding_id"] for s in report["probe"]["slots"]] == keys
    assert len(select.load_selection(tmp_path / "out/selection.json")) == layers
    if function == "run":
        assert done.returncode == 0, done.stdout[-4000:]
        assert report["passed"] and report["shadow"]["calls_checked"] > 0
        perf = orjson.loads((tmp_path / "out/reports/perf.json").read_bytes())
        assert [r["binding_id"] for r in perf["regions"]] == keys
        assert "predicted_ratio" in perf["summary"]
        verify = python_m("pipeline.cli", "gate", "verify", tmp_path / "out/promotion.json",
                          cwd=root)
        assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]
        assert orjson.loads((tmp_path / "out/promotion.json").read_bytes())["selection"]["slots"] == keys
        lines = [orjson.loads(x) for x in (tmp_path / "out/ledger.jsonl").read_bytes().splitlines()]
        assert [x["figures"]["slots"] for x in lines if x["event"] in ("correctness", "perf")][-2:] \
            == [keys, keys]
    else:
        assert done.returncode != 0 and not report["passed"]
        # shadow execution names the slot whose calls are wrong, and so does the bisection (the
        # kernel is wrong in the second call of a step, so layer 1 alone calls it rightly)
        assert report["shadow"]["slots_failed"] == [keys[1]]
        assert f"in 1 slot ({keys[1]})" in report["message"]
        assert report["bisection"] == {"slot": keys[1], "breaks_alone": False, "runs": 3,
                                       "slots": layers, "without_kernels_breaks": False}
        assert f"the first slot whose kernel breaks them: {keys[1]}" in report["message"]
        drift = {s["slot"]: s["relative"] for s in report["instance_drift"]["slots"]}
        assert drift[keys[0]] < 0.05 < drift[keys[1]]


@pytest.fixture(scope="module")
def all_layers_bundle(tiny_qwen3, snapshot, tmp_path_factory):
    receipts = select.from_recipe_instances(snapshot, RECIPE, "all")
    return receipts, build_bundle(str(tiny_qwen3), None, OPTIONS,
                                  tmp_path_factory.mktemp("all") / "all.bundle",
                                  selection=receipts, build_plans=False)


def _in_situ(all_layers_bundle, kernel: Path, function: str, folder: Path):
    from pipeline.families.workloads import DecoderWorkload
    from pipeline.gates.probe import run_in_situ
    from pipeline.gates.settings import GateSettings
    receipts, bundle = all_layers_bundle
    pipe = open_pipeline(bundle, binding(receipts[0], kernel, folder, function))
    return pipe, run_in_situ(pipe, DecoderWorkload.of(GateSettings(prompts=PROMPTS,
                                                                   max_new_tokens=3)))


@pytest.mark.slow
def test_drift_per_instance_names_the_slot_where_the_error_starts(all_layers_bundle, layers,
                                                                   qwen3_kernels, tmp_path):
    keys = [f"{RECIPE}:decoder.layers.{i}.decode_attention" for i in range(layers)]
    _, right = _in_situ(all_layers_bundle, qwen3_kernels["decode_attention"], "run", tmp_path)
    assert [s["slot"] for s in right.drift["slots"]] == keys and not right.drift["notes"]
    assert all(s["calls"] == 2 and s["relative"] < 0.05 for s in right.drift["slots"])  # 2 forced steps
    _, wrong = _in_situ(all_layers_bundle, qwen3_kernels["decode_attention_one_slot"], "run_slot1",
                        tmp_path)
    first, second = wrong.drift["slots"][:2]
    assert first["relative"] < 0.05 < second["relative"]


@pytest.mark.slow
def test_probe_runs_each_instance_on_its_own_inputs_and_sweeps_shapes_once_per_binding(
        all_layers_bundle, qwen3_kernels, tmp_path):
    from pipeline.gates.probe import region_probe
    pipe, situ = _in_situ(all_layers_bundle, qwen3_kernels["decode_attention"], "run", tmp_path)
    taken = situ.inputs
    assert sorted(taken) == sorted(pipe.regions)
    q0, q1 = (taken[k][0] for k in sorted(taken))
    assert not torch.equal(q0, q1)  # each layer its own query
    probe = region_probe(pipe, seed=1, in_situ=taken).to_json()
    assert probe["passed"]
    for slot in probe["slots"]:
        assert any(c["case"].startswith("in situ ") for c in slot["calls"])
    first, *others = probe["slots"]
    swept = {c["case"] for c in first["calls"]}
    assert len(swept) > 10  # every KV length class
    for slot in others:
        cases = {c["case"] for c in slot["calls"]}
        # the typical case, and the in-situ inputs as they were and perturbed afresh
        assert len(cases) == 3 and cases < swept | {c for c in cases if c.startswith("in situ ")}
        assert len(slot["calls"]) > 2 * len(cases)  # repeated, with drawn fills
        assert {c["name"]: c["evidence"] for c in slot["checks"]}["graph_capturable"] == \
            f"checked on {first['binding_id']}"


def test_a_pipeline_switches_its_slots_between_kernel_and_native_without_reopening(
        all_layers_bundle, qwen3_kernels, tmp_path):
    """The bisection's switch (the gate test above shows it finding layer 1 through it)."""
    receipts, bundle = all_layers_bundle
    bindings = binding(receipts[0], qwen3_kernels["decode_attention_one_slot"], tmp_path,
                       "run_slot1")
    logits = lambda p: torch.stack(p.teacher_forced_logits([3, 7, 11], [5, 9, 4]))  # noqa: E731
    on_native = logits(open_pipeline(bundle, bindings, kernels_in=(), in_process=True))
    pipe = open_pipeline(bundle, bindings, in_process=True)
    assert not torch.allclose(logits(pipe), on_native, atol=1e-3)  # wrong in layer 1
    # the graphs a GPU would have captured (a prefill's and the decode step's) replay the
    # kernels chosen at their capture: a switch drops them all (stand-ins here, on a CPU)
    pipe.kv_cache.graphs["decode"] = pipe.kv_cache.prefill_graphs["prefill", 3] = object()
    pipe.use_kernels(())
    assert not pipe.kv_cache.graphs and not pipe.kv_cache.prefill_graphs
    assert torch.equal(logits(pipe), on_native)
    pipe.use_kernels(pipe.regions)
    assert not torch.allclose(logits(pipe), on_native, atol=1e-3)
    with pytest.raises(UserError, match="kernels_in: 'nope' is not a slot of"):
        pipe.use_kernels(["nope"])


def test_a_reopened_pipeline_shares_the_verified_weights(all_layers_bundle, qwen3_kernels,
                                                           tmp_path):
    from pipeline.runtime.pipeline import reopen
    receipts, bundle = all_layers_bundle
    pipe = open_pipeline(bundle, binding(receipts[0], qwen3_kernels["decode_attention"], tmp_path,
                                         "run"), in_process=True)
    again = reopen(pipe, (), mode="eager")
    assert again.weights is pipe.weights and set(again.regions) == set(pipe.regions)
    forced = lambda p: torch.stack(p.teacher_forced_logits([3, 7, 11], [5, 9]))  # noqa: E731
    assert torch.equal(forced(again), forced(open_pipeline(bundle, binding(
        receipts[0], qwen3_kernels["decode_attention"], tmp_path, "run"), kernels_in=(),
        in_process=True)))
