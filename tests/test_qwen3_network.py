"""Qwen3 network structure: roles, inputs, recipes, and full-size Qwen3-8B capture from config alone."""
from __future__ import annotations

import pytest

from pipeline.errors import UserError
from pipeline.families.capture import capture_role
from pipeline.graph.select import from_recipe

ATTENTION, LOGITS = "qwen.decode_attention_region@2", "qwen.decode_logits_copy@1"


@pytest.mark.slow
def test_full_size_qwen3_8b_decode_captures_from_config_alone(qwen3_8b_config_dir):
    cap = capture_role(str(qwen3_8b_config_dir), None, "decode",
                       {"precision": "bf16", "max_cache_length": 40960,
                        "decoder_engine_layout": "split"})
    assert not cap.checkpoint.has_weights
    recipes = cap.snapshot["recipes"]
    attention = [r["instance_id"] for r in recipes if r["recipe_id"] == ATTENTION]
    assert attention == [f"decoder.layers.{i}.decode_attention" for i in range(36)]
    assert [r["instance_id"] for r in recipes if r["recipe_id"] == LOGITS] == ["decoder.logits_zero_bias"]
    receipt = from_recipe(cap.snapshot, ATTENTION, "decoder.layers.35.decode_attention")
    assert [(t.dtype, list(t.shape)) for t in receipt.inputs] == [
        ("BF16", [1, 32, -1, 128]), ("BF16", [1, 8, 40960, 128]), ("BF16", [1, 8, 40960, 128]),
        ("INT32", [1])]
    assert [(t.dtype, list(t.shape)) for t in receipt.outputs] == [("BF16", [1, 32, -1, 128])]
    assert receipt.output_shape_like_input == 0
    logits = from_recipe(cap.snapshot, LOGITS, "decoder.logits_zero_bias")
    types = {n["id"]: n["type"] for n in cap.snapshot["nodes"]}
    assert [types[n] for n in logits.nodes] == ["CONSTANT", "CAST", "ELEMENTWISE"]
    assert [(t.dtype, list(t.shape)) for t in logits.inputs] == [("BF16", [1, 1, 151936])]
    assert logits.output_shape_like_input is None and logits.binding_id == LOGITS


@pytest.mark.parametrize("layout,roles", [("split", ("prefill", "decode")), ("unified", ("decode",))])
def test_roles_inputs_and_recipes_per_layout(tiny_qwen3, layout, roles):
    options = {"max_cache_length": 64, "decoder_engine_layout": layout, "precision": "fp16"}
    first = capture_role(str(tiny_qwen3), None, None, options)
    assert first.all_roles == roles
    for role in roles:
        snap = capture_role(str(tiny_qwen3), None, role, options).snapshot
        inputs = {t["name"]: (t["dtype"], t["shape"]) for t in snap["tensors"] if t["is_network_input"]}
        outputs = {t["name"]: (t["dtype"], t["shape"]) for t in snap["tensors"] if t["is_network_output"]}
        assert inputs["past_key.1"] == ("FP16", [1, 2, 64, 16]) == outputs["present_key.1"]
        assert outputs["logits"] == ("FP32", [1, 1, 512])  # the last position only
        assert ("attention_mask" in inputs) == (layout == "unified")
        ids = {r["recipe_id"] for r in snap["recipes"]}
        assert ids == ({ATTENTION, LOGITS} if (role, layout) == ("decode", "split") else {LOGITS})
        for r in snap["recipes"]:  # every recorded recipe passes the one region validator
            from_recipe(snap, r["recipe_id"], r["instance_id"])


def test_bad_options_are_user_errors(tiny_qwen3):
    with pytest.raises(UserError, match="decoder_engine_layout fused"):
        capture_role(str(tiny_qwen3), None, None, {"decoder_engine_layout": "fused"})
    with pytest.raises(UserError, match="max_cache_length 100000: expected 1..512"):
        capture_role(str(tiny_qwen3), None, None, {"max_cache_length": 100000})
    with pytest.raises(UserError, match="engine_role prefill"):  # one engine: role `decode`
        capture_role(str(tiny_qwen3), None, "prefill", {"decoder_engine_layout": "unified"})
