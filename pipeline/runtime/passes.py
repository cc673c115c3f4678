"""Lowering passes of the optimized mode: rewrites of a program's per-call steps, run once at load.

They stand for what an optimizing engine (TensorRT) does around a plugin: work the network does
not need per call is folded away, and GEMMs that read one activation become one GEMM. A SLOT is
never merged with anything: it stays an opaque call, exactly a plugin's fusion barrier.
"""
from __future__ import annotations

import torch


def _mergeable(layer: dict, ctx) -> bool:
    """x @ W^T with W a load-time constant (a linear layer's weight)."""
    a = layer["attrs"]
    return (layer["type"] == "MATRIX_MULTIPLY" and a["op0"] == "NONE" and a["op1"] == "TRANSPOSE"
            and ctx.constant(layer["inputs"][1]) is not None
            and ctx.constant(layer["inputs"][1]).dim() == 2)


def _merged_step(weights: list[torch.Tensor], acc: torch.dtype, out: torch.dtype):
    sizes = [w.shape[0] for w in weights]
    wt = torch.cat([w.to(acc) for w in weights]).mT  # one [K, sum N] operand, made once

    def step(x):
        return tuple(y.to(out) for y in torch.split(torch.matmul(x.to(acc), wt), sizes, dim=-1))
    return step


def merge_shared_input_gemms(ctx, code: list, uses: dict[str, int], shared: dict | None = None) -> list:
    """GEMMs that share their activation input (q/k/v, gate/up) become one GEMM over the
    concatenated weights and a split; the merged weight replaces the originals (no second copy
    is kept once the originals have no other use). `shared` (weights -> merged step) lets the
    programs of one pipeline (prefill and decode) share each merged weight."""
    shared = {} if shared is None else shared
    groups: dict[tuple, list[int]] = {}
    for i, (_, layer) in enumerate(code):
        if _mergeable(layer, ctx):
            key = (layer["inputs"][0], ctx.out(layer).dtype, ctx.constant(layer["inputs"][1]).dtype)
            groups.setdefault(key, []).append(i)
    merged, dropped = {}, set()
    for members in groups.values():
        if len(members) < 2:
            continue
        layers = [code[i][1] for i in members]
        out = ctx.out(layers[0]).torch_dtype
        weights = [ctx.constant(layer["inputs"][1]) for layer in layers]
        key = tuple((w.data_ptr(), tuple(w.shape), w.dtype) for w in weights) + (out,)
        if key not in shared:
            shared[key] = _merged_step(weights, ctx.accumulate(out), out)
        step = shared[key]
        node = {"id": "+".join(layer["id"] for layer in layers), "type": "MATRIX_MULTIPLY",
                "name": "merged " + ", ".join(layer["name"] for layer in layers),
                "inputs": [layers[0]["inputs"][0]],
                "outputs": [t for layer in layers for t in layer["outputs"]], "attrs": {}}
        merged[members[0]] = (step, node)
        dropped.update(members[1:])
        for layer in layers:
            w = layer["inputs"][1]
            uses[w] -= 1
            if uses[w] == 0:
                del ctx.constants[w]
    return [merged.get(i, entry) for i, entry in enumerate(code) if i not in dropped]
