"""Lowering passes of the optimized mode: rewrites of a program's per-call steps, run once at load.

They stand for what an optimizing engine (TensorRT) does around a plugin: GEMMs that read one
activation become one GEMM, and a decode step's one-row GEMMs get a GEMV kernel of their own.
A SLOT is never merged with anything: it stays an opaque call, exactly a plugin's fusion barrier.
"""
from __future__ import annotations

import torch


def _mergeable(layer: dict, ctx) -> bool:
    """x @ W^T with W a load-time constant (a linear layer's weight)."""
    a = layer["attrs"]
    return (layer["type"] == "MATRIX_MULTIPLY" and a["op0"] == "NONE" and a["op1"] == "TRANSPOSE"
            and ctx.constant(layer["inputs"][1]) is not None
            and ctx.constant(layer["inputs"][1]).dim() == 2)


def weight_gemm_step(weights: list[torch.Tensor], acc: torch.dtype, out: torch.dtype,
                     triton: bool):
    """x @ [W1; W2; ...]^T for load-time weights [Ni, K], over one weight made once (the
    members' rows concatenated), split into the members' outputs when there are several. With
    `triton` (`Lowering.triton`), a compiled step multiplying one row (decode) uses the Triton
    GEMV (triton_gemv: on the H200 1.06-1.32x cuBLAS at every Qwen3-8B decode shape,
    bench/gpu_decode_kernels.py), else cuBLAS."""
    weight = (weights[0].to(acc) if len(weights) == 1
              else torch.cat([w.to(acc) for w in weights])).contiguous()
    sizes = [w.shape[0] for w in weights]

    def product(x):
        x = x.to(acc)
        # also run uncompiled (a prefill shares the step): Triton only where it is traced
        if triton and x.shape[-2] == 1 and torch.compiler.is_compiling():  # static when traced
            from pipeline.runtime import triton_gemv
            if triton_gemv.supports(x, weight):
                return triton_gemv.gemv(x, weight).to(out)
        return torch.matmul(x, weight.mT).to(out)
    if len(sizes) == 1:
        return product
    return lambda x: torch.split(product(x), sizes, dim=-1)


def lower_weight_gemms(ctx, code: list, uses: dict[str, int], shared: dict | None = None) -> list:
    """Every GEMM of an activation by a load-time weight becomes a `weight_gemm_step`; those that
    share their activation input (q/k/v, gate/up) become one over the concatenated weights and a
    split. The step's weight replaces the originals (no second copy is kept once they have no other
    use). `shared` (the weights' origins -> step) lets the programs of one pipeline (prefill and
    decode) share each weight."""
    shared = {} if shared is None else shared
    groups: dict[tuple, list[int]] = {}
    for i, (_, layer) in enumerate(code):
        if _mergeable(layer, ctx):
            key = (layer["inputs"][0], ctx.out(layer).dtype, ctx.constant(layer["inputs"][1]).dtype)
            groups.setdefault(key, []).append(i)
    lowered, dropped = {}, set()
    for members in groups.values():
        layers = [code[i][1] for i in members]
        out = ctx.out(layers[0]).torch_dtype
        weights = [ctx.constant(layer["inputs"][1]) for layer in layers]
        key = tuple(ctx.origins[layer["inputs"][1]] for layer in layers) + (out,)
        if key not in shared:
            shared[key] = weight_gemm_step(weights, ctx.accumulate(out), out, ctx.triton)
        node = {"id": "+".join(layer["id"] for layer in layers), "type": "MATRIX_MULTIPLY",
                "name": ("merged " if len(layers) > 1 else "") + ", ".join(
                    layer["name"] for layer in layers),
                "inputs": [layers[0]["inputs"][0]],
                "outputs": [t for layer in layers for t in layer["outputs"]], "attrs": {}}
        lowered[members[0]] = (shared[key], node)
        dropped.update(members[1:])
        for layer in layers:
            w = layer["inputs"][1]
            uses[w] -= 1
            if uses[w] == 0:
                del ctx.constants[w]
    return [lowered.get(i, entry) for i, entry in enumerate(code) if i not in dropped]
