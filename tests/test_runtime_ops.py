"""Lowering rules against TensorRT layer semantics, on small networks built with the real API."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.errors import UserError
from pipeline import dtypes
from pipeline.trt.network import NetworkBuilder
from pipeline.trt.export import export_network
from pipeline.runtime.program import Program
from pipeline.trt import trt




def lower(build, inputs: dict[str, torch.Tensor], slots=None):
    """Network with `inputs` as network inputs and build(nb, net, inputs)'s tensor as output."""
    nb = NetworkBuilder()
    tensors = {n: nb.input(n, dtypes.name_of(t.dtype), t.shape) for n, t in inputs.items()}
    nb.mark_output(build(nb, nb.network, tensors), "out")
    return Program.lower(export_network(nb, "test"), dict(nb.computed), slots=slots)


def run(build, **inputs):
    return lower(build, inputs)(**inputs)["out"]


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


E = trt.ElementWiseOperation


@pytest.mark.parametrize("op,expected", [
    (E.SUM, torch.add), (E.SUB, torch.sub), (E.PROD, torch.mul), (E.DIV, torch.div),
    (E.MAX, torch.maximum), (E.MIN, torch.minimum), (E.LESS, torch.lt),
    (E.POW, lambda a, b: torch.pow(a.abs(), b))])
def test_elementwise_broadcasts_equal_ranks(op, expected):
    a, b = rand(2, 1, 4), rand(1, 3, 4, seed=1)
    if op == E.POW:
        a = a.abs()
    out = run(lambda nb, net, t: net.add_elementwise(t["a"], t["b"], op).get_output(0), a=a, b=b)
    assert out.shape == (2, 3, 4)
    assert torch.equal(out, expected(a, b))


def test_integer_division_truncates_and_floor_div_floors():
    a, b = torch.tensor([-7, 7, -8], dtype=torch.int32), torch.tensor([2, 2, 3], dtype=torch.int32)
    div = run(lambda nb, net, t: net.add_elementwise(t["a"], t["b"], E.DIV).get_output(0), a=a, b=b)
    floor = run(lambda nb, net, t: net.add_elementwise(t["a"], t["b"], E.FLOOR_DIV).get_output(0),
                a=a, b=b)
    assert div.tolist() == [-3, 3, -2] and div.dtype == torch.int32
    assert floor.tolist() == [-4, 3, -3]


M = trt.MatrixOperation


@pytest.mark.parametrize("op0,op1,a_shape,b_shape,expected", [
    (M.NONE, M.NONE, (2, 3, 4), (1, 4, 5), lambda a, b: a @ b),
    (M.TRANSPOSE, M.TRANSPOSE, (2, 4, 3), (2, 5, 4), lambda a, b: a.mT @ b.mT),
    (M.NONE, M.VECTOR, (2, 3, 4), (2, 4), lambda a, b: (a @ b[..., None])[..., 0]),
    (M.VECTOR, M.NONE, (2, 4), (2, 4, 5), lambda a, b: (a[:, None] @ b)[:, 0]),
])
def test_matrix_multiply(op0, op1, a_shape, b_shape, expected):
    a, b = rand(*a_shape), rand(*b_shape, seed=1)
    out = run(lambda nb, net, t: net.add_matrix_multiply(t["a"], op0, t["b"], op1).get_output(0),
              a=a, b=b)
    torch.testing.assert_close(out, expected(a, b))


def test_fp16_matmul_accumulates_in_fp32_and_rounds_once():
    a, b = rand(16, 256, dtype=torch.float16), rand(256, 8, dtype=torch.float16, seed=1)
    out = run(lambda nb, net, t: net.add_matrix_multiply(t["a"], M.NONE, t["b"], M.NONE)
              .get_output(0), a=a, b=b)
    assert out.dtype == torch.float16
    assert torch.equal(out, (a.float() @ b.float()).half())


def test_shuffle_transpose_placeholder_inferred_transpose():
    x = rand(2, 3, 4, 5)

    def build(nb, net, t):
        s = net.add_shuffle(t["x"])
        s.first_transpose = (0, 2, 1, 3)      # [2, 4, 3, 5]
        s.reshape_dims = (0, -1, 5)           # [2, 12, 5]
        s.second_transpose = (2, 0, 1)        # [5, 2, 12]
        return s.get_output(0)
    out = run(build, x=x)
    assert torch.equal(out, x.permute(0, 2, 1, 3).reshape(2, 12, 5).permute(2, 0, 1))


def test_shuffle_dynamic_reshape_by_a_shape_tensor():
    x = rand(4, 6)

    def build(nb, net, t):
        shape = nb.computed_constant("shape", torch.tensor([3, 8], dtype=torch.int64))
        s = net.add_shuffle(t["x"])
        s.set_input(1, shape)
        return s.get_output(0)
    assert torch.equal(run(build, x=x), x.reshape(3, 8))


R = trt.ReduceOperation


@pytest.mark.parametrize("op,fn", [(R.SUM, torch.sum), (R.AVG, torch.mean),
                                   (R.MAX, torch.amax), (R.MIN, torch.amin)])
@pytest.mark.parametrize("keep", [True, False])
def test_reduce_axes_bitmask(op, fn, keep):
    x = rand(2, 3, 4)
    out = run(lambda nb, net, t: net.add_reduce(t["x"], op, 0b101, keep).get_output(0), x=x)
    torch.testing.assert_close(out, fn(x, (0, 2), keepdim=keep))


def test_reduce_prod():
    x = rand(2, 3, 4)
    out = run(lambda nb, net, t: net.add_reduce(t["x"], R.PROD, 0b110, False).get_output(0), x=x)
    torch.testing.assert_close(out, x.prod(2).prod(1))


def test_normalization_over_two_axes_then_scale_and_bias():
    x, scale, bias = rand(2, 3, 4), rand(1, 3, 1, seed=1), rand(1, 3, 1, seed=2)

    def build(nb, net, t):
        layer = net.add_normalization(t["x"], nb.computed_constant("s", scale),
                                      nb.computed_constant("b", bias), 0b110)
        layer.epsilon = 1e-5
        return layer.get_output(0)
    mean = x.mean((1, 2), keepdim=True)
    var = x.var((1, 2), unbiased=False, keepdim=True)
    torch.testing.assert_close(run(build, x=x), (x - mean) / torch.sqrt(var + 1e-5) * scale + bias)


def test_fp16_layer_norm_and_softmax_compute_in_fp32():
    x = rand(3, 8, dtype=torch.float16)
    scale, bias = rand(1, 8, seed=1).half(), rand(1, 8, seed=2).half()

    def build(nb, net, t):
        layer = net.add_normalization(t["x"], nb.computed_constant("s", scale),
                                      nb.computed_constant("b", bias), 0b10)
        layer.epsilon = 1e-6
        soft = net.add_softmax(layer.get_output(0))
        soft.axes = 0b1
        return soft.get_output(0)
    out = run(build, x=x)
    normed = F.layer_norm(x.float(), (8,), scale[0].float(), bias[0].float(), 1e-6).half()
    assert out.dtype == torch.float16
    assert torch.equal(out, torch.softmax(normed.float(), 0).half())


A = trt.ActivationType


@pytest.mark.parametrize("kind,alpha,beta,expected", [
    (A.GELU_ERF, 0, 0, F.gelu), (A.GELU_TANH, 0, 0, lambda x: F.gelu(x, approximate="tanh")),
    (A.SIGMOID, 0, 0, torch.sigmoid), (A.RELU, 0, 0, torch.relu), (A.TANH, 0, 0, torch.tanh),
    (A.LEAKY_RELU, 0.1, 0, lambda x: torch.where(x > 0, x, 0.1 * x)),
    (A.CLIP, -0.5, 0.5, lambda x: x.clamp(-0.5, 0.5)),
    (A.SCALED_TANH, 2.0, 0.5, lambda x: 2 * torch.tanh(0.5 * x)),
    (A.HARD_SIGMOID, 0.2, 0.5, lambda x: (0.2 * x + 0.5).clamp(0, 1)),
    (A.SOFTPLUS, 2.0, 3.0, lambda x: 2 * torch.log1p(torch.exp(3 * x))),
    (A.SELU, 1.5, 2.0, lambda x: 2 * torch.where(x > 0, x, 1.5 * (torch.exp(x) - 1))),
])
def test_activation(kind, alpha, beta, expected):
    x = rand(64)

    def build(nb, net, t):
        layer = net.add_activation(t["x"], kind)
        layer.alpha, layer.beta = alpha, beta
        return layer.get_output(0)
    torch.testing.assert_close(run(build, x=x), expected(x))


U = trt.UnaryOperation


@pytest.mark.parametrize("op,expected", [
    (U.SQRT, torch.sqrt), (U.EXP, torch.exp), (U.RECIP, lambda x: 1 / x), (U.ABS, torch.abs),
    (U.NEG, torch.neg), (U.LOG, torch.log), (U.ERF, torch.erf), (U.FLOOR, torch.floor)])
def test_unary(op, expected):
    x = rand(32).abs() + 0.1
    torch.testing.assert_close(run(lambda nb, net, t: net.add_unary(t["x"], op).get_output(0), x=x),
                               expected(x))


def test_gather_default_mode_on_an_inner_axis():
    data, idx = rand(2, 5, 3), torch.tensor([[4, 0], [1, 1]], dtype=torch.int32)
    out = run(lambda nb, net, t: net.add_gather(t["data"], t["idx"], 1).get_output(0),
              data=data, idx=idx)
    assert out.shape == (2, 2, 2, 3)
    assert torch.equal(out, data[:, idx.long()])


def test_slice_positive_and_negative_strides():
    x = rand(6, 7)
    out = run(lambda nb, net, t: net.add_slice(t["x"], (1, 6), (3, 3), (2, -2)).get_output(0), x=x)
    assert torch.equal(out, x[[1, 3, 5]][:, [6, 4, 2]])


def test_concatenation_select_cast():
    a, b = rand(2, 3), rand(2, 3, seed=1)

    def build(nb, net, t):
        cat = net.add_concatenation([t["a"], t["b"]])
        cat.axis = 1
        both = cat.get_output(0)
        positive = net.add_elementwise(both, nb.computed_constant("zero", torch.zeros(1, 1)),
                                       E.GREATER).get_output(0)
        picked = net.add_select(positive, both, net.add_unary(both, U.NEG).get_output(0))
        return net.add_cast(picked.get_output(0), trt.float16).get_output(0)
    out = run(build, a=a, b=b)
    assert out.dtype == torch.float16
    assert torch.equal(out, torch.cat([a, b], 1).abs().half())


def test_weight_casts_and_reshapes_are_folded_at_load():
    w = rand(4, 3)

    def build(nb, net, t):
        half = net.add_cast(nb.computed_constant("w", w), trt.float16).get_output(0)
        s = net.add_shuffle(half)
        s.reshape_dims = (3, 4)
        return net.add_matrix_multiply(t["x"], M.NONE, s.get_output(0), M.NONE).get_output(0)
    x = rand(2, 3, dtype=torch.float16)
    program = lower(build, {"x": x})
    assert program.source.count("# node:") == 1 and "MATRIX_MULTIPLY" in program.source
    assert torch.equal(program(x=x)["out"], (x.float() @ w.half().reshape(3, 4).float()).half())


def _slot_program(layer_attrs, fn):
    """A one-SLOT export: out = kernel(x), made by patching a one-layer network by hand."""
    nb = NetworkBuilder()
    x = nb.input("x", "FP32", (2, 3))
    nb.mark_output(nb.network.add_unary(x, U.NEG).get_output(0), "out")
    export = export_network(nb, "test")
    (layer,) = export["layers"]
    export["layers"] = [{"id": "slot:k", "type": "SLOT", "name": "k", "inputs": layer["inputs"],
                         "outputs": layer["outputs"],
                         "attrs": {"binding_id": "k", "workspace_bytes": 0, "extra_args": [],
                                   "output_shape_like_input": None} | layer_attrs}]
    return Program.lower(export, {}, slots={"k": fn})


def test_slot_passes_workspace_and_extra_args_in_abi_order():
    seen = []

    def kernel(x, ws, out, n, scale, ptr):
        seen.append((ws.dtype, ws.numel(), n, scale, ptr))
        torch.mul(x, scale * n, out=out)
    extras = [{"type": "int", "value": 3}, {"type": "float", "value": 0.5},
              {"type": "ptr", "value": None}]
    program = _slot_program({"workspace_bytes": 64, "extra_args": extras}, kernel)
    x = rand(2, 3)
    assert torch.equal(program(x=x)["out"], x * 1.5)
    assert seen == [(torch.uint8, 64, 3, 0.5, None)]


def test_unsupported_layer_type_names_node_and_type():
    def build(nb, net, t):
        return net.add_topk(t["x"], trt.TopKOperation.MAX, 2, 0b1).get_output(0)
    with pytest.raises(UserError, match=r"node:0: layer type TOPK"):
        lower(build, {"x": rand(2, 8)})


def test_unsupported_attribute_names_the_node():
    def build(nb, net, t):
        layer = net.add_gather(t["x"], t["i"], 0)
        layer.mode = trt.GatherMode.ELEMENT
        return layer.get_output(0)
    with pytest.raises(UserError, match=r"node:0 \(GATHER .*gather mode ELEMENT"):
        lower(build, {"x": rand(4, 2), "i": torch.zeros(4, 2, dtype=torch.int32)})


def test_softmax_matches_over_a_middle_axis():
    x = rand(2, 5, 3)

    def build(nb, net, t):
        soft = net.add_softmax(t["x"])
        soft.axes = 0b10
        return soft.get_output(0)
    out = run(build, x=x)
    torch.testing.assert_close(out, torch.softmax(x, 1))
    assert math.isclose(out.sum().item(), 6.0, rel_tol=1e-5)


def attention_rule(dtype: str, q_shape: list[int], kv_shape: list[int], causal: str):
    """The runtime's ATTENTION_INPUT step for one layer (q, k, v, key/value lengths; no mask)."""
    import pipeline.runtime.decoder_ops  # noqa: F401 - registers the attention rule
    from pipeline.runtime.ops import LOWERINGS
    from pipeline.runtime.program import Lowering
    export = {"tensors": [{"id": f"tensor:{i}", "name": n, "dtype": d, "shape": s}
                          for i, (n, d, s) in enumerate([
                              ("q", dtype, q_shape), ("k", dtype, kv_shape), ("v", dtype, kv_shape),
                              ("len", "INT32", [1]), ("out", dtype, q_shape)])]}
    layer = {"id": "node:0", "type": "ATTENTION_INPUT", "name": "a",
             "inputs": ["tensor:0", "tensor:1", "tensor:2", None, None, None, "tensor:3"],
             "outputs": ["tensor:4"], "attrs": {"norm_op": "SOFTMAX", "causal_kind": causal}}
    return LOWERINGS["ATTENTION_INPUT"](layer, Lowering(export, {}, torch.device("cpu"), {}))


def test_prefill_attention_reads_only_the_prompt_keys_of_a_padded_cache():
    """UPPER_LEFT prefill (query i uses keys j <= i): slots of the cache past the prompt are never
    used and never read, so NaN there changes nothing, and the result is the same as on a cache
    exactly the prompt's length."""
    def rule(capacity):
        return attention_rule("FP32", [1, 4, -1, 16], [1, 2, capacity, 16], "UPPER_LEFT")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 7, 16, generator=g)
    k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(2))
    k[:, :, 7:], v[:, :, 7:] = float("nan"), float("nan")
    length = torch.tensor([7], dtype=torch.int32)
    padded = rule(64)(q, k, v, None, None, None, length)
    exact = rule(7)(q, k[:, :, :7].contiguous(), v[:, :, :7].contiguous(), None, None, None, length)
    assert torch.isfinite(padded).all() and torch.equal(padded, exact)


def test_uncompiled_cpu_decode_reads_only_the_keys_in_use():
    """One query over a fixed-capacity cache, uncompiled on the CPU: the keys past the longest
    length are never read (NaN there changes nothing), a shorter length in the batch still
    leaves its own keys out, and the result is the float64 rule's."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = (torch.randn(2, 2, 64, 16, generator=g) for _ in range(2))
    k[:, :, 9:], v[:, :, 9:] = float("nan"), float("nan")
    lengths = torch.tensor([9, 5], dtype=torch.int32)
    got = attention_rule("FP32", [2, 4, 1, 16], [2, 2, 64, 16], "NONE")(
        q, k, v, None, None, None, lengths)
    kk, vv = (t[:, :, :9].double().repeat_interleave(2, dim=1) for t in (k, v))
    allow = torch.arange(9)[None, :] < lengths[:, None]
    scores = (q.double() @ kk.mT).masked_fill(~allow[:, None, None, :], float("-inf"))
    torch.testing.assert_close(got.double(), torch.softmax(scores, -1) @ vv, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", ["UPPER_LEFT", "NONE"])
def test_a_prompts_attention_is_the_fp32_rule_with_grouped_heads_and_lengths(causal):
    """Several queries go through one fused attention call: the same rule as a float64
    softmax(q k^T) v over the keys each query may use (query head h on key/value head h // 2;
    keys at or past the length, or after the query under UPPER_LEFT, left out)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 16, generator=g)
    k, v = (torch.randn(1, 2, 6, 16, generator=g) for _ in range(2))
    length = torch.tensor([5], dtype=torch.int32)
    got = attention_rule("FP32", [1, 4, 6, 16], [1, 2, 6, 16], causal)(q, k, v, None, None, None,
                                                                       length)
    kk, vv = (t.double().repeat_interleave(2, dim=1) for t in (k, v))
    scores = q.double() @ kk.mT
    allow = torch.arange(6)[None, :] < 5
    if causal == "UPPER_LEFT":
        allow = allow & torch.ones(6, 6, dtype=torch.bool).tril()
    want = torch.softmax(scores.masked_fill(~allow, float("-inf")), -1) @ vv
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
