"""The encoder flow end to end on CPU: select, build native and slot-ready bundles, bind the
residual-add DSO, probe the region, and compare the embeddings with the native bundle."""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.kernels.manifest import write_manifest
from pipeline.gates.probe import region_probe
from pipeline.bundle import layout
from pipeline.bundle.reader import Bundle
from pipeline.bundle.writer import build_bundle
from pipeline.errors import UserError
from pipeline.graph import select
from pipeline.families.capture import capture_role
from pipeline.host import open_pipeline
from test_cli import trtmc

OPTIONS = {"precision": "fp16", "sequence_length": 64}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Kernels are promoted only behind gates.",
         "a"]


def _receipt(model, options=OPTIONS, binding_id="l0_residual"):
    snap = capture_role(str(model), None, "decode", options).snapshot
    node = next(n["id"] for n in snap["nodes"] if n["name"] == "encoder.layers.0.attention_residual_add")
    return select.select_region(snap, [node], binding_id=binding_id)


def _manifest(folder, receipt, library):
    shutil.copy(library, folder / library.name)
    return write_manifest(folder / f"{library.stem}.json", [receipt], folder / library.name)


@pytest.fixture(scope="module")
def flow(minilm_dir, byok_kernels, tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    receipt = _receipt(minilm_dir)
    native = build_bundle(str(minilm_dir), None, OPTIONS, root / "native.bundle")
    slot = build_bundle(str(minilm_dir), None, OPTIONS, root / "slot.bundle", selection=receipt)
    manifests = {name: _manifest(root, receipt, byok_kernels[name])
                 for name in ("residual_add", "residual_sub", "residual_add_nowrite")}
    return {"root": root, "receipt": receipt, "native": native, "slot": slot, "manifests": manifests}


def test_bundles_embed_small_weights_and_hold_one_slot(flow):
    native, slot = Bundle.open(flow["native"]), Bundle.open(flow["slot"])
    assert native.manifest["weights_mode"] == "embed"  # the default for a small checkpoint
    (role,) = native.manifest["roles"]
    assert role["plan"] == layout.plan_path("decode") and (flow["native"] / role["plan"]).stat().st_size > 0
    (srole,) = slot.manifest["roles"]
    assert srole["plan"] is None and "no plugin layers" in srole["plan_note"]
    assert [s["binding_id"] for s in slot.slots] == ["l0_residual"]
    assert slot.slots[0]["abi_sha256"] == flow["receipt"].abi_sha256
    assert not list(flow["slot"].rglob("*.so")), "a bundle never contains a kernel DSO"
    types = [layer["type"] for layer in slot.network("decode")["layers"]]
    assert types.count("SLOT") == 1
    assert len(types) == len(native.network("decode")["layers"])  # one node out, one slot in


def test_bound_residual_add_matches_native(flow):
    native = open_pipeline(flow["native"], None, "cpu")
    external = open_pipeline(flow["slot"], flow["manifests"]["residual_add"], "cpu")
    for a, b in zip(native.embed(TEXTS), external.embed(TEXTS)):
        assert a.shape == b.shape == (64, 384)
        assert float((a.float() - b.float()).abs().max()) <= 0.02
        assert float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0)) >= 0.999


@pytest.mark.slow
def test_wrong_kernel_changes_the_embedding(flow):
    native = open_pipeline(flow["native"], None, "cpu")
    wrong = open_pipeline(flow["slot"], flow["manifests"]["residual_sub"], "cpu")
    (a,), (b,) = native.embed(TEXTS[:1]), wrong.embed(TEXTS[:1])
    assert float((a.float() - b.float()).abs().max()) > 0.02


def test_probe_passes_the_right_kernel_and_flags_wrong_ones(flow):
    good = region_probe(open_pipeline(flow["slot"], flow["manifests"]["residual_add"], "cpu"))
    assert good.passed and good.slots[0].max_abs_diff <= good.slots[0].tolerance
    sub = region_probe(open_pipeline(flow["slot"], flow["manifests"]["residual_sub"], "cpu"))
    assert not sub.passed and sub.slots[0].unwritten_elements == 0
    nowrite = region_probe(open_pipeline(flow["slot"], flow["manifests"]["residual_add_nowrite"], "cpu"))
    assert not nowrite.passed and nowrite.slots[0].unwritten_elements == 64 * 384


def test_slot_ready_bundle_needs_bindings_and_native_takes_none(flow):
    with pytest.raises(UserError, match="slot-ready and needs a binding manifest"):
        open_pipeline(flow["slot"], None, "cpu")
    with pytest.raises(UserError, match="has no kernel slots"):
        open_pipeline(flow["native"], flow["manifests"]["residual_add"], "cpu")


def test_a_constructed_pipeline_cannot_be_rebound(flow):
    pipe = open_pipeline(flow["slot"], flow["manifests"]["residual_add"], "cpu", in_process=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        pipe.kernels = {}
    with pytest.raises(TypeError):
        pipe.kernels["l0_residual"] = None
    with open_pipeline(flow["slot"], flow["manifests"]["residual_add"], "cpu") as hosted:
        with pytest.raises(TypeError):  # bound in its kernel host, once
            hosted.kernels["l0_residual"] = None


def test_stale_selection_is_refused(minilm_dir, tmp_path):
    receipt = _receipt(minilm_dir)
    with pytest.raises(UserError, match="recapture after changing the revision or graph-producing options"):
        build_bundle(str(minilm_dir), None, {**OPTIONS, "sequence_length": 32}, tmp_path / "x.bundle",
                     selection=receipt, build_plans=False)
    assert not (tmp_path / "x.bundle").exists()


@pytest.mark.slow
def test_weight_stripped_bundle_checks_digests(minilm_dir, tmp_path):
    ck = tmp_path / "minilm"
    shutil.copytree(minilm_dir, ck)
    bundle = build_bundle(str(ck), None, OPTIONS, tmp_path / "ref.bundle", weights="reference")
    b = Bundle.open(bundle)
    assert b.manifest["weights"]["encoder.layer.0.attention.self.query.weight"]["storage"] == "referenced"
    assert (bundle / layout.WEIGHTS).stat().st_size < 1 << 20  # only computed constants embedded
    ref = open_pipeline(bundle, None, "cpu").embed(TEXTS[:1])[0]
    assert ref.shape == (64, 384)
    tensors = load_file(str(ck / "model.safetensors"))
    tensors["encoder.layer.0.attention.self.query.weight"][0, 0] += 1.0  # same header, other bytes
    save_file(tensors, str(ck / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match="encoder.layer.0.attention.self.query.weight.*digest"):
        open_pipeline(bundle, None, "cpu")


@pytest.mark.slow
def test_embed_cli_prints_the_flattened_hidden_state(flow):
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "embed", str(flow["slot"]),
                           "--kernel-bindings", str(flow["manifests"]["residual_add"]),
                           "--device", "cpu", "--prompt", "hello world"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["shape"] == [64, 384] and len(out["embedding"]) == 64 * 384
    assert "[embed]" in proc.stderr and "[embed]" not in proc.stdout


def test_large_checkpoints_default_to_referenced_weights(minilm_dir, tmp_path, monkeypatch):
    from pipeline.bundle import writer
    monkeypatch.setattr(writer, "EMBED_LIMIT_BYTES", 1 << 20)  # MiniLM's 90 MB counts as large
    bundle = build_bundle(str(minilm_dir), None, OPTIONS, tmp_path / "big.bundle", build_plans=False)
    assert Bundle.open(bundle).manifest["weights_mode"] == "reference"


def test_bind_manifest_cli_writes_a_manifest_that_binds(flow, tmp_path):
    lib = tmp_path / "k" / "residual_add.so"
    lib.parent.mkdir()
    shutil.copy(flow["root"] / "residual_add.so", lib)
    sel = tmp_path / "sel.json"
    select.save_receipt(flow["receipt"], sel)
    rc, _, err = trtmc("bind", "manifest", sel, "--library", lib, "-o", tmp_path / "m.json")
    assert rc == 0, err
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["bindings"] == [{"id": "l0_residual", "abi_sha256": flow["receipt"].abi_sha256,
                                "library": "k/residual_add.so", "function": "run"}]
    assert region_probe(open_pipeline(flow["slot"], tmp_path / "m.json", "cpu")).passed


def test_bind_manifest_refuses_a_library_outside_its_folder(flow, tmp_path):
    with pytest.raises(UserError, match="must lie inside the manifest's folder"):
        write_manifest(tmp_path / "m.json", [flow["receipt"]], flow["root"] / "residual_add.so")
    assert not (tmp_path / "m.json").exists()
