"""The reference runtime runs the captured encoder networks like transformers does."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from pipeline.errors import UserError
from pipeline.families.capture import capture_role
from pipeline.trt.export import export_network
from pipeline.runtime.program import Program

SEQ = 128
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.",
         "Reference runtimes are validated against transformers, token by token, " * 4]


def _lowered_inputs(model_dir, precision, seq=SEQ):
    cap = capture_role(str(model_dir), None, "decode", {"precision": precision,
                                                         "sequence_length": seq})
    export = export_network(cap.nb, "decode")
    weights = {k: cap.checkpoint.tensor(v["tensor"]) for k, v in export["weights"].items()
               if v["source"] == "checkpoint"} | cap.nb.computed
    return cap, export, weights


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    from transformers import BertModel
    return minilm_dir, BertModel.from_pretrained(str(minilm_dir)).eval()


@pytest.fixture(scope="module")
def distil(tiny_distilbert):
    cap, export, weights = _lowered_inputs(tiny_distilbert, "fp32", seq=16)
    return cap, export, weights, Program.lower(export, weights)


def _compare(out, ref):
    out = out.float()
    return F.cosine_similarity(out, ref, dim=-1).min().item(), (out - ref).abs().max().item()


# measured on MiniLM, seq 128: fp32 cos 0.9999998, max |diff| 1.7e-6; fp16 cos 0.999996,
# max |diff| 0.0042 (hidden states after the final layer norm are O(1))
@pytest.mark.parametrize("precision,min_cos,max_diff", [("fp32", 0.9999, 1e-4),
                                                         ("fp16", 0.9999, 0.01)])
def test_minilm_matches_transformers(minilm, precision, min_cos, max_diff):
    path, hf = minilm
    cap, export, weights = _lowered_inputs(path, precision)
    program = Program.lower(export, weights)
    assert [s.name for s in program.output_specs] == ["last_hidden_state"]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path))  # transformers' side, end to end
    for text in TEXTS:
        enc = tok(text, padding="max_length", max_length=SEQ, truncation=True, return_tensors="pt")
        n = int(enc["attention_mask"].sum())
        out = program(input_ids=enc["input_ids"][0].int(),
                      attention_mask=enc["attention_mask"][0].int())["last_hidden_state"]
        assert out.dtype == (torch.float32 if precision == "fp32" else torch.float16)
        with torch.no_grad():
            ref = hf(input_ids=enc["input_ids"][:, :n]).last_hidden_state[0]
        cos, diff = _compare(out[:n], ref)
        assert cos >= min_cos and diff <= max_diff, (text, cos, diff)


def _random_inputs(cap, seq, n, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = cap.checkpoint.config["vocab_size"]
    ids = torch.randint(1, vocab, (seq,), generator=g, dtype=torch.int32)
    mask = (torch.arange(seq) < n).int()
    return ids * mask, mask


def test_tiny_distilbert_matches_transformers(distil, tiny_distilbert):
    from transformers import DistilBertModel
    cap, _, _, program = distil
    hf = DistilBertModel.from_pretrained(str(tiny_distilbert)).eval()
    for n in (16, 9, 3):
        ids, mask = _random_inputs(cap, 16, n, seed=n)
        out = program(input_ids=ids, attention_mask=mask)["last_hidden_state"]
        with torch.no_grad():
            ref = hf(input_ids=ids[None, :n].long()).last_hidden_state[0]
        cos, diff = _compare(out[:n], ref)
        assert cos >= 0.9999 and diff <= 1e-4, (n, cos, diff)


@pytest.mark.parametrize("fixture", ["tiny_distilbert", "tiny_bert"])
def test_every_tensor_has_its_declared_dtype_and_shape(request, fixture):
    """Asking for every tensor as an output checks each layer, folded constants included."""
    cap, export, weights = _lowered_inputs(request.getfixturevalue(fixture), "fp16", seq=8)
    everything = [t["id"] for t in export["tensors"] if not t["is_network_input"]]
    program = Program.lower(export, weights, outputs=everything)
    ids, mask = _random_inputs(cap, 8, 5, seed=0)
    outs = program.step([ids, mask])
    for spec, value in zip(program.output_specs, outs):
        assert (value.dtype, tuple(value.shape)) == (spec.torch_dtype, spec.shape), spec


def _residual_add(export):
    name = "encoder.layers.0.attention_residual_add"
    (layer,) = [x for x in export["layers"] if x["name"] == name]
    return layer


def test_region_sub_program_runs_only_the_region(distil):
    _, export, weights, _ = distil
    add = _residual_add(export)
    program = Program.lower(export, weights, inputs=add["inputs"], outputs=add["outputs"])
    assert [s.id for s in program.input_specs] == add["inputs"]
    assert [s.id for s in program.output_specs] == add["outputs"]
    assert program.source.count("# node:") == 1
    a, b = (torch.randn(s.shape, dtype=s.torch_dtype) for s in program.input_specs)
    (out,) = program.step([a, b])
    assert torch.equal(out, a + b)


def _with_slot(export, add):
    patched = copy.deepcopy(export)
    slot = {"id": "slot:res_add", "type": "SLOT", "name": "res_add", "inputs": add["inputs"],
            "outputs": add["outputs"],
            "attrs": {"binding_id": "res_add", "workspace_bytes": 0, "extra_args": [],
                      "output_shape_like_input": None}}
    patched["layers"] = [slot if x["id"] == add["id"] else x for x in patched["layers"]]
    return patched


def test_slot_replaces_the_region(distil):
    cap, export, weights, native = distil
    patched = _with_slot(export, _residual_add(export))
    ids, mask = _random_inputs(cap, 16, 11, seed=1)
    expected = native(input_ids=ids, attention_mask=mask)["last_hidden_state"]

    good = Program.lower(patched, weights,
                         slots={"res_add": lambda a, b, out: torch.add(a, b, out=out)})
    assert "SLOT" in good.source
    assert torch.equal(good(input_ids=ids, attention_mask=mask)["last_hidden_state"], expected)

    lazy = Program.lower(patched, weights, slots={"res_add": lambda a, b, out: None})
    out = lazy(input_ids=ids, attention_mask=mask)["last_hidden_state"]
    assert not torch.allclose(out, expected, equal_nan=False)

    with pytest.raises(UserError, match="slot:res_add"):
        Program.lower(patched, weights, slots={})


def test_unsupported_layer_type_is_named_at_lower_time(distil):
    _, export, weights, _ = distil
    bad = copy.deepcopy(export)
    layer = _residual_add(bad)
    layer["type"] = "WARP_DRIVE"
    with pytest.raises(UserError, match=rf"{layer['id']}: layer type WARP_DRIVE"):
        Program.lower(bad, weights)


def test_call_checks_inputs(distil):
    _, _, _, program = distil
    with pytest.raises(UserError, match="missing \\['attention_mask'\\]"):
        program(input_ids=torch.zeros(16, dtype=torch.int32))
    with pytest.raises(UserError, match="input 'attention_mask'.*expected INT32 \\[16\\]"):
        program(input_ids=torch.zeros(16, dtype=torch.int32),
                attention_mask=torch.zeros(16, dtype=torch.int64))
