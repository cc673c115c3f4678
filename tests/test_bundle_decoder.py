"""Decoder bundles: TensorRT-RTX builds both split-layout plans on the CPU (dynamic sequence length,
so the family's optimization profile is needed), and the bundle records each role's fingerprint."""
from pipeline.bundle.reader import Bundle
from pipeline.bundle.writer import build_bundle
from pipeline.families.capture import capture_role


def test_native_decoder_bundle_has_a_plan_per_role(tiny_qwen3, tmp_path):
    options = {"max_cache_length": 64}
    bundle = Bundle.open(build_bundle(str(tiny_qwen3), None, options, tmp_path / "q.bundle"))
    assert bundle.roles == ["prefill", "decode"]
    for role in bundle.manifest["roles"]:
        assert role["plan_note"] == "built" and (bundle.path / role["plan"]).stat().st_size > 0
        assert role["graph_fingerprint"] == capture_role(
            str(tiny_qwen3), None, role["role"], options).snapshot["fingerprint"]
