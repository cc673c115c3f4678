"""The region probe and the gates on tiny models: every deliberately wrong kernel is refused by its
named check, the shape space follows the profile and the KV length, the gates re-poison slot
outputs, the decoder gate compares teacher-forced logits.

Where they run: everything here runs on a CPU except the tests marked `gpu` (the CUDA-only checks
ordered_on_stream and graph_capturable, and the probe on CUDA tensors), skipped without a GPU.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline import jsonio
from pipeline.bundle.writer import build_bundle
from pipeline.errors import UserError
from pipeline.families.capture import capture_role
from pipeline.gates import PERF_DEFAULTS
from pipeline.gates.correctness import run_correctness_gate
from pipeline.gates.performance import run_perf_gate
from pipeline.gates.probe import CALLS, FALLBACK_DIMS, region_probe, shape_cases, workspace
from pipeline.graph import select
from pipeline.kernels.manifest import write_manifest
from pipeline.runtime.pipeline import open_pipeline

ROOT = Path(__file__).resolve().parent.parent
FP16 = {"precision": "fp16", "sequence_length": 16}
TEXTS = ["Hello world!", "The cat sat on the mat."]
PERF = {**PERF_DEFAULTS, "trials": 6, "warmup": 1, "threshold": 0.05}


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
    (slot,) = report["slots"]
    return slot, {c["name"]: c for c in slot["checks"]}


def test_right_kernel_passes_every_check_and_states_the_rule(encoder, byok_kernels, tmp_path):
    report = region_probe(bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add"],
                                tmp_path), seed=3)
    slot, checks = _slot(report)
    assert report["passed"] and slot["failed_checks"] == []
    assert (slot["atol"], slot["rtol"]) == (1e-3, 1e-3) and slot["max_abs_diff"] <= slot["tolerance"]
    assert len(slot["calls"]) == CALLS and len({c["seed"] for c in slot["calls"]}) == CALLS
    assert all(c["passed"] is True for n, c in checks.items()
               if n not in ("ordered_on_stream", "graph_capturable"))
    for name in ("ordered_on_stream", "graph_capturable"):  # CUDA only: recorded as not run
        assert checks[name]["passed"] is None and "CUDA only" in checks[name]["evidence"]


@pytest.mark.parametrize("kernel,check,evidence", [
    ("residual_add_off", "within_tolerance", "|diff| 0.05"),
    ("residual_add_writes_input", "inputs_unchanged", "input[1] 1024 elements"),
    ("residual_add_partial", "output_fully_written", "left 512 output elements unwritten"),
    ("residual_add_nowrite", "output_fully_written", "left 1024 output elements unwritten"),
    ("residual_add_nan", "finite_where_native_is", "1 NaN/Inf where native is finite"),
    ("residual_add_first_n", "stable_across_calls", "right for its first 8 calls only"),
    ("residual_sub", "within_tolerance", "vs allowed"),
])
def test_each_wrong_kernel_is_refused_by_its_named_check(encoder, byok_kernels, tmp_path, kernel,
                                                         check, evidence):
    report = region_probe(bound(encoder["slot"], encoder["receipt"], byok_kernels[kernel], tmp_path))
    slot, checks = _slot(report)
    assert not report["passed"] and check in slot["failed_checks"]
    assert evidence in checks[check]["evidence"], checks[check]["evidence"]
    if kernel != "residual_add_first_n":  # it also leaves its output unwritten from call 8 on
        assert slot["failed_checks"] == [check]


def test_an_offset_inside_the_old_global_tolerance_now_fails(encoder, byok_kernels, tmp_path):
    """0.05 everywhere passed the old rule (1e-2 * max |expected| for FP16); per element it fails."""
    slot, _ = _slot(region_probe(bound(encoder["slot"], encoder["receipt"],
                                       byok_kernels["residual_add_off"], tmp_path)))
    w = slot["worst"]["worst"]
    assert w["abs_diff"] == pytest.approx(0.05, abs=2e-3) and w["abs_diff"] > w["allowed"]
    old_tolerance = 1e-2 * max(1.0, (slot["tolerance"] - slot["atol"]) / slot["rtol"])
    assert slot["max_abs_diff"] <= old_tolerance


def test_a_reused_slot_buffer_hides_a_kernel_that_stops_writing_unless_repoisoned(
        encoder, byok_kernels, tmp_path):
    plain = bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add_first_n"],
                  tmp_path / "plain")
    gated = bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add_first_n"],
                  tmp_path / "gated", poison_slot_outputs=True)
    ref = open_pipeline(encoder["native"]).embed(TEXTS[:1])[0]
    stale = [plain.embed(TEXTS[:1])[0].clone() for _ in range(10)]
    assert all(torch.allclose(s.float(), ref.float(), atol=0.02) for s in stale)  # the hole
    fresh = [gated.embed(TEXTS[:1])[0].clone() for _ in range(10)]
    assert all(torch.isfinite(f).all() for f in fresh[:8]) and not torch.isfinite(fresh[9]).all()


def test_gates_refuse_a_kernel_right_only_for_its_first_calls(encoder, byok_kernels, tmp_path):
    native = open_pipeline(encoder["native"])
    for gate, kwargs in ((run_correctness_gate, {"max_abs_diff": 0.02, "min_cosine": 0.999,
                                                 "probe_seed": 0}),
                         (run_perf_gate, PERF)):
        external = bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add_first_n"],
                         tmp_path / gate.__name__, poison_slot_outputs=True)
        report = gate("t", native, external, TEXTS, max_new_tokens=1, **kwargs)
        assert not report["passed"], report["message"]
    assert "timed outputs differ from native" in report["message"]  # the perf gate's reason
    with pytest.raises(UserError, match="poison_slot_outputs=True"):
        run_perf_gate("t", native, bound(encoder["slot"], encoder["receipt"],
                                         byok_kernels["residual_add"], tmp_path / "plain"),
                      TEXTS, max_new_tokens=1, **PERF)


def test_encoder_gate_reports_real_token_figures(encoder, byok_kernels, tmp_path):
    native = open_pipeline(encoder["native"])
    external = bound(encoder["slot"], encoder["receipt"], byok_kernels["residual_add"], tmp_path,
                     poison_slot_outputs=True)
    report = run_correctness_gate("t", native, external, TEXTS, max_new_tokens=1,
                                  max_abs_diff=0.02, min_cosine=0.999, probe_seed=0)
    assert report["passed"]
    assert [c["real_tokens"] for c in report["cases"]] == [5, 9]  # [CLS] ... [SEP], no padding
    assert all(c["real_cosine"] > 0.999 and c["seconds"] > 0 for c in report["cases"])


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
    assert [c["dim"] for c in cases] == [1, 128, 256] and notes == []
    report = region_probe(pipe)
    slot, _ = _slot(report)
    assert report["passed"] and slot["rtol"] == 1.6e-2
    assert {tuple(c["output_shape"]) for c in slot["calls"]} == {(1, 64), (128, 64), (256, 64)}
    unprofiled = SimpleNamespace(bundle=pipe.bundle, family=SimpleNamespace(
        profile=lambda role, options: {}, io=pipe.family.io))
    cases, notes = shape_cases(unprofiled, region)
    assert [c["dim"] for c in cases] == list(FALLBACK_DIMS) and "capped max" in notes[0]


@pytest.fixture(scope="module")
def decoder(tiny_qwen3, tmp_path_factory):
    """Tiny Qwen3 (split, cache 64): native bundle, decode-attention and logits slot bundles."""
    from pipeline.kernels.build import build_kernel
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
    out["attention_kernel"] = build_kernel(ROOT / "examples/byok/decode_attention.cu",
                                           root / "decode_attention.so", cuda=False)
    return out


def test_kv_length_is_probed_from_one_to_the_cache_capacity(decoder, tmp_path):
    bundle, receipt = decoder["attention"]
    pipe = bound(bundle, receipt, decoder["attention_kernel"], tmp_path)
    cases, notes = shape_cases(pipe, next(iter(pipe.regions.values())))
    assert [(c["dim"], c["kv_length"]) for c in cases] == [(1, 1), (1, 32), (1, 64)]
    assert "KV length" in notes[0] and "capacity 64" in notes[0]
    report = region_probe(pipe)
    assert report["passed"], _slot(report)[0]["failed_checks"]


def test_decoder_gate_compares_teacher_forced_logits(decoder, byok_kernels, tmp_path):
    bundle, receipt = decoder["logits"]
    native = open_pipeline(decoder["native"])
    external = bound(bundle, receipt, byok_kernels["identity_copy"], tmp_path,
                     poison_slot_outputs=True)
    report = run_correctness_gate("q", native, external, ["the cat sat on", "tensor cores"],
                                  max_new_tokens=6, max_abs_diff=0.02, min_cosine=0.999, probe_seed=0)
    assert report["passed"], report["message"]
    for case in report["cases"]:
        tf = case["teacher_forced"]
        assert len(tf["steps"]) == len(case["native_tokens"]) == 6
        assert tf["top1_agreement"] == 1.0 and tf["max_abs_logit_diff"] == 0.0
        assert tf["max_kl"] == pytest.approx(0.0, abs=1e-12) and tf["divergence"] is None


# -- CUDA ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_kernels(tmp_path_factory):
    from pipeline.kernels.build import build_kernel
    out = tmp_path_factory.mktemp("cuda_kernels")
    sources = {"residual_add": "examples/byok/residual_add.cu",
               **{k: f"tests/kernels/{k}.cu" for k in (
                   "residual_add_own_stream", "residual_add_syncs", "residual_add_first_n",
                   "residual_add_partial", "residual_add_nan", "residual_add_off",
                   "residual_add_writes_input")}}
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
                                "cuda"))
    slot, checks = _slot(report)
    assert slot["failed_checks"] == failed, [checks[n]["evidence"] for n in slot["failed_checks"]]
    assert checks["ordered_on_stream"]["passed"] is not None  # ran: this is a CUDA probe


@pytest.mark.gpu
def test_cuda_gates_refuse_a_kernel_right_only_for_its_first_calls(encoder, cuda_kernels, tmp_path):
    """Eager: an optimized pipeline replays one captured (right) launch, whatever the host does."""
    native = open_pipeline(encoder["native"], device="cuda", mode="eager")
    external = bound(encoder["slot"], encoder["receipt"], cuda_kernels["residual_add_first_n"],
                     tmp_path, "cuda", poison_slot_outputs=True, mode="eager")
    report = run_perf_gate("t", native, external, TEXTS, max_new_tokens=1, **PERF)
    assert not report["passed"] and "timed outputs differ" in report["message"]
    jsonio.validate(report, "gate_report", "the report")  # as the perf stage writes it
    (region,) = report["regions"]
    assert region["timer"] == "cuda_events" and region["l2_flush_bytes"] >= 256 << 20


@pytest.mark.gpu
def test_optimized_region_timing_runs_both_arms_as_the_engine_does(encoder, cuda_kernels, tmp_path):
    """The optimized engine compiles the native region and replays every step from a graph: the
    region timing does the same to both arms (an eager native arm would flatter the kernel)."""
    native = open_pipeline(encoder["native"], device="cuda", mode="optimized")
    external = bound(encoder["slot"], encoder["receipt"], cuda_kernels["residual_add"], tmp_path,
                     "cuda", poison_slot_outputs=True, mode="optimized")
    (region,) = run_perf_gate("t", native, external, TEXTS, max_new_tokens=1, **PERF)["regions"]
    assert region["engine"] == "compiled + CUDA graph"
    eager = bound(encoder["slot"], encoder["receipt"], cuda_kernels["residual_add"],
                  tmp_path / "eager", "cuda", poison_slot_outputs=True, mode="eager")
    (region,) = run_perf_gate("t", open_pipeline(encoder["native"], device="cuda", mode="eager"),
                              eager, TEXTS, max_new_tokens=1, **PERF)["regions"]
    assert region["engine"] == "eager"


def test_probe_workspace_is_poisoned_scratch_not_zeros():
    """The probe hands a kernel the scratch the engines do: undefined (all WORKSPACE_POISON), never
    the zeros a kernel might wrongly rely on; no workspace when the ABI has none."""
    from pipeline import dtypes
    ws = workspace(SimpleNamespace(abi={"workspace_bytes": 64}), torch.device("cpu"))
    assert ws.dtype == torch.uint8 and ws.numel() == 64 and bool((ws == dtypes.WORKSPACE_POISON).all())
    assert workspace(SimpleNamespace(abi={"workspace_bytes": 0}), torch.device("cpu")) is None
