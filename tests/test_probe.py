"""The region probe and the gates on tiny models: every deliberately wrong kernel is refused by its
named check, the shape space covers every length class of the profile and the KV length, the
correctness gate checks every slot call by shadow execution, the decoder gate compares
teacher-forced logits.

Where they run: everything here runs on a CPU except the tests marked `gpu` (the CUDA-only checks
ordered_on_stream and graph_capturable, and the probe on CUDA tensors), skipped without a GPU.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline import jsonio
from pipeline.bundle.reader import Bundle
from pipeline.bundle.writer import build_bundle
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.families.capture import capture_role
from pipeline.families.cases import DecoderCase, EncoderCase
from pipeline.families.workloads import DecoderWorkload, EncoderWorkload
from pipeline.gates.correctness import run_correctness_gate
from pipeline.gates.performance import run_perf_gate
from pipeline.gates.settings import CorrectnessSettings, GateSettings, PerfSettings
from pipeline.gates.harness import (FALLBACK_DIMS, length_classes, shape_cases, shape_space,
                                    workspace)
from pipeline.gates.probe import region_probe
from pipeline.graph import select
from pipeline.kernels.manifest import write_manifest
from pipeline.host import open_pipeline
from pipeline.runtime.pipeline import open_pipeline as open_pipeline_here, open_regions
from tests.conftest import process_gone

ROOT = Path(__file__).resolve().parent.parent
FP16 = {"precision": "fp16", "sequence_length": 16}
TEXTS = ["Hello world!", "The cat sat on the mat."]
SEED0 = GateSettings(correctness=CorrectnessSettings(probe_seed=0))
PERF = GateSettings(perf=PerfSettings(trials=6, warmup=1, threshold=0.001))


def _residual_receipt(model, options, role="decode", name="encoder.layers.0.attention_residual_add",
                      **kwargs):
    snap = capture_role(str(model), None, role, options).snapshot
    node = next(n["id"] for n in snap["nodes"] if n["name"] == name)
    return select.select_region(snap, [node], binding_id="res", **kwargs)


@pytest.fixture(scope="module")
def encoder(tiny_distilbert, tmp_path_factory):
    """FP16 tiny DistilBERT: native and slot-ready bundles (layer-0 attention residual add)."""
    root = tmp_path_factory.mktemp("probe_encoder")
    receipt = _residual_receipt(tiny_distilbert, FP16)
    return {"receipt": receipt,
            "native": build_bundle(str(tiny_distilbert), None, FP16, root / "native.bundle",
                                   build_plans=False),
            "slot": build_bundle(str(tiny_distilbert), None, FP16, root / "slot.bundle",
                                 selection=receipt, build_plans=False)}


def bound(bundle, receipt, library: Path, folder: Path, device="cpu", **kwargs):
    """A pipeline over a library of its own: a kernel that counts its calls starts at 0. The same
    bytes are one library per process, so the copy gets the folder's name appended past the ELF's
    end (the loader maps only what the headers name)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "k.so").write_bytes(Path(library).read_bytes() + str(folder).encode())
    return open_pipeline(bundle, write_manifest(folder / "m.json", [receipt], folder / "k.so"),
                         device, **kwargs)


def _slot(report):
    """The one slot of a probe.ProbeReport, as its report section reads, and its checks by name."""
    (slot,) = report.to_json()["slots"]
    return slot, {c["name"]: c for c in slot["checks"]}


def test_right_kernel_passes_every_check_and_states_the_rule(encoder, byok_kernels, tmp_path):
    report = region_probe(bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add"],
                                tmp_path), seed=3)
    slot, checks = _slot(report)
    assert report.passed and slot["failed_checks"] == [] and report.seed == 3
    assert (slot["atol"], slot["rtol"]) == (1e-3, 1e-3) and slot["max_abs_diff"] <= slot["tolerance"]
    n = len(slot["calls"])
    assert n > 8 and len({c["seed"] for c in slot["calls"]}) == n
    assert {c["fill"] for c in slot["calls"]} >= {"nan", "random"}
    assert all(c["passed"] is True for n, c in checks.items()
               if n not in ("ordered_on_stream", "graph_capturable"))
    for name in ("ordered_on_stream", "graph_capturable"):  # CUDA only: recorded as not run
        assert checks[name]["passed"] is None and "CUDA only" in checks[name]["evidence"]


@pytest.mark.parametrize("kernel,check,evidence", [
    ("residual_add_off", "within_tolerance", "|diff| 0.05"),
    ("residual_add_writes_input", "inputs_unchanged", "wrote its inputs: input[1] 10"),
    ("residual_add_partial", "output_fully_written", "left 512 output elements unwritten"),
    ("residual_add_nowrite", "output_fully_written", "left 1024 output elements unwritten"),
    ("residual_add_nan", "finite_where_native_is", "1 NaN/Inf where native is finite"),
    ("residual_add_first_n", "stable_across_calls", "right for its first 8 calls only"),
    ("residual_sub", "within_tolerance", "vs allowed"),
])
def test_each_wrong_kernel_is_refused_by_its_named_check(encoder, byok_kernels, tmp_path, kernel,
                                                         check, evidence):
    pipe = bound(encoder["slot"], encoder["receipt"], byok_kernels[kernel], tmp_path)
    report = region_probe(pipe, seed=0)
    slot, checks = _slot(report)
    assert not report.passed and check in slot["failed_checks"]
    assert evidence in checks[check]["evidence"], checks[check]["evidence"]
    # a kernel that leaves elements unwritten is also off where the output held random values
    if kernel not in ("residual_add_first_n", "residual_add_partial", "residual_add_nowrite"):
        assert slot["failed_checks"] == [check]


def test_a_hosted_call_sends_back_only_the_inputs_the_kernel_changed(encoder, byok_kernels,
                                                                     tmp_path):
    """A probe call's caches are most of its bytes: an input the kernel left as it was does not
    cross the channel again, one it wrote does, as the kernel left it."""
    from pipeline.gates.harness import expected_output, random_inputs
    for kernel, written in (("residual_add", []), ("residual_add_writes_input", [1])):
        with bound(encoder["slot"], encoder["receipt"], byok_kernels[kernel],
                   tmp_path / kernel) as pipe:
            (region,) = pipe.regions.values()
            space = shape_space(pipe, region)
            inputs = random_inputs(region, pipe.family.io, space.typical,
                                   torch.Generator().manual_seed(0), pipe.device)
            got = pipe.ask("call", key=region.key, inputs=inputs, workspace=None,
                           out=torch.empty_like(expected_output(region, inputs)))
        assert [i for i, x in enumerate(got["inputs"]) if x is not None] == written
        for i in written:
            assert not torch.equal(got["inputs"][i], inputs[i])


def test_an_offset_within_a_whole_tensor_tolerance_fails_per_element(encoder, byok_kernels, tmp_path):
    """0.05 everywhere is within 1e-2 * max |expected| (FP16) of the whole tensor; per element it fails."""
    slot, _ = _slot(region_probe(bound(encoder["slot"], encoder["receipt"],
                                       byok_kernels["residual_add_off"], tmp_path), seed=0))
    w = slot["worst"]["worst"]
    assert w["abs_diff"] == pytest.approx(0.05, abs=2e-3) and w["abs_diff"] > w["allowed"]
    old_tolerance = 1e-2 * max(1.0, (slot["tolerance"] - slot["atol"]) / slot["rtol"])
    assert slot["max_abs_diff"] <= old_tolerance


@pytest.mark.slow
def test_a_reused_slot_buffer_hides_a_kernel_that_stops_writing_unless_shadowed(
        encoder, byok_kernels, tmp_path):
    """A kernel right for its first 8 calls, then writing nothing: a run's reused output buffer
    still holds call 8's result, so the embedding looks right; the shadow sees every later call
    differ from native (the ungated run and the shadowed one call the kernel the same way)."""
    plain = bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add_first_n"],
                  tmp_path / "plain")
    shadowed = bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add_first_n"],
                     tmp_path / "shadowed", shadow=True)
    ref = open_pipeline(encoder["native"]).embed(TEXTS[:1])[0]
    stale = [plain.embed(TEXTS[:1])[0].clone() for _ in range(10)]
    assert all(torch.allclose(s.float(), ref.float(), atol=0.02) for s in stale)  # the hole
    for text in TEXTS * 5:
        shadowed.embed([text])
    calls = shadowed.shadow.collect()
    # call 8 finds the buffer holding call 7's result, for the other text; call 9's text is
    # call 7's, so the stale result is the right one there
    assert [c["passed"] for c in calls] == [True] * 8 + [False, True]
    assert calls[8]["max_error_ratio"] > 1 and calls[8]["input_shapes"] == [[16, 64], [16, 64]]
    assert shadowed.shadow.collect() == []  # a fresh ledger


def test_gates_refuse_a_kernel_right_only_for_its_first_calls(encoder, byok_kernels, tmp_path):
    native = open_pipeline(encoder["native"])
    external = bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add_first_n"],
                     tmp_path / "shadowed", shadow=True)
    report = run_correctness_gate("t", native, external, EncoderWorkload(tuple(TEXTS * 5)), SEED0)
    shadow = report.correctness.shadow
    assert not report.passed and shadow.calls_checked == 10
    assert shadow.first_failure.item == 8, report.message
    assert "shadow execution: 1 of 10 slot calls differ" in report.message
    with pytest.raises(UserError, match="shadow=True"):
        run_correctness_gate("t", native, bound(encoder["slot"], encoder["receipt"],
                                                byok_kernels["residual_add"], tmp_path / "plain"),
                             EncoderWorkload(tuple(TEXTS)), SEED0)


def test_a_judge_lowers_its_regions_with_only_the_weights_they_read(tiny_distilbert, tmp_path,
                                                                    monkeypatch):
    """The judge of a pipeline whose engine runs in kernel hosts lowers each region as the
    pipeline does, reading only the weights the region uses: a gate holds the model in its
    hosts, not a third time beside them."""
    snap = capture_role(str(tiny_distilbert), None, "decode", FP16).snapshot
    names = ("transformer.layer.0.attention.q_lin.weight", "encoder.layers.0.attention.cast_0",
             "encoder.layers.0.attention.matrix_multiply_0")
    receipt = select.select_region(snap, [n["id"] for n in snap["nodes"] if n["name"] in names],
                                   binding_id="q")
    bundle = build_bundle(str(tiny_distilbert), None, FP16, tmp_path / "slot.bundle",
                          selection=receipt, build_plans=False)
    read = []
    weights = Bundle.weights
    monkeypatch.setattr(Bundle, "weights", lambda self, checkpoint=None, keys=None: (
        read.append(None if keys is None else sorted(keys)), weights(self, checkpoint, keys))[1])
    kernels = {"q": lambda *args: None}
    judged = open_regions(bundle, kernels)
    assert read == [[names[0]]]  # one weight of the bundle's 40
    whole = open_pipeline_here(bundle, kernels=kernels, in_process=True).regions
    assert read[1:] == [None] and list(judged) == list(whole) == ["q"]
    inputs = [torch.randn(s.shape, generator=torch.Generator().manual_seed(0)).to(s.torch_dtype)
              for s in judged["q"].native.input_specs]
    assert torch.equal(judged["q"].native.step(inputs)[0], whole["q"].native.step(inputs)[0])
    with pytest.raises(UserError, match="manifest.json: no weight 'nope'"):
        Bundle.open(bundle).weights(keys=["nope"])


@pytest.mark.slow
def test_region_timing_checks_every_kernel_call_it_times(encoder, byok_kernels, tmp_path, capsys):
    """The region timed alone: each call's output, poisoned before it, against the native rule;
    a right kernel is right at every call, one off by 0.05 is wrong from its first."""
    native = open_pipeline(encoder["native"])
    right = bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add"], tmp_path / "a")
    (region,) = run_perf_gate("t", native, right, EncoderWorkload(tuple(TEXTS)), PERF).perf.regions
    assert region.outputs.first_wrong_call is None and region.outputs.calls_checked == 7
    assert "local" not in vars(right)  # the judge opened no whole pipeline beside the hosts'
    off = bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add_off"], tmp_path / "b")
    report = run_perf_gate("t", native, off, EncoderWorkload(tuple(TEXTS)), PERF)
    (region,) = report.perf.regions
    assert region.outputs.first_wrong_call == 0 and region.outputs.max_error_ratio > 1
    assert not report.passed and "timed alone: the kernel's output differs" in report.message
    capsys.readouterr()
    rc = main(["bench", "region", str(encoder["slot"]), "--kernel-bindings",
               str(tmp_path / "b/m.json"), "--device", "cpu", "--trials", "2", "--warmup", "0"])
    out = capsys.readouterr().out
    assert rc == 1 and "  WRONG output from call 0 (error ratio " in out, out


def test_encoder_gate_reports_real_token_figures(encoder, byok_kernels, tmp_path):
    native = open_pipeline(encoder["native"])
    external = bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add"], tmp_path,
                     shadow=True)
    report = run_correctness_gate("t", native, external, EncoderWorkload(tuple(TEXTS)), SEED0)
    cases = report.correctness.cases
    assert report.passed
    assert all(isinstance(c, EncoderCase) for c in cases)
    assert [c.real_tokens for c in cases] == [5, 9]  # [CLS] ... [SEP], no padding
    assert all(c.real_cosine > 0.999 and c.seconds > 0 for c in cases)


def test_dynamic_dims_follow_the_profile_or_fall_back_and_say_so(tiny_qwen3, byok_kernels, tmp_path):
    """A residual add in a Qwen3 prefill engine: [S, H] with S in the profile (1, 128, 256)."""
    options = {"max_cache_length": 256, "decoder_engine_layout": "split", "precision": "bf16"}
    receipt = _residual_receipt(tiny_qwen3, options, "prefill",
                                "decoder.layers.0.attention_residual_add", output_shape_like_input=0)
    bundle = build_bundle(str(tiny_qwen3), None, options, tmp_path / "slot.bundle",
                          selection=receipt, build_plans=False)
    pipe = bound(bundle, receipt, byok_kernels["residual_add"], tmp_path / "k")
    region = pipe.regions["res"]
    cases, notes = shape_cases(pipe, region)
    dims = [c["dim"] for c in cases]
    assert dims == length_classes(1, 256) == list(range(1, 257)) and notes == []  # every length
    report = region_probe(pipe, seed=0, seen={"res": (25,)})
    slot, _ = _slot(report)
    assert report.passed and slot["rtol"] == 1.6e-2
    shapes = {tuple(c["output_shape"]) for c in slot["calls"]}
    assert {(d, 64) for d in dims} <= shapes
    assert slot["coverage"]["dims"] == {"range": [1, 256], "lengths": 256, "every_length": True,
                                        "residues": {str(m): 1.0 for m in (8, 16, 32, 64, 128)}}
    unprofiled = SimpleNamespace(bundle=pipe.bundle, family=SimpleNamespace(
        profile=lambda role, options: {}, io=pipe.family.io))
    cases, notes = shape_cases(unprofiled, region)
    assert [c["dim"] for c in cases] == length_classes(FALLBACK_DIMS[0], FALLBACK_DIMS[-1])
    assert "capped max" in notes[0]


def test_a_long_range_is_probed_at_every_length_class_and_a_drawn_length_of_every_residue():
    """Past harness.EVERY_LENGTH lengths: the fixed classes, and for each residue modulo 128 one
    drawn length, so a fault tied to any residue modulo 8 to 128 is met; another seed, other
    lengths."""
    import random

    from pipeline.gates.harness import coverage
    lengths = length_classes(1, 4096, random.Random(0))
    assert {1, 2, 3, 7, 31, 32, 33, 127, 128, 129, 4095, 4096} <= set(lengths)
    assert {n % 128 for n in lengths} == set(range(128))
    assert length_classes(1, 4096, random.Random(1)) != lengths
    said = coverage(lengths, 1, 4096)
    assert said["every_length"] is False and said["lengths"] == len(lengths) < 300
    assert said["residues"] == {str(m): 1.0 for m in (8, 16, 32, 64, 128)}
    assert coverage([1, 2, 3], 1, 4096)["residues"]["8"] == 3 / 8


@pytest.fixture(scope="module")
def decoder(tiny_qwen3, kernel_builds, tmp_path_factory):
    """Tiny Qwen3 (split, cache 64): native bundle, decode-attention and logits slot bundles."""
    root = tmp_path_factory.mktemp("probe_decoder")
    options = {"max_cache_length": 64, "decoder_engine_layout": "split", "precision": "bf16"}
    out = {"native": build_bundle(str(tiny_qwen3), None, options, root / "native.bundle",
                                  build_plans=False)}
    snap = capture_role(str(tiny_qwen3), None, "decode", options).snapshot
    for key, recipe, instance in (("attention", "qwen.decode_attention_region@2",
                                   "decoder.layers.1.decode_attention"),
                                  ("logits", "qwen.decode_logits_copy@1", "decoder.logits_zero_bias")):
        receipt = select.from_recipe(snap, recipe, instance)
        out[key] = (build_bundle(str(tiny_qwen3), None, options, root / f"{key}.bundle",
                                 selection=receipt, build_plans=False), receipt)
    out["attention_kernel"] = kernel_builds("examples/byok/decode_attention.cu")
    return out


@pytest.mark.slow
def test_kv_length_is_probed_from_one_to_the_cache_capacity(decoder, tmp_path):
    bundle, receipt = decoder["attention"]
    pipe = bound(bundle, receipt, decoder["attention_kernel"], tmp_path)
    cases, notes = shape_cases(pipe, next(iter(pipe.regions.values())))
    assert [(c["dim"], c["kv_length"]) for c in cases] == [(1, n) for n in length_classes(1, 64)]
    assert "KV length" in notes[0] and "1..64 (the cache capacity)" in notes[0]
    report = region_probe(pipe, seed=0)
    assert report.passed, _slot(report)[0]["failed_checks"]


def test_decoder_gate_compares_teacher_forced_logits(decoder, byok_kernels, tmp_path):
    bundle, receipt = decoder["logits"]
    native = open_pipeline(decoder["native"])
    external = bound(bundle, receipt, byok_kernels["identity_copy"], tmp_path, shadow=True)
    report = run_correctness_gate("q", native, external,
                                  DecoderWorkload(("the cat sat on", "tensor cores"), 6), SEED0)
    assert report.passed, report.message
    for case in report.correctness.cases:
        assert isinstance(case, DecoderCase) and case.teacher_forced is not None
        tf = case.teacher_forced
        assert len(tf.steps) == len(case.native_tokens) == 6
        assert tf.top1_agreement == 1.0 and tf.max_abs_logit_diff == 0.0
        assert tf.max_kl == pytest.approx(0.0, abs=1e-12) and tf.divergence is None


def test_the_native_run_of_an_optimized_gates_in_situ_case_makes_no_merged_weights(decoder, tmp_path):
    """A hosted gate's native in-situ run is an eager one: the pipeline it is reopened from is
    opened eager, so it makes none of the optimized mode's merged GEMM weights (for Qwen3-8B
    9 GB beside the model's, which ran an 80 GB GPU out of memory), while the gate's own
    optimized pipelines do."""
    from pipeline.host.client import HostSpec
    from pipeline.host.hosted import HostedPipeline
    from pipeline.modes import Mode
    bundle, receipt = decoder["attention"]
    (tmp_path / "k.so").write_bytes(Path(decoder["attention_kernel"]).read_bytes())
    manifest = write_manifest(tmp_path / "m.json", [receipt], tmp_path / "k.so")
    merged = lambda p: {n for prog in p.programs.values() for n in prog.plan.constants  # noqa: E731
                        if n.startswith("weight:")}
    with HostedPipeline(HostSpec(bundle, manifest, "cpu", mode="optimized"), what="correctness gate") as pipe:
        assert pipe.mode is Mode.OPTIMIZED and pipe.local.mode is Mode.EAGER and not merged(pipe.local)
    assert merged(open_pipeline(bundle, manifest, "cpu", mode="optimized", in_process=True))


# -- CUDA ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_kernels(tmp_path_factory):
    from pipeline.kernels.build import build_kernel
    out = tmp_path_factory.mktemp("cuda_kernels")
    sources = {"residual_add": "examples/byok/residual_add.cu",
               **{k: f"tests/kernels/{k}.cu" for k in (
                   "residual_add_own_stream", "residual_add_syncs", "residual_add_first_n",
                   "residual_add_partial", "residual_add_nan", "residual_add_off",
                   "residual_add_writes_input", "residual_add_sees_poison",
                   "residual_add_late_offset", "residual_add_gpu_hang")}}
    return {k: build_kernel(ROOT / s, out / f"{k}.so", cuda=True) for k, s in sources.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,failed", [
    ("residual_add", []),
    ("residual_add_own_stream", ["ordered_on_stream", "graph_capturable"]),
    ("residual_add_syncs", ["graph_capturable"]),
    ("residual_add_off", ["within_tolerance"]),
    ("residual_add_writes_input", ["inputs_unchanged"]),
    ("residual_add_partial", ["output_fully_written"]),
    ("residual_add_nan", ["finite_where_native_is"]),
])
def test_cuda_checks_refuse_kernels_off_the_callers_stream_or_uncapturable(
        encoder, cuda_kernels, tmp_path, kernel, failed):
    report = region_probe(bound(encoder["slot"], encoder["receipt"], cuda_kernels[kernel], tmp_path,
                                "cuda"), seed=0)
    slot, checks = _slot(report)
    assert slot["failed_checks"] == failed, [checks[n]["evidence"] for n in slot["failed_checks"]]
    assert checks["ordered_on_stream"]["passed"] is not None  # ran: this is a CUDA probe


@pytest.mark.gpu
def test_cuda_gates_refuse_a_kernel_right_only_for_its_first_calls(encoder, cuda_kernels, tmp_path):
    """Eager: an optimized pipeline replays one captured (right) launch, whatever the host does."""
    native = open_pipeline(encoder["native"], device="cuda", mode="eager")
    external = bound(encoder["slot"], encoder["receipt"], cuda_kernels["residual_add_first_n"],
                     tmp_path, "cuda", mode="eager")
    report = run_perf_gate("t", native, external, EncoderWorkload(tuple(TEXTS)), PERF)
    assert not report.passed and "timed outputs differ" in report.message
    jsonio.validate_written(report.as_dict(), "gate_report", "the report")  # as the stage writes it
    (region,) = report.perf.regions
    assert region.timer == "cuda_events" and region.l2_flush_bytes >= 256 << 20


@pytest.mark.gpu
def test_optimized_region_timing_runs_both_arms_as_the_engine_does(encoder, cuda_kernels, tmp_path):
    """The optimized engine compiles the native region and replays every step from a graph: the
    region timing does the same to both arms (an eager native arm would flatter the kernel)."""
    native = open_pipeline(encoder["native"], device="cuda", mode="optimized")
    external = bound(encoder["slot"], encoder["receipt"], cuda_kernels["residual_add"], tmp_path,
                     "cuda", mode="optimized")
    (region,) = run_perf_gate("t", native, external, EncoderWorkload(tuple(TEXTS)), PERF).perf.regions
    assert region.engine == "compiled + CUDA graph"
    eager = bound(encoder["slot"], encoder["receipt"], cuda_kernels["residual_add"],
                  tmp_path / "eager", "cuda", mode="eager")
    (region,) = run_perf_gate("t", open_pipeline(encoder["native"], device="cuda", mode="eager"),
                              eager, EncoderWorkload(tuple(TEXTS)), PERF).perf.regions
    assert region.engine == "eager"


def test_a_comparison_names_the_worst_and_first_non_finite_elements_by_index():
    from pipeline.gates.probe import compare
    expected = torch.zeros(2, 3, 4)
    got = expected.clone()
    got[1, 2, 3] = 0.5
    got[0, 1, 2] = float("nan")
    c = compare(got, expected, "FP32")
    assert c["worst"]["index"] == [1, 2, 3] and c["worst"]["got"] == 0.5
    assert c["first_non_finite"] == [0, 1, 2] and c["non_finite"] == 1
    assert compare(torch.tensor(1.0), torch.tensor(1.0), "FP32")["worst"]["index"] == []


def test_probe_workspace_is_poisoned_scratch_not_zeros():
    """The probe hands a kernel the scratch the engines do: undefined (all WORKSPACE_POISON), never
    the zeros a kernel might wrongly rely on; no workspace when the ABI has none."""
    from pipeline import dtypes
    ws = workspace(SimpleNamespace(abi={"workspace_bytes": 64}), torch.device("cpu"))
    assert ws.dtype == torch.uint8 and ws.numel() == 64 and bool((ws == dtypes.WORKSPACE_POISON).all())
    assert workspace(SimpleNamespace(abi={"workspace_bytes": 0}), torch.device("cpu")) is None


def test_each_probe_call_gets_its_fill_in_the_workspace_too():
    """No constant pattern marks a probe's call: the workspace holds the poison with the NaN fill,
    the bytes the kernel left with the previous-output fill, and fresh random bytes (the call's
    seed) with the random one."""
    from pipeline import dtypes
    from pipeline.gates.probe import _workspace
    region, cpu = SimpleNamespace(abi={"workspace_bytes": 256}), torch.device("cpu")
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    assert bool((_workspace(region, cpu, "nan", None, gen()) == dtypes.WORKSPACE_POISON).all())
    drawn = _workspace(region, cpu, "random", None, gen())
    assert torch.equal(drawn, _workspace(region, cpu, "random", None, gen()))
    assert len(drawn.unique()) > 100  # not a pattern
    left = torch.arange(256, dtype=torch.uint8)
    assert _workspace(region, cpu, "previous", left, gen()) is left
    assert not torch.equal(_workspace(region, cpu, "previous", None, gen()), left)  # the first call
    assert _workspace(SimpleNamespace(abi={"workspace_bytes": 0}), cpu, "random", None, gen()) is None


# -- kernels that try to game the gate ------------------------------------------------------------
def _gate(native, external, texts):
    return run_correctness_gate("t", native, external, EncoderWorkload(tuple(texts)),
                                GateSettings())


def test_a_kernel_that_recognises_the_poison_is_refused(encoder, byok_kernels, tmp_path):
    """Right only when its output holds a NaN: the end-to-end runs poison nothing, and the probe's
    random and previous-output fills see it wrong too."""
    native = open_pipeline(encoder["native"])
    external = bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add_sees_poison"],
                     tmp_path, shadow=True)
    # a seeded probe: a drawn plan holds a fill other than NaN all but once in thousands of runs
    report = run_correctness_gate("t", native, external, EncoderWorkload(tuple(TEXTS)), SEED0)
    shadow, (slot,) = report.correctness.shadow, report.correctness.probe_slots
    assert not report.passed and shadow.calls_failed == shadow.calls_checked == 2
    assert shadow.first_failure.max_abs_diff == pytest.approx(1.0, abs=0.01)
    assert "within_tolerance" in slot.failed_checks
    filled = {(c["fill"], c["passed"]) for c in slot.calls}
    assert {passed for fill, passed in filled if fill == "nan"} == {True}
    assert {passed for fill, passed in filled if fill != "nan"} == {False}


@pytest.mark.parametrize("kernel,figure", [("residual_add_late_offset", "max |diff| 0.00"),
                                           ("residual_add_late_input", "input elements changed")])
def test_a_kernel_that_goes_wrong_after_the_calls_it_counted_is_refused_at_that_call(
        encoder, byok_kernels, tmp_path, kernel, figure):
    """Right for its first 12 calls (a fixed-size probe made exactly 12), then off by 0.004 or
    zeroing an input: the end-to-end drift hides it, the shadow names call 12."""
    native = open_pipeline(encoder["native"])
    external = bound(encoder["slot"], encoder["receipt"], byok_kernels[kernel], tmp_path,
                     shadow=True)
    report = _gate(native, external, TEXTS * 8)
    shadow, probe = report.correctness.shadow, report.correctness.probe
    first = shadow.first_failure
    assert not report.passed and shadow.calls_checked == 16
    assert (first.item, first.call) == (12, 0) and shadow.calls_failed == 4
    assert "shadow execution: 4 of 16 slot calls differ" in report.message
    assert figure in report.message, report.message
    assert probe.seed > 0 and not probe.passed  # drawn, and caught


@pytest.fixture(scope="module")
def prefill(tiny_qwen3, tmp_path_factory):
    """Tiny Qwen3, split layout: native bundle, and layer 0's prefill residual add as a slot
    ([S, H], S dynamic up to 256)."""
    root = tmp_path_factory.mktemp("prefill")
    options = {"max_cache_length": 256, "decoder_engine_layout": "split", "precision": "bf16"}
    receipt = _residual_receipt(tiny_qwen3, options, "prefill",
                                "decoder.layers.0.attention_residual_add",
                                output_shape_like_input=0)
    return {"receipt": receipt,
            "native": build_bundle(str(tiny_qwen3), None, options, root / "native.bundle",
                                   build_plans=False),
            "slot": build_bundle(str(tiny_qwen3), None, options, root / "slot.bundle",
                                 selection=receipt, build_plans=False)}


@pytest.mark.slow
def test_a_kernel_that_skips_the_shapes_a_probe_used_not_to_try_is_refused(prefill, byok_kernels,
                                                                          tmp_path):
    """Writes nothing for 20 to 100 rows: the probe's length classes land there, and so does a
    prompt of that many tokens, whose prefill call the shadow checks."""
    pipe = bound(prefill["slot"], prefill["receipt"], byok_kernels["residual_add_skips_rows"],
                 tmp_path, shadow=True)
    slot, _ = _slot(region_probe(pipe, seed=0))
    wrong = {c["output_shape"][0] for c in slot["calls"] if not c["passed"]}
    assert not slot["passed"] and wrong and all(20 <= n <= 100 for n in wrong)
    assert {n for n in (31, 32, 33, 63, 64, 65)} <= wrong
    prompt = "the cat sat on the mat and looked at the dog " * 3
    report = run_correctness_gate("t", open_pipeline(prefill["native"]), pipe,
                                  DecoderWorkload((prompt,), 2), SEED0)
    first = report.correctness.shadow.first_failure
    assert not report.passed and 20 <= first.input_shapes[0][0] <= 100, report.message


@pytest.mark.parametrize("kernel,how,said", [
    ("residual_add_exit", "exit", "the kernel host exited with status 0"),
    ("residual_add_segv", "signal", "the kernel host was killed by SIGSEGV"),
    ("residual_add_hang", "timeout", "a kernel call did not return within 1 s"),
    ("residual_add_exit_at_load", "exit", "while at call 1 of loading a library"),
])
@pytest.mark.slow
def test_a_kernel_that_ends_crashes_or_hangs_its_process_is_one_error(encoder, byok_kernels,
                                                                      tmp_path, kernel, how, said):
    from pipeline.host.client import HostSpec
    from pipeline.host.hosted import HostedPipeline
    from pipeline.isolation import KernelAborted, Limits
    (tmp_path / "k.so").write_bytes(byok_kernels[kernel].read_bytes())
    manifest = write_manifest(tmp_path / "m.json", [encoder["receipt"]], tmp_path / "k.so")
    with pytest.raises(KernelAborted) as caught:
        with HostedPipeline(HostSpec(encoder["slot"], manifest, "cpu"), what="probe",
                            limits=Limits(call_s=1.0)) as pipe:
            region_probe(pipe, seed=0)
    assert caught.value.how == how and said in str(caught.value), str(caught.value)
    assert str(caught.value).startswith("probe: ") and "\n" not in str(caught.value)


@pytest.mark.slow
def test_a_worker_whose_caller_died_while_it_started_does_no_work(tmp_path):
    """A spawned worker imports what its work needs before it can ask to die with its caller:
    a caller killed meanwhile must not leave it running that work (a gate's kernel, on its own)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    (tmp_path / "slow_import.py").write_text(
        "import time\ntime.sleep(2)\n\ndef work(path):\n    open(path, 'w').write('ran')\n")
    marker = tmp_path / "ran"
    caller = subprocess.Popen([sys.executable, "-c", (
        "import sys; sys.path.insert(0, sys.argv[1]); import slow_import\n"
        "from pipeline.isolation import run_isolated\n"
        "run_isolated(slow_import.work, sys.argv[2], what='work')"), str(tmp_path), str(marker)],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])))

    def children() -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and int((proc / "stat").read_bytes().rsplit(b")", 1)[1]
                                               .split()[1]) == caller.pid:
                    found.append(int(proc.name))
            except (OSError, IndexError, ValueError):
                continue
        return found
    deadline = time.monotonic() + 60
    while not children() and caller.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = children()
    assert workers, "the worker never started"
    caller.send_signal(signal.SIGKILL)  # the worker is still importing slow_import
    caller.wait()

    def gone() -> list[int]:
        return [pid for pid in workers if process_gone(pid)]
    deadline = time.monotonic() + 60  # the worker ends once past its import, with or without work
    while gone() != workers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone() == workers and not marker.exists()


@pytest.mark.slow
def test_nothing_a_worker_started_outlives_its_work(tmp_path):
    """Work in a worker (a kernel, in a gate) that starts processes of its own, a plain fork and
    the child of one that called setsid(), left behind, returns; none of them is left running to
    act later (say, to load the GPU during a later stage's timing)."""
    import subprocess
    import sys
    (tmp_path / "helpers.py").write_text(
        "import os, time\n"
        "def work(folder):\n"
        "    for escape in (False, True):\n"
        "        if os.fork() == 0:\n"
        "            if escape:\n"
        "                os.setsid()\n"
        "                if os.fork():\n"
        "                    os._exit(0)  # its child, orphaned after setsid()\n"
        "            open(f'{folder}/started.{os.getpid()}', 'w').close()\n"
        "            time.sleep(20)\n"
        "            os._exit(0)\n"
        "    while len(os.listdir(folder)) < 2:  # both running when the work returns\n"
        "        time.sleep(0.01)\n")
    caller = (
        "import os, sys, time; sys.path.insert(0, sys.argv[1]); import helpers\n"
        "from pipeline.isolation import run_isolated\n"
        "run_isolated(helpers.work, sys.argv[2], what='work')\n"
        "def running(pid):\n"
        "    try:\n"
        "        with open(f'/proc/{pid}/stat') as f:\n"
        "            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'\n"
        "    except FileNotFoundError:\n"
        "        return False\n"
        "pids = [int(name.split('.')[1]) for name in os.listdir(sys.argv[2])]\n"
        "deadline = time.monotonic() + 10  # a process killed a moment ago may take that to end\n"
        "while any(map(running, pids)) and time.monotonic() < deadline:\n"
        "    time.sleep(0.02)\n"
        "print(len(pids), [pid for pid in pids if running(pid)])\n")
    started = tmp_path / "started"
    started.mkdir()
    run = subprocess.run([sys.executable, "-c", caller, str(tmp_path), str(started)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["2", "[]"], f"a process the work started ran on after it: {run.stdout}"


def test_a_workers_result_is_read_as_json_and_bounded(tmp_path):
    """The result pipe of a worker (which runs the kernel's code) is never unpickled: a pickle
    written to it, which would run code here when loaded, is refused as not a result; one past
    RESULT_MAX_BYTES is refused unread."""
    import os
    import re
    import subprocess
    import sys
    (tmp_path / "helpers.py").write_text(
        "import gc, os\n"
        "from multiprocessing.connection import Connection\n"
        "class Evil:\n"
        "    def __reduce__(self):\n"
        "        return (open, (os.environ['MARKER'], 'w'))\n"
        "def forge():\n"
        "    (conn,) = [o for o in gc.get_objects() if isinstance(o, Connection) and o.writable]\n"
        "    conn.send(('ok', Evil()))\n"
        "    os._exit(0)\n"
        "def large():\n"
        "    return 'x' * 5000\n")
    caller = (
        "import sys; sys.path.insert(0, sys.argv[1]); import helpers\n"
        "from pipeline import isolation\n"
        "for fn, limit in ((helpers.forge, None), (helpers.large, 1000)):\n"
        "    isolation.RESULT_MAX_BYTES = limit or isolation.RESULT_MAX_BYTES\n"
        "    try:\n"
        "        isolation.run_isolated(fn, what='work')\n"
        "    except RuntimeError as e:\n"
        "        print(e)\n")
    marker = tmp_path / "unpickled"
    run = subprocess.run([sys.executable, "-c", caller, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "MARKER": str(marker)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert not marker.exists(), "the worker's pickle was loaded"
    forged, large = run.stdout.splitlines()
    assert re.fullmatch(r"work: the worker's result is not one it sends \(\d+ bytes\)", forged)
    assert large == ("work: the worker's result is longer than 1000 bytes "
                     "(pipeline.isolation.RESULT_MAX_BYTES)")


@pytest.mark.parametrize("command,kernel", [("bind", "residual_add_exit_at_load"),
                                            ("embed", "residual_add_exit"),
                                            ("bind", "residual_add_segv")])
@pytest.mark.slow
def test_commands_that_load_a_kernel_report_its_exit_or_crash_in_one_line(
        encoder, byok_kernels, tmp_path, command, kernel):
    """`trtmc bind check` and `trtmc embed --kernel-bindings` load the library in a kernel host: a
    library that exits while loading or in a call, or crashes, is exit status 1 and one line."""
    import subprocess
    import sys
    (tmp_path / "k.so").write_bytes(byok_kernels[kernel].read_bytes())
    manifest = write_manifest(tmp_path / "m.json", [encoder["receipt"]], tmp_path / "k.so")
    args = ["-q"] + (["bind", "check"] if command == "bind" else ["embed", "--prompt", "Hello"]) + [
        str(encoder["slot"]), "--kernel-bindings", str(manifest), "--device", "cpu"]
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True,
                          text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and proc.stdout == "" and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"trtmc: error: trtmc {command}: the kernel host "), lines[0]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "optimized"])
def test_cuda_correctness_gate_checks_every_call_in_both_modes(encoder, cuda_kernels, tmp_path,
                                                               mode):
    """The shadow ledger is written on the device, so calls replayed from a CUDA graph are
    checked too: a kernel that recognises the poison, or counts its launches on the device and
    goes wrong after 12, is refused in the optimized mode as in the eager one."""
    native = open_pipeline(encoder["native"], device="cuda", mode=mode)
    reports = {}
    for kernel in ("residual_add", "residual_add_sees_poison", "residual_add_late_offset"):
        external = bound(encoder["slot"], encoder["receipt"], cuda_kernels[kernel],
                         tmp_path / kernel, "cuda", mode=mode, shadow=True)
        reports[kernel] = _gate(native, external, TEXTS * 8)
    right = reports["residual_add"]
    assert right.passed, right.message
    assert right.correctness.shadow.calls_checked >= 16 and right.correctness.shadow.calls_failed == 0
    for kernel in ("residual_add_sees_poison", "residual_add_late_offset"):
        shadow = reports[kernel].correctness.shadow
        assert not reports[kernel].passed and shadow.first_failure is not None, kernel
    assert reports["residual_add_sees_poison"].correctness.shadow.first_failure.call == 0


@pytest.mark.gpu
def test_a_cuda_kernel_that_never_finishes_is_a_timeout(encoder, cuda_kernels, tmp_path):
    from pipeline.host.client import HostSpec
    from pipeline.host.hosted import HostedPipeline
    from pipeline.isolation import KernelAborted, Limits
    (tmp_path / "k.so").write_bytes(cuda_kernels["residual_add_gpu_hang"].read_bytes())
    manifest = write_manifest(tmp_path / "m.json", [encoder["receipt"]], tmp_path / "k.so")
    pipe = HostedPipeline(HostSpec(encoder["slot"], manifest, "cuda", "eager"), what="probe",
                          limits=Limits(call_s=2.0))
    with pytest.raises(KernelAborted) as caught:
        pipe.embed(["Hello world"])
    assert caught.value.how == "timeout", str(caught.value)
