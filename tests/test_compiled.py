"""torch.compile of lowered steps: slots are the opaque custom op trtmc::slot_call.

CPU: an encoder program whose residual add is a SLOT bound to a real TVM-FFI DSO compiles whole
(fullgraph, no graph breaks) and gives the eager result bit for bit; two programs binding the same
binding id to different kernels keep their own kernels; registry entries go with their program;
compiled greedy decode of a tiny Qwen3 gives the eager tokens.
"""
from __future__ import annotations

import gc

import pytest
import torch
import tvm_ffi

from pipeline.runtime import compiled
from pipeline.runtime.compiled import compile_step
from pipeline.runtime.generate import generate
from pipeline.runtime.program import Program
from tests.test_qwen3_generate import lower_roles
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
    assert key.startswith("res_add#")
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
