"""The optimized mode's lowering passes: merged GEMMs keep the network's function and hold each
weight once, and a slot is never merged into anything."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from pipeline.families.capture import capture_role
from pipeline.models.checkpoint import load
from pipeline.modes import Mode
from pipeline.runtime.generate import KVCache, _Step, generate
from pipeline.runtime.program import Program, resident_bytes
from pipeline.trt.export import export_network


def _export(model_dir, role: str) -> tuple[dict, dict]:
    """A role's network export and its weights by key."""
    ck = load(str(model_dir))
    cap = capture_role(str(model_dir), None, role, {"max_cache_length": 64, "precision": "fp16"},
                       checkpoint=ck)
    export = export_network(cap.nb, role)
    return export, {k: ck.tensor(v["tensor"]) for k, v in export["weights"].items()
                    if v["source"] == "checkpoint"} | cap.nb.computed


def _lowered(model_dir, role: str, mode: Mode) -> Program:
    return Program.lower(*_export(model_dir, role), mode=mode)


class _CopiedOnRead(dict):
    """Weights handed out as a fresh copy on every read, as moving them to a device does: the
    memory of a copy a merge frees is reused by later copies."""

    def __getitem__(self, key):
        return super().__getitem__(key).clone()


def _gemm_lines(program: Program) -> list[str]:
    return [line for line in program.source.splitlines() if "MATRIX_MULTIPLY" in line]


def test_shared_input_gemms_merge_and_keep_the_function(tiny_qwen3):
    plain, merged = (_lowered(tiny_qwen3, "prefill", m) for m in (Mode.EAGER, Mode.OPTIMIZED))
    # per layer q/k/v -> 1 and gate/up -> 1 (2 layers): 2 x (3 + 2 - 2) fewer GEMM steps
    assert len(_gemm_lines(plain)) - len(_gemm_lines(merged)) == 2 * 3
    assert any("+" in line for line in _gemm_lines(merged))
    # every product by a weight is the pass's step, merged or not: it takes the activation and
    # its weight, a constant of the program
    assert all(re.search(r"= f\d+\(t\d+, c\d+\)  #", line) for line in _gemm_lines(merged))
    assert not all(re.search(r"= f\d+\(t\d+\)  #", line) for line in _gemm_lines(plain))
    tokens = [generate(p, None, [1, 2, 3, 4, 5], 12, cache=KVCache(p), cuda_graph=False).token_ids
              for p in (plain, merged)]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_roles_share_each_merged_weight_by_its_origin(tiny_qwen3, device):
    """Decode takes prefill's merged weights, layer for layer: sharing goes by how a weight was
    made from the bundle's weights, never by a device address (freed and reused memory made
    Qwen3-8B's decode on the H200 take another layer's gate/up weights)."""
    (prefill_export, weights), (decode_export, _) = (_export(tiny_qwen3, r) for r in ("prefill", "decode"))
    weights, shared = _CopiedOnRead(weights), {}
    prefill = Program.lower(prefill_export, weights, device=device, mode=Mode.OPTIMIZED, shared=shared)
    made = len(shared)
    decode = Program.lower(decode_export, weights, device=device, mode=Mode.OPTIMIZED, shared=shared)
    assert len(shared) == made  # every decode GEMM weight is one prefill made
    alone = Program.lower(decode_export, weights, device=device, mode=Mode.OPTIMIZED)
    runs = [generate(prefill, d, [1, 2, 3, 4, 5], 12, cache=KVCache(prefill), keep_logits=True)
            for d in (decode, alone)]
    assert runs[0].token_ids == runs[1].token_ids
    assert all(bool((a == b).all()) for a, b in zip(runs[0].logits, runs[1].logits))
    assert resident_bytes(prefill, decode) < resident_bytes(prefill, alone)


def test_merged_weights_replace_the_originals(tiny_qwen3):
    """An optimized program holds each weight once: its merged weights replace the originals."""
    plain, merged = (_lowered(tiny_qwen3, "prefill", m) for m in (Mode.EAGER, Mode.OPTIMIZED))
    assert resident_bytes(plain) > 0
    assert resident_bytes(merged) <= resident_bytes(plain) * 1.01


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.slow
def test_the_mode_given_at_lowering_decides_which_traced_steps_take_triton(tiny_qwen3, monkeypatch,
                                                                           mode):
    """Only a program lowered in the optimized mode may take the Triton kernels (ctx.triton: that
    mode on CUDA, stood in for on the CPU here), and only where its step is traced: a prefill
    sharing the merged GEMMs, or a decode left uncompiled, stays on torch."""
    from pipeline.runtime import triton_attention, triton_gemv
    from pipeline.runtime.program import Lowering
    asked = []
    monkeypatch.setattr(Lowering, "triton", property(lambda ctx: ctx.optimized))
    monkeypatch.setattr(triton_attention, "supports", lambda *a: asked.append("attention") or False)
    monkeypatch.setattr(triton_gemv, "supports", lambda *a: asked.append("gemv") or False)
    (prefill_export, weights), (decode_export, _) = (_export(tiny_qwen3, r) for r in ("prefill", "decode"))
    shared: dict = {}
    prefill, decode = (Program.lower(e, weights, mode=mode, shared=shared)
                       for e in (prefill_export, decode_export))
    generate(prefill, decode, [1], 3, cache=KVCache(prefill), cuda_graph=False)
    assert asked == []
    generate(prefill, decode, [1], 3, cache=KVCache(prefill), cuda_graph=False, compile="eager")
    assert sorted(set(asked)) == (["attention", "gemv"] if mode.optimized else [])


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_row_chains_and_attention_inputs_fuse_and_keep_the_function(tiny_qwen3, monkeypatch, role):
    """On CUDA in the optimized mode (stood in for on the CPU, where a fused step runs its layers'
    own steps) each row normalization becomes one step, with the residual add before it where
    the residual stream reads that sum too (all but the first layer's first and the final one),
    the gated SiLU one step, and so does everything between the q/k/v product and the
    attention: the query's and key's head normalizations and rotary embeddings (the query's
    with its scale) and both cache writes. Nothing else changes: the same logits, bit for
    bit."""
    from pipeline.runtime.program import Lowering
    unfused, prompt = _lowered(tiny_qwen3, role, Mode.OPTIMIZED), _lowered(tiny_qwen3, "prefill", Mode.OPTIMIZED)
    monkeypatch.setattr(Lowering, "triton", property(lambda ctx: ctx.optimized))
    fused = _lowered(tiny_qwen3, role, Mode.OPTIMIZED)
    lines = fused.source.splitlines()
    assert sum(line.endswith(" RMS_NORM") for line in lines) == 2
    assert sum(line.endswith(" ADD_RMS_NORM") for line in lines) == 2 * 2 - 1
    assert sum(line.endswith(" ELEMENTWISE") for line in lines) == 4  # the last residual add
    # and the head's own three
    assert sum(line.endswith(" SILU_GATE") for line in lines) == 2
    assert sum(line.endswith(" NORM_ROTARY_CACHE") for line in lines) == 2
    assert not any(kind in line for line in lines for kind in (
        "REDUCE", "SQRT", "SIGMOID", "ROTARY_EMBEDDING", " ROTARY", "KV_CACHE_UPDATE"))
    assert sum(" CAST" in line for line in lines) == 1  # the logits' to FP32
    assert len(lines) < len(unfused.source.splitlines()) - 2 * (4 * 8 + 2 + 3 + 2)
    def run(program):  # the prefill alone, or decode steps after an unfused prefill
        prefill, decode = (program, None) if role == "prefill" else (prompt, program)
        return generate(prefill, decode, [1, 2, 3, 4, 5], 6, cache=KVCache(prefill),
                        cuda_graph=False, keep_logits=True)
    runs = [run(p) for p in (unfused, fused)]
    assert runs[0].token_ids == runs[1].token_ids
    assert all(a.equal(b) for a, b in zip(runs[0].logits, runs[1].logits))


def test_only_a_shuffle_that_moves_whole_rows_lets_a_row_operation_past_it():
    """The attention-inputs fusion normalizes heads after the SHUFFLE that follows their
    normalization: only where that shuffle moves whole rows of the last dim, probed on small
    index tensors (a dynamic dim as 2 and 3; a shape too large to probe is no match)."""
    from pipeline.runtime.passes import PROBE_ELEMENTS, _rows_to_rows
    assert _rows_to_rows(lambda x: x.transpose(1, 2), [1, -1, 32, 128])
    assert _rows_to_rows(lambda x: x.reshape(1, -1, 128), [1, 4, 32, 128])
    assert not _rows_to_rows(lambda x: x.transpose(2, 3), [1, 1, 32, 128])  # moves the last dim
    assert not _rows_to_rows(lambda x: x.reshape(1, 1, -1, 64), [1, 1, 32, 128])  # splits rows
    assert not _rows_to_rows(lambda x: x.flip(-1), [1, 1, 4, 8])  # reorders within a row
    assert not _rows_to_rows(lambda x: x, [PROBE_ELEMENTS, 2, 128])


def _attention(q, k, v, lengths, out):
    """A slot kernel: softmax(q k^T) v over keys before the length, key/value head h // G."""
    n, group = int(lengths[0]), q.shape[1] // k.shape[1]
    k, v = (t[:, :, :n].float().repeat_interleave(group, 1) for t in (k, v))
    out.copy_(torch.softmax(q.float() @ k.mT, -1) @ v)


def test_attention_inputs_fuse_before_a_slot_too(tiny_qwen3, monkeypatch):
    """With a kernel in every layer's attention (a SLOT reading the query and both caches), the
    query's and key's normalizations, rotary embeddings and cache writes before it are still one
    step: the native engine around a kernel fuses what it fuses without one. The same logits,
    bit for bit."""
    from pipeline.graph.patch import layer_key
    from pipeline.runtime.program import Lowering
    (export, weights), prompt = _export(tiny_qwen3, "decode"), _lowered(tiny_qwen3, "prefill", Mode.OPTIMIZED)
    slots = {}
    for n, layer in enumerate(x for x in export["layers"] if x["type"] == "ATTENTION_INPUT"):
        slot = {"id": f"slot:{n}", "type": "SLOT", "name": f"attention {n}",
                "inputs": [t for t in layer["inputs"] if t is not None],
                "outputs": layer["outputs"], "attrs": {
                    "binding_id": "attention", "instance_id": f"layer{n}", "workspace_bytes": 0,
                    "extra_args": [], "output_shape_like_input": 0}}
        export["layers"] = [slot if x["id"] == layer["id"] else x for x in export["layers"]]
        slots[layer_key(slot)] = _attention
    unfused = Program.lower(export, weights, slots=slots, mode=Mode.OPTIMIZED)
    monkeypatch.setattr(Lowering, "triton", property(lambda ctx: ctx.optimized))
    fused = Program.lower(export, weights, slots=slots, mode=Mode.OPTIMIZED)
    lines = fused.source.splitlines()
    assert sum(line.endswith(" NORM_ROTARY_CACHE") for line in lines) == 2
    assert sum(line.endswith(" SLOT") for line in lines) == 2
    assert not any("KV_CACHE_UPDATE" in line or line.endswith(" ROTARY") for line in lines)
    runs = [generate(prompt, p, [1, 2, 3, 4, 5], 6, cache=KVCache(prompt), cuda_graph=False,
                     keep_logits=True) for p in (unfused, fused)]
    assert runs[0].token_ids == runs[1].token_ids
    assert all(a.equal(b) for a, b in zip(runs[0].logits, runs[1].logits))


def test_a_chain_whose_intermediate_is_an_output_stays_unfused(tiny_qwen3, monkeypatch):
    """A normalization whose mean is also asked for as an output keeps its layers (the mean is
    computed and returned, the same as unfused); every other chain is still fused."""
    from pipeline.runtime.program import Lowering
    export, weights = _export(tiny_qwen3, "prefill")
    mean = next(layer for layer in export["layers"] if layer["type"] == "REDUCE")["outputs"][0]
    outputs = export["outputs"] + [mean]
    unfused = Program.lower(export, weights, mode=Mode.OPTIMIZED, outputs=outputs)
    monkeypatch.setattr(Lowering, "triton", property(lambda ctx: ctx.optimized))
    fused = Program.lower(export, weights, mode=Mode.OPTIMIZED, outputs=outputs)
    lines = fused.source.splitlines()
    assert sum(line.endswith("RMS_NORM") for line in lines) == 2 * 2 + 1 - 1
    assert sum(line.endswith(" NORM_ROTARY_CACHE") for line in lines) == 2
    assert sum(" REDUCE" in line for line in lines) == 1
    ids, past = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    got, want = (p(**_Step(p, KVCache(p)).inputs(ids, past)) for p in (fused, unfused))
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in got)


_INTERPRETED_ATTENTION = r"""
import torch
from pipeline.runtime import triton_attention as ta
g = torch.Generator().manual_seed(1)
capacity = 4 * ta.SPLITS * ta.BLOCK_N // 4
for hq, hkv in ((8, 2), (4, 4), (8, 1)):
    q = torch.randn(1, hq, 1, 64, generator=g).half()
    k, v = (torch.randn(1, hkv, capacity, 64, generator=g).half() for _ in range(2))
    for n in (1, 2, 63, ta.BLOCK_N, ta.BLOCK_N + 1, 777 % capacity, capacity):
        kp, vp = k.clone(), v.clone()
        kp[:, :, n:], vp[:, :, n:] = float("nan"), float("nan")  # past the length: never read
        assert ta.supports(q, kp, vp)
        got = ta.decode_attention(q, kp, vp, torch.tensor([n], dtype=torch.int32)).double()
        kk, vv = (t[:, :, :n].double().repeat_interleave(hq // hkv, 1) for t in (k, v))
        want = torch.softmax(q.double() @ kk.mT, -1) @ vv
        err = ((got - want).norm() / want.norm()).item()
        assert got.shape == (1, hq, 1, 64) and torch.isfinite(got).all() and err < 2e-3, (hq, hkv, n, err)
odd = torch.zeros(1, 8, 1, 24).half()  # a head dim the kernels refuse, and a second query
assert not ta.supports(odd, odd[:, :2].expand(1, 2, 64, 24), odd[:, :2].expand(1, 2, 64, 24))
assert not ta.supports(torch.zeros(1, 8, 2, 64), torch.zeros(1, 2, 64, 64), torch.zeros(1, 2, 64, 64))
for hq, hkv, sq, skv, n, causal, bm in ((8, 2, 37, 37, 37, True, 16), (4, 4, 20, 50, 33, False, 16),
                                        (8, 1, 40, 40, 25, True, 16), (4, 2, 33, 33, 40, True, 16),
                                        (4, 1, 70, 70, 70, True, 32), (4, 2, 40, 70, 50, False, 32)):
    q = torch.randn(1, hq, sq, 64, generator=g).half()
    k, v = (torch.randn(1, hkv, skv, 64, generator=g).half() for _ in range(2))
    used = min(n, skv)  # keys past the length, or past the keys given: never read
    kp, vp = k.clone(), v.clone()
    kp[:, :, used:], vp[:, :, used:] = float("nan"), float("nan")
    assert ta.supports_prompt(q, kp, vp)
    got = torch.empty_like(q)
    ta.launch_prompt(q, kp, vp, torch.tensor([n], dtype=torch.int32), got, causal=causal,
                     block_m=bm, block_n=16, num_warps=4, num_stages=1)
    kk, vv = (t[:, :, :used].double().repeat_interleave(hq // hkv, 1) for t in (k, v))
    scores = q.double() @ kk.mT
    if causal:  # query i uses keys j <= i
        scores = scores.masked_fill(~torch.ones(sq, used, dtype=torch.bool).tril(), float("-inf"))
    want = torch.softmax(scores, -1) @ vv
    err = ((got.double() - want).norm() / want.norm()).item()
    assert torch.isfinite(got).all() and err < 2e-3, (hq, hkv, sq, skv, n, causal, err)
assert not ta.supports_prompt(torch.zeros(1, 8, 9, 64), torch.zeros(1, 2, 9, 64), torch.zeros(1, 2, 9, 64))
from pipeline.runtime import triton_rows as tr
for shape, view in (((5, 96), None), ((1, 7, 3, 32), "split")):
    x = (torch.randn(shape, generator=g) * 3).half()
    if view:  # heads sliced from a wider row, as from a merged GEMM's output
        wide = torch.randn(shape[:-2] + (shape[-2] * shape[-1] * 2,), generator=g).half()
        x = wide[..., :shape[-2] * shape[-1]].view(shape)
        assert not x.is_contiguous()
    w = torch.randn(shape[-1], generator=g).half()
    assert tr.supports_rms_norm(x, w, torch.float16)
    got = tr.rms_norm(x, w, 1e-6, torch.float16)
    xf = x.float()
    want = w * (xf * torch.reciprocal(torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-6))).half()
    assert got.shape == x.shape and got.is_contiguous()
    assert (got.float() - want.float()).abs().max().item() <= 2e-3 * want.float().abs().max().item()
    assert (got == want).float().mean().item() > 0.95
    gate, up = (torch.randn(shape[:-1] + (2 * shape[-1],), generator=g) * 4).half().chunk(2, -1)
    assert tr.supports_silu_gate(gate, up) and not gate.is_contiguous()
    got = tr.silu_gate(gate, up)
    want = gate * torch.sigmoid(gate.float()).half() * up
    assert (got.float() - want.float()).abs().max().item() <= 1e-2 * want.float().abs().max().item()
    assert (got == want).float().mean().item() > 0.95
assert not tr.supports_rms_norm(torch.zeros(4, 8).half().mT, torch.zeros(4).half(), torch.float16)
for shape in ((1, 1, 96), (1, 5, 48)):  # one row (decode) and several (a prompt)
    a, b = ((torch.randn(shape, generator=g) * 3).half() for _ in range(2))
    w = torch.randn(shape[-1], generator=g).half()
    assert tr.supports_add_rms_norm(a, b, w)
    total, got = tr.add_rms_norm(a, b, w, 1e-6)
    want = w * (lambda xf: xf * torch.reciprocal(torch.sqrt((xf * xf).mean(-1, keepdim=True)
                                                            + 1e-6)))((a + b).float()).half()
    assert total.equal(a + b) and got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() <= 2e-3 * want.float().abs().max().item()
    assert (got == want).float().mean().item() > 0.95
assert not tr.supports_add_rms_norm(a, b.mT.contiguous().mT, w)  # rows not contiguous
cos, sin = (torch.randn(50, 16, generator=g).half() for _ in range(2))
for heads, scale in ((3, None), (40, 0.125)):
    x = torch.randn(1, 9, heads, 32, generator=g).half().transpose(1, 2)  # heads viewed [B, N, S, D]
    positions = torch.tensor([[4, 0, 49, 7, 7, 1, 2, 30, 3]])
    assert tr.supports_rotary(x, cos, sin, positions)
    got = tr.rotary(x, cos, sin, positions, scale, torch.float16)
    c, s = cos[positions].unsqueeze(1).float(), sin[positions].unsqueeze(1).float()
    x1, x2 = x.float()[..., :16], x.float()[..., 16:]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).half()
    if scale is not None:
        want = (want.float() * scale).half()
    assert got.shape == want.shape and got.is_contiguous()
    assert (got.float() - want.float()).abs().max().item() <= 2e-3 * want.float().abs().max().item()
    assert (got == want).float().mean().item() > 0.95
def normed(x, w, eps):
    xf = x.float()
    return w * (xf * torch.reciprocal(torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps))).half()
def rotated(x, positions, scale):
    c, s = cos[positions].unsqueeze(1).float(), sin[positions].unsqueeze(1).float()
    x1, x2 = x.float()[..., :16], x.float()[..., 16:]
    y = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).half()
    return y if scale is None else (y.float() * scale).half()
for start, scale in ((4, 0.125), (6, None)):  # three rows written; the last one past the cache
    q, k, v = ((torch.randn(1, 3, h, 32, generator=g) * 3).half().transpose(1, 2) for h in (4, 2, 2))
    wq, wk = (torch.randn(32, generator=g).half() for _ in range(2))
    kc, vc = (torch.randn(1, 2, 8, 32, generator=g).half() for _ in range(2))
    positions, at = torch.tensor([[9, 0, 49]], dtype=torch.int32), torch.tensor([start], dtype=torch.int32)
    args = (q, k, v, wq, wk, cos, sin, positions, at, kc.clone(), vc.clone())
    assert tr.supports_norm_rotary_cache(*args)
    got = tr.norm_rotary_cache(*args, 1e-6, 1e-5, 1.0 if scale is None else scale)
    want = rotated(normed(q, wq, 1e-6), positions.long(), scale)
    kw, vw = kc.clone(), vc.clone()
    n = min(3, 8 - start)
    kw[:, :, start:start + n] = rotated(normed(k, wk, 1e-5), positions.long(), None)[:, :, :n]
    vw[:, :, start:start + n] = v[:, :, :n]
    assert got.shape == want.shape and got.is_contiguous()
    for a, b in ((got, want), (args[9], kw), (args[10], vw)):
        assert (a.float() - b.float()).abs().max().item() <= 2e-3 * b.float().abs().max().item()
        assert (a == b).float().mean().item() > 0.95
    assert args[10].equal(vw) and args[9][:, :, :start].equal(kc[:, :, :start])
assert not tr.supports_norm_rotary_cache(*((q.expand(2, -1, -1, -1),) + args[1:]))  # batch 2
far = tr.rotary(x, cos, sin, torch.tensor([[50, -1, 10**6, 0, 0, 0, 0, 0, 0]]), None, torch.float16)
first = tr.rotary(x, cos, sin, torch.zeros(1, 9, dtype=torch.long), None, torch.float16)
assert (far[:, :, :3] == 0).all() and far[:, :, 3:].equal(first[:, :, 3:])  # past the tables: zeros
small, big = (torch.empty(n, 1024, dtype=torch.float16, device="meta") for n in (4, 2 ** 21 + 1))
assert tr.supports_silu_gate(small, small) and not tr.supports_silu_gate(big, big)
assert not tr.supports_rotary(torch.zeros(1, 2, 3, 24).half(), cos[:, :12].contiguous(),
                              sin[:, :12].contiguous(), torch.zeros(1, 3, dtype=torch.long))
from pipeline.runtime import triton_gemv as tv
for n, k in ((64, 2048), (6, 1024), (3, 12288), (2, 1536)):  # BLOCK_K 4096, or halved to fit
    x, w = torch.randn(1, 1, k, generator=g).half(), torch.randn(n, k, generator=g).half()
    y = tv.gemv(x, w).double()
    want = x.double() @ w.double().mT
    assert tv.supports(x, w) and y.shape == (1, 1, n)
    assert ((y - want).norm() / want.norm()).item() < 1e-3, (n, k)
assert not tv.supports(torch.zeros(1, 2, 1024).half(), torch.zeros(8, 1024).half())  # two rows
assert not tv.supports(torch.zeros(1, 1, 1000).half(), torch.zeros(8, 1000).half())  # no BLOCK_K
print("ok")
"""


@pytest.mark.slow
def test_decode_kernels_compute_their_rules():
    """The optimized mode's Triton kernels, run by Triton's interpreter on the CPU (FP16, as the
    interpreter has no BF16), against float64: the decode attention, softmax(q k^T) v over the
    active keys, at every split class of length (1, 2, odd, a block, one past it, the capacity),
    grouped and ungrouped heads, NaN past the length never read; the prompt attention, causal or
    not, lengths short of, equal to and past the keys, odd query counts over several blocks, query
    tiles wider than the key step (unmasked and masked key blocks in one tile); the
    GEMV, x @ W^T; the RMS normalization and gated SiLU, on rows in place and on heads sliced
    from a wider row, and the rotary embedding by position (scaled after it or not, more heads
    than one program covers, positions past its tables reading nothing), against the layers'
    own roundings; tensors past 32-bit offsets refused."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _INTERPRETED_ATTENTION], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


_INTERPRETED_DECODE = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from test_passes import _export
from pipeline.runtime import passes, triton_attention, triton_gemv, triton_rows
from pipeline.runtime.generate import KVCache, generate
from pipeline.runtime.program import Lowering, Program
from pipeline.modes import Mode
Lowering.triton = property(lambda ctx: ctx.optimized)
triton_attention.supports = lambda *a: False  # the products are under test
triton_gemv.CONFIG = (1, 64, 4, 1)  # blocks the tiny model's sizes (hidden 64) take
@torch.library.register_fake("trtmc::gemv")  # interpreted kernels cannot be traced for shapes
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))
@torch.library.register_fake("trtmc::norm_rotary_cache")
def _(q, *_):
    return q.new_empty(q.shape)
@torch.library.register_fake("trtmc::add_rms_norm")
def _(a, *_):
    return a.new_empty(a.shape), a.new_empty(a.shape)
launched, launch = [], triton_gemv.launch
def counted(x, w, y, config=None):
    launched.append(tuple(w.shape))
    return launch(x, w, y, config)
triton_gemv.launch = counted
def counted_grids(kernel):
    grids, run = [], kernel.run
    kernel.run = lambda *a, **k: grids.append(k["grid"]) or run(*a, **k)
    return grids
fused, added = (counted_grids(k) for k in (triton_rows._norm_rotary_cache_kernel,
                                           triton_rows._add_rms_norm_kernel))
(prefill_export, weights), (decode_export, _) = (_export(sys.argv[2], r) for r in ("prefill", "decode"))
shared = {}
prefill, decode = (Program.lower(e, weights, mode=Mode.OPTIMIZED, shared=shared)
                   for e in (prefill_export, decode_export))
runs = []
for kernels, compile in ((False, False), (True, "eager")):  # the layers' own steps; the kernels
    passes.kernels_run_on = lambda x: kernels
    runs.append(generate(prefill, decode, [3, 1, 4, 1, 5], 2, cache=KVCache(prefill),
                         cuda_graph=False, keep_logits=True, compile=compile))
# q/k/v, o, gate/up and down in each layer, and the head, in the one decode step
assert sorted(set(launched)) == [(64, 64), (64, 128), (128, 64), (256, 64), (512, 64)], launched
assert len(launched) == 2 * 4 + 1, len(launched)
# the query's and key's normalizations and rotations and the cache writes: the prompt's
# 5 positions then the decode step's 1, 4 query + 2 key/value heads, in each layer
assert fused == [(5, 6)] * 2 + [(1, 6)] * 2, fused
# each residual add with the normalization after it: 3 of the 4 (the first has no add)
assert added == [(5,)] * 3 + [(1,)] * 3, added
assert runs[0].token_ids == runs[1].token_ids
for a, b in zip(runs[0].logits, runs[1].logits):
    assert ((a.double() - b.double()).norm() / a.double().norm()).item() < 1e-2
print("ok")
"""


@pytest.mark.slow
def test_a_traced_decode_step_runs_its_products_on_the_gemv(tiny_qwen3):
    """The decode step traced (Dynamo, eager backend) on CUDA in the optimized mode, stood in for
    on the CPU by Triton's interpreter: each of its products (merged q/k/v, o, merged gate/up and
    down in each layer, and the head) is a launch of the Triton GEMV, each layer's attention
    inputs one launch of the fused normalization, rotation and cache write (the prompt's too,
    uncompiled), and it gives the tokens of the layers' own steps, and logits within rounding."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _INTERPRETED_DECODE, os.path.dirname(__file__),
                          str(tiny_qwen3)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def _sm90_cases() -> dict:
    """Each Triton kernel of the runtime as the Qwen3-8B optimized mode launches it: (module,
    kernel, argument types, constexprs, options); BF16 tensors, int32 sizes and strides."""
    from pipeline.runtime import triton_attention as ta
    from pipeline.runtime import triton_gemv as tv
    from pipeline.runtime import triton_rows as tr
    bf16, i32 = "*bf16", "i32"

    def gemv(k):
        block_n, block_k, warps, stages = tv.config_for(k)
        return (tv, "_gemv_kernel", {"x": bf16, "w": bf16, "y": bf16},
                {"K": k, "BLOCK_N": block_n, "BLOCK_K": block_k}, (warps, stages))
    ints = lambda *names: dict.fromkeys(names, i32)  # noqa: E731
    return {
        "gemv K 4096": gemv(4096), "gemv K 12288": gemv(12288),
        "decode attention, split": (
            ta, "_split_kernel", {"q": bf16, "k": bf16, "v": bf16, "lengths": "*i32",
                                  "part_acc": "*fp32", "part_ml": "*fp32"}
            | ints("sq_b", "sq_h", "sk_b", "sk_h", "sk_c", "sv_b", "sv_h", "sv_c"),
            {"G": 4, "ROWS": max(ta.MIN_ROWS, 4), "D": 128, "BLOCK_N": ta.BLOCK_N,
             "SPLITS": ta.SPLITS}, (4, 3)),
        "decode attention, merge": (
            ta, "_merge_kernel", {"part_acc": "*fp32", "part_ml": "*fp32", "out": bf16}
            | ints("so_b", "so_h"), {"HQ": 32, "D": 128, "SPLITS": ta.SPLITS}, (4, 3)),
        "prompt attention": (
            ta, "_prompt_kernel", {"q": bf16, "k": bf16, "v": bf16, "lengths": "*i32", "out": bf16}
            | ints("sq_b", "sq_h", "sq_s", "sk_b", "sk_h", "sk_s", "sv_b", "sv_h", "sv_s", "so_b",
                   "so_h", "so_s", "SQ", "SKV"),
            {"G": 4, "D": 128, "CAUSAL": True, "BLOCK_M": ta.PROMPT_BLOCK_M,
             "BLOCK_N": ta.PROMPT_BLOCK_N}, (8, 3)),
        "RMS normalization": (
            tr, "_rms_norm_kernel", {"x": bf16, "w": bf16, "y": bf16, "eps": "fp32"}
            | ints("n_rows", "inner", "sx_outer", "sx_inner"),
            {"D": 4096, "BLOCK_D": 4096, "ROWS": 1}, (8, 3)),
        "gated SiLU": (
            tr, "_silu_gate_kernel", {"g": bf16, "u": bf16, "y": bf16}
            | ints("n_cols", "inner", "sg_outer", "sg_inner", "su_outer", "su_inner"),
            {"BLOCK": tr.SILU_BLOCK}, (4, 3)),
        "rotary embedding": (
            tr, "_rotary_kernel", {"x": bf16, "cos": bf16, "sin": bf16, "pos": "*i64", "y": bf16,
                                   "scale": "fp32"}
            | ints("S", "N", "P", "sx_b", "sx_n", "sx_s", "sp_b", "sp_s"),
            {"HALF": 64, "BLOCK_N": 32, "SCALED": True}, (4, 3)),
        "residual add and normalization": (
            tr, "_add_rms_norm_kernel", dict.fromkeys(("a", "b", "w", "s", "y"), bf16),
            {"D": 4096, "BLOCK_D": 4096, "EPS": 1e-6}, (8, 3)),
        "norm, rotary and cache writes": (
            tr, "_norm_rotary_cache_kernel", dict.fromkeys(
                ("q", "k", "v", "wq", "wk", "cos", "sin", "q_out", "k_cache", "v_cache"), bf16)
            | {"pos": "*i32", "start": "*i32"}
            | ints("P", "C", "sq_n", "sq_s", "sk_n", "sk_s", "sv_n", "sv_s", "sp_s", "skc_n",
                   "skc_c", "svc_n", "svc_c"),
            {"HQ": 32, "HALF": 64, "EPS_Q": 1e-6, "EPS_K": 1e-6, "SCALE": 128 ** -0.5}, (1, 3)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gemv K 4096", "gemv K 12288", "decode attention, split",
                                  "decode attention, merge", "prompt attention",
                                  "RMS normalization", "gated SiLU", "rotary embedding",
                                  "residual add and normalization",
                                  "norm, rotary and cache writes"])
def test_the_runtime_kernels_compile_for_the_h200(case):
    """Each Triton kernel the optimized mode launches on the H200 compiles to sm_90 code at
    Qwen3-8B's sizes, through Triton's own ptxas: no GPU needed to find a kernel that would
    not build on one."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    module, name, types, values, (num_warps, num_stages) = _sm90_cases()[case]
    source = ASTSource(getattr(module, name), types | dict.fromkeys(values, "constexpr"),
                       constexprs=values)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    assert ".target sm_90" in kernel.asm["ptx"] and kernel.asm["cubin"]
