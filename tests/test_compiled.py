"""torch.compile of lowered steps: slots are the opaque custom op trtmc::slot_call.

CPU: an encoder program whose residual add is a SLOT bound to a real TVM-FFI DSO compiles whole
(fullgraph, no graph breaks) and gives the eager result bit for bit; two programs binding the same
binding id to different kernels keep their own kernels; registry entries go with their program;
compiled greedy decode of a tiny Qwen3 gives the eager tokens; a decoder's repeated layers are
traced and compiled once, a slot in every layer included.
"""
from __future__ import annotations

import copy
import gc

import pytest
import torch
import tvm_ffi

from pipeline.graph.patch import layer_key
from pipeline.models.synth import synthesize
from pipeline.runtime import blocks, compiled
from pipeline.runtime.compiled import compile_step
from pipeline.runtime.generate import KVCache, _Step, generate
from pipeline.runtime.program import Program
from pipeline.modes import Mode
from tests.conftest import TINY_QWEN3
from tests.test_qwen3_generate import lower_roles, role_exports
from tests.test_runtime_encoder import _lowered_inputs, _random_inputs, _residual_add, _with_slot


@pytest.fixture(scope="module")
def encoder(tiny_distilbert, byok_kernels):
    """(patched export, weights, example step args, {name: TVM-FFI kernel})."""
    cap, export, weights = _lowered_inputs(tiny_distilbert, "fp32", seq=16)
    patched = _with_slot(export, _residual_add(export))
    ids, mask = _random_inputs(cap, 16, 11, seed=1)
    kernels = {name: tvm_ffi.load_module(str(byok_kernels[name])).get_function("run")
               for name in ("residual_add", "residual_sub")}
    return patched, weights, [ids, mask], kernels


def _lower(encoder, kernel: str) -> Program:
    patched, weights, _, kernels = encoder
    return Program.lower(patched, weights, slots={"res_add": kernels[kernel]})


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.slow
def test_compiled_slot_program_equals_eager_in_one_graph(encoder, backend):
    program, args = _lower(encoder, "residual_add"), encoder[2]
    assert "SLOT" in program.source
    expected = program.step(args)[0].clone()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(program.step)(args)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    ops = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.trtmc.slot_call.default in ops
    got = compile_step(program, backend=backend)(args)[0]
    assert torch.equal(got, expected)


@pytest.mark.slow
def test_same_binding_id_in_two_programs_keeps_each_kernel(encoder):
    add, sub = _lower(encoder, "residual_add"), _lower(encoder, "residual_sub")
    args = encoder[2]
    add_eager, sub_eager = add.step(args)[0].clone(), sub.step(args)[0].clone()
    assert not torch.equal(add_eager, sub_eager)  # the slot's kernel matters
    torch._dynamo.reset()
    add_c, sub_c = (compile_step(p, backend="aot_eager") for p in (add, sub))
    assert torch.equal(add_c(args)[0], add_eager)
    assert torch.equal(sub_c(args)[0], sub_eager)


def test_registry_entry_goes_with_its_program(encoder):
    before = set(compiled._KERNELS)
    program = _lower(encoder, "residual_add")
    (key,) = set(compiled._KERNELS) - before
    del program
    gc.collect()
    assert key not in compiled._KERNELS


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3):
    return lower_roles(tiny_qwen3, "split")


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_tokens(qwen3):
    prefill, decode = qwen3
    eager = generate(prefill, decode, [9, 8, 7, 6], 12, cuda_graph=False).token_ids
    torch._dynamo.reset()
    assert generate(prefill, decode, [9, 8, 7, 6], 12, compile="aot_eager").token_ids == eager


@pytest.mark.slow
def test_inductor_decode_gives_the_eager_tokens(qwen3):
    """Inductor's C++ backend on CPU (about a minute on 2 cores)."""
    prefill, decode = qwen3
    eager = generate(prefill, decode, [9, 8, 7, 6], 12, cuda_graph=False).token_ids
    torch._dynamo.reset()
    assert generate(prefill, decode, [9, 8, 7, 6], 12, compile=True).token_ids == eager


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return synthesize("Qwen3-8B", tmp_path_factory.mktemp("synth") / "qwen3-4", seed=0,
                      overrides={**TINY_QWEN3, "num_hidden_layers": 4})


@pytest.fixture(scope="module")
def qwen3_four_layers(four_layers):
    return lower_roles(four_layers, "split", mode=Mode.OPTIMIZED)


@pytest.mark.slow
def test_repeated_layers_are_traced_and_compiled_once(qwen3_four_layers):
    """Four decoder layers of the optimized mode (weights passed to the GEMMs, not held by
    them) compile as three graphs: the embedding with the first layer, one layer the other
    three call, the last residual add with the logits. Every cut follows a
    layer's last GEMM, so a residual add stays with the normalization after it. Tokens and
    logits are eager's, bit for bit."""
    prefill, decode = qwen3_four_layers
    cut_layers = [decode.plan.code[i][1] for i in blocks.cuts(decode.plan.code)]
    assert len(cut_layers) == 4 and all(
        layer["name"].endswith("mlp_residual_add") for layer in cut_layers)
    eager = generate(prefill, decode, [9, 8, 7, 6], 8, cuda_graph=False, keep_logits=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    twin = copy.copy(decode)
    twin.step = compile_step(decode, backend=backend)
    got = generate(prefill, twin, [9, 8, 7, 6], 8, cuda_graph=False, keep_logits=True)
    assert twin.step.blocks == 3 and len(graphs) == 3
    assert got.token_ids == eager.token_ids
    assert all(a.equal(b) for a, b in zip(got.logits, eager.logits))


def test_cuda_lowering_repeats_its_layers_too(four_layers, monkeypatch):
    """On CUDA the optimized mode also fuses each normalization, gated SiLU and rotary embedding
    into one step (stood in for on the CPU): those are the same step in every layer too, so the
    layers still make one block."""
    from pipeline.runtime.program import Lowering
    monkeypatch.setattr(Lowering, "triton", property(lambda ctx: ctx.optimized))
    prefill, decode = lower_roles(four_layers, "split", mode=Mode.OPTIMIZED)
    assert any(layer["type"] == "RMS_NORM" for _, layer in decode.plan.code)
    assert blocks.segmented_step(decode, lambda block: block).blocks == 3


def _a_slot_in_every_layer(four_layers, bind):
    """The decode program with every layer's closing residual add a SLOT, `bind(n)` giving layer
    n's (kernel, workspace bytes, extra args); and its step's arguments for one token."""
    _, (export, weights) = role_exports(four_layers, "split")
    adds = [layer for layer in export["layers"] if layer["name"].endswith("mlp_residual_add")]
    slots = {}
    for n, add in enumerate(adds):
        kernel, workspace, extras = bind(n)
        attrs = {"binding_id": "res_add", "instance_id": f"layer{n}", "workspace_bytes": workspace,
                 "extra_args": extras, "output_shape_like_input": 0}
        slot = {"id": f"slot:{n}", "type": "SLOT", "name": f"res_add {n}", "inputs": add["inputs"],
                "outputs": add["outputs"], "attrs": attrs}
        export["layers"] = [slot if x["id"] == add["id"] else x for x in export["layers"]]
        slots[layer_key(slot)] = kernel
    decode = Program.lower(export, weights, slots=slots, mode=Mode.OPTIMIZED)
    named = _Step(decode, KVCache(decode)).inputs(torch.tensor([[5]], dtype=torch.int32),
                                                  torch.tensor([3], dtype=torch.int32))
    return decode, [named[s.name] for s in decode.input_specs]


def _compiled_like_eager(decode, args, calls) -> list:
    """The calls the step makes eager, then compiled by blocks (aot_eager): the same calls, in
    the same order, and the same outputs bit for bit."""
    expected = [t.clone() for t in decode.step(args)]
    eager, calls[:] = list(calls), []
    torch._dynamo.reset()
    step = compile_step(decode, backend="aot_eager")
    got = step(args)
    assert step.blocks == 3 and calls == eager
    assert all(a.equal(b) for a, b in zip(got, expected))
    return eager


@pytest.mark.slow
def test_a_slot_in_every_layer_still_compiles_each_layer_once(four_layers):
    """Every layer's closing residual add a SLOT bound to its own kernel (a Python callable
    counting its calls): the slot steps take their buffers and selector as arguments, so the
    layers are still one block; each layer's call reaches its own kernel, and the outputs are
    eager's, bit for bit."""
    calls = []

    def kernel(n):
        def add(a, b, out):
            calls.append(n)
            out.copy_(a + b)
        return add
    decode, args = _a_slot_in_every_layer(four_layers, lambda n: (kernel(n), 0, []))
    assert _compiled_like_eager(decode, args, calls) == [0, 1, 2, 3]


@pytest.mark.slow
def test_one_kernel_in_every_layer_gets_each_layers_workspace_and_extra_args(four_layers):
    """One kernel bound in every layer, each instance with its own workspace size and extra
    argument: compiled by blocks, every call still gets its own layer's workspace and value."""
    calls = []

    def add(a, b, workspace, out, tag):
        calls.append((tag, workspace.numel()))
        out.copy_(a + b)
    decode, args = _a_slot_in_every_layer(
        four_layers, lambda n: (add, 16 * (n + 1), [{"type": "int", "value": 10 + n}]))
    assert _compiled_like_eager(decode, args, calls) == [(10, 16), (11, 32), (12, 48), (13, 64)]


def test_steps_are_one_only_when_their_closures_are_equal():
    """A lowering rule's closures over equal values are one step; over a different value, or
    over tensors that are not the same object (a slot's buffer), they stay apart."""
    def rule(scale, tensor=None):
        return lambda x: x * scale if tensor is None else x * scale + tensor
    first, tensor = torch.ones(1), torch.ones(1)
    steps = [rule(2.0), rule(2.0), rule(3.0), rule(2.0, first), rule(2.0, tensor),
             rule(2.0, first)]
    got = blocks.same_steps(steps)
    assert got[1] is steps[0] and got[2] is steps[2]
    assert got[4] is steps[4] and got[5] is steps[3]


@pytest.mark.gpu
def test_inductor_blocks_on_cuda_give_the_eager_tokens(four_layers):
    """The optimized mode on CUDA: the decode step compiled block by block by Inductor (Triton
    GEMVs and decode attention in it) and replayed as a CUDA graph gives the tokens of the same
    program run uncompiled."""
    prefill, decode = lower_roles(four_layers, "split", device="cuda", mode=Mode.OPTIMIZED)
    cache = KVCache(prefill)
    prompt = [9, 8, 7, 6, 5, 4, 3]
    eager = generate(prefill, decode, prompt, 24, cuda_graph=False, cache=cache).token_ids
    torch._dynamo.reset()
    assert generate(prefill, decode, prompt, 24, compile=True, cache=cache).token_ids == eager
    (twin,) = cache.compiled.values()
    assert twin.step.blocks == 3
