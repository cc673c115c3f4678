"""The optimized mode's lowering passes: merged GEMMs keep the network's function and hold each
weight once, and a slot is never merged into anything."""
from __future__ import annotations

import pytest
import torch

from pipeline.families.capture import capture_role
from pipeline.models.checkpoint import load
from pipeline.runtime.generate import KVCache, generate
from pipeline.runtime.program import Program
from pipeline.trt.export import export_network


def _lowered(model_dir, role: str, optimize: bool) -> Program:
    ck = load(str(model_dir))
    cap = capture_role(str(model_dir), None, role, {"max_cache_length": 64, "precision": "fp16"},
                       checkpoint=ck)
    export = export_network(cap.nb, role)
    weights = {k: ck.tensor(v["tensor"]) for k, v in export["weights"].items()
               if v["source"] == "checkpoint"} | cap.nb.computed
    return Program.lower(export, weights, optimize=optimize)


def _gemm_lines(program: Program) -> list[str]:
    return [line for line in program.source.splitlines() if "MATRIX_MULTIPLY" in line]


def test_shared_input_gemms_merge_and_keep_the_function(tiny_qwen3):
    plain, merged = (_lowered(tiny_qwen3, "prefill", o) for o in (False, True))
    # per layer q/k/v -> 1 and gate/up -> 1 (2 layers): 2 x (3 + 2 - 2) fewer GEMM steps
    assert len(_gemm_lines(plain)) - len(_gemm_lines(merged)) == 2 * 3
    assert any("+" in line for line in _gemm_lines(merged))
    tokens = [generate(p, None, [1, 2, 3, 4, 5], 12, cache=KVCache(p), cuda_graph=False).token_ids
              for p in (plain, merged)]
    assert tokens[0] == tokens[1]


def test_merged_weights_replace_the_originals(tiny_qwen3):
    plain, merged = (_lowered(tiny_qwen3, "prefill", o) for o in (False, True))

    def weight_bytes(program):
        """Bytes of every distinct tensor storage the step can reach through its closures."""
        seen, todo = {}, [program.step]
        while todo:
            v = todo.pop()
            if isinstance(v, torch.Tensor):
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
            elif isinstance(v, (tuple, list)):
                todo.extend(v)
            elif callable(v) and id(v) not in seen:
                seen[id(v)] = 0
                todo.extend(c.cell_contents for c in getattr(v, "__closure__", None) or ())
        return sum(seen.values())
    assert weight_bytes(plain) > 0
    assert weight_bytes(merged) <= weight_bytes(plain) * 1.01


@pytest.mark.slow
def test_active_length_attention_reads_the_active_keys_only():
    """The optimized decode attention (compiled flex attention) against the eager rule's
    semantics: keys past the length are never used, and blocks past it are never read."""
    from pipeline.runtime.decoder_ops import FLEX_BLOCK, active_length_attention
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 1, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 4 * FLEX_BLOCK, 64, generator=g).bfloat16() for _ in range(2))
    lengths = torch.tensor([0], dtype=torch.int32)
    attend = torch.compile(active_length_attention, fullgraph=True, dynamic=False)
    for n in (1, FLEX_BLOCK, FLEX_BLOCK + 1, 4 * FLEX_BLOCK - 3):
        lengths.fill_(n)
        # past the length: garbage in the block the length ends in (read, weighted 0), NaN in
        # every later block (never read)
        kp, vp = k.clone(), v.clone()
        end = -(-n // FLEX_BLOCK) * FLEX_BLOCK
        kp[:, :, n:end], vp[:, :, n:end] = 1e4, 1e4
        kp[:, :, end:], vp[:, :, end:] = float("nan"), float("nan")
        got = attend(q, kp, vp, lengths).float()
        kk, vv = (t[:, :, :n].float().repeat_interleave(4, 1) for t in (k, v))
        want = torch.softmax(q.float() @ kk.mT, -1) @ vv
        assert torch.isfinite(got).all() and (got - want).abs().max() < 2e-2, n
