"""Lowering passes of the optimized mode: rewrites of a program's per-call steps, run once at load.

They stand for what an optimizing engine (TensorRT) does around a plugin: GEMMs that read one
activation become one GEMM, a decode step's one-row GEMMs get a GEMV kernel of their own, and
a prompt's normalizations, gated SiLUs and rotary embeddings become one kernel each. A SLOT is
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


def merged_weight(weights: list[torch.Tensor], acc: torch.dtype) -> torch.Tensor:
    """[W1; W2; ...] in `acc`, made once: the rows of load-time weights [Ni, K] concatenated."""
    return (weights[0].to(acc) if len(weights) == 1
            else torch.cat([w.to(acc) for w in weights])).contiguous()


def weight_gemm_step(sizes: list[int], out: torch.dtype, triton: bool):
    """(x, weight) -> x @ weight^T (a `merged_weight`), split into the members' outputs of `sizes`
    rows when there are several. The weight is an input, not held by the step, so every layer's
    GEMM of one shape is one step (what lets a repeated block compile once: blocks.py). With
    `triton` (`Lowering.triton`), a compiled step multiplying one row (decode) uses the Triton
    GEMV (triton_gemv: on the H200 1.08-1.43x cuBLAS at every Qwen3-8B decode shape,
    bench/gpu_decode_kernels.py), else cuBLAS."""
    def product(x, weight):
        x = x.to(weight.dtype)
        # also run uncompiled (a prefill shares the step): Triton only where it is traced
        if triton and x.shape[-2] == 1 and torch.compiler.is_compiling():  # static when traced
            from pipeline.runtime import triton_gemv
            if triton_gemv.supports(x, weight):
                return triton_gemv.gemv(x, weight).to(out)
        return torch.matmul(x, weight.mT).to(out)
    if len(sizes) == 1:
        return product
    return lambda x, weight: torch.split(product(x, weight), sizes, dim=-1)


def lower_weight_gemms(ctx, code: list, uses: dict[str, int], shared: dict | None = None) -> list:
    """Every GEMM of an activation by a load-time weight becomes a `weight_gemm_step`; those that
    share their activation input (q/k/v, gate/up) become one over the concatenated weights and a
    split. The merged weight (a new constant, the GEMM's second input) replaces the originals (no
    second copy is kept once they have no other use). `shared` (the weights' origins -> step and
    weight) lets the programs of one pipeline (prefill and decode) share each weight."""
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
            shared[key] = (weight_gemm_step([w.shape[0] for w in weights], out, ctx.triton),
                           merged_weight(weights, ctx.accumulate(out)))
        step, weight = shared[key]
        node_id = "+".join(layer["id"] for layer in layers)
        merged = f"weight:{node_id}"  # a constant of the program, not of the export
        ctx.constants[merged] = weight
        node = {"id": node_id, "type": "MATRIX_MULTIPLY",
                "name": ("merged " if len(layers) > 1 else "") + ", ".join(
                    layer["name"] for layer in layers),
                "inputs": [layers[0]["inputs"][0], merged],
                "outputs": [t for layer in layers for t in layer["outputs"]], "attrs": {}}
        lowered[members[0]] = (step, node)
        dropped.update(members[1:])
        for layer in layers:
            w = layer["inputs"][1]
            uses[w] -= 1
            if uses[w] == 0:
                del ctx.constants[w]
    return [lowered.get(i, entry) for i, entry in enumerate(code) if i not in dropped]


class _NoMatch(Exception):
    """The layers at hand are not the chain a fusion looks for."""


class _Reads:
    """Who makes and who reads each tensor of a program's per-call code, to follow a chain."""

    def __init__(self, ctx, code: list, outputs: list[str]):
        self.ctx, self.code, self.kept = ctx, code, set(outputs)
        self.made = {t: i for i, (_, layer) in enumerate(code) for t in layer["outputs"]}
        self.readers: dict[str, list[int]] = {}
        for i, (_, layer) in enumerate(code):
            for t in dict.fromkeys(t for t in layer["inputs"] if t is not None):
                self.readers.setdefault(t, []).append(i)

    def layer(self, i: int, kind: str, op: str | None = None) -> dict:
        """code[i]'s layer, which must be a `kind` (ELEMENTWISE, UNARY...) doing `op`."""
        layer = self.code[i][1]
        if layer["type"] != kind or op is not None and layer["attrs"].get("op") != op:
            raise _NoMatch
        return layer

    def internal(self, t: str) -> list[int]:
        """The layers reading `t`, which must be no program output."""
        if t in self.kept:
            raise _NoMatch
        return self.readers.get(t, [])

    def then(self, i: int, kind: str, op: str | None = None) -> int:
        """The only layer reading code[i]'s output, which must be a `kind` doing `op`."""
        readers = self.internal(self.out(i))
        if len(readers) != 1:
            raise _NoMatch
        self.layer(readers[0], kind, op)
        return readers[0]

    def beside(self, i: int, t: str) -> str:
        """The other input of binary layer code[i], one of whose inputs is `t`."""
        a, b = self.code[i][1]["inputs"][:2]
        if t not in (a, b):
            raise _NoMatch
        return b if a == t else a

    def constant(self, t: str, numel: int) -> torch.Tensor:
        value = self.ctx.constant(t)
        if value is None or value.numel() != numel:
            raise _NoMatch
        return value

    def out(self, i: int) -> str:
        return self.code[i][1]["outputs"][0]

    def dtype(self, i: int) -> torch.dtype:
        return self.ctx.out(self.code[i][1]).torch_dtype


def _rms_norm(reads: _Reads, i: int):
    """The normalization a CAST at code[i] starts, as the Qwen3 family builds it: xf = CAST(x) to
    FP32; r = RECIP(SQRT(AVG(xf * xf over the last dim) + eps)); out = weight * CAST(xf * r).
    Returns (members, inputs, fast step)."""
    ctx, cast = reads.ctx, reads.layer(i, "CAST")
    x, xf = cast["inputs"][0], cast["outputs"][0]
    shape = ctx.spec(xf).shape
    if ctx.spec(xf).dtype != "FP32" or shape[-1] == -1:
        raise _NoMatch
    readers = reads.internal(xf)
    if len(readers) != 2 or reads.layer(readers[0], "ELEMENTWISE", "PROD")["inputs"] != [xf, xf]:
        raise _NoMatch
    square, scale = readers
    mean = reads.then(square, "REDUCE", "AVG")
    attrs = reads.code[mean][1]["attrs"]
    if attrs["axes"] != 1 << (len(shape) - 1) or not attrs["keep_dims"]:
        raise _NoMatch
    add = reads.then(mean, "ELEMENTWISE", "SUM")
    eps = float(reads.constant(reads.beside(add, reads.out(mean)), 1))
    root = reads.then(add, "UNARY", "SQRT")
    recip = reads.then(root, "UNARY", "RECIP")
    if reads.then(recip, "ELEMENTWISE", "PROD") != scale or \
            reads.beside(scale, reads.out(recip)) != xf:
        raise _NoMatch
    back = reads.then(scale, "CAST")
    times = reads.then(back, "ELEMENTWISE", "PROD")
    w = reads.beside(times, reads.out(back))
    out = reads.dtype(times)
    if reads.constant(w, shape[-1]).dtype != out or reads.dtype(back) != out:
        raise _NoMatch

    def fast(x, weight, *_):
        from pipeline.runtime import triton_rows
        weight = weight.reshape(-1)
        if triton_rows.supports_rms_norm(x, weight, out):
            return triton_rows.rms_norm(x, weight, eps, out)
        return None
    return [i, square, mean, add, root, recip, scale, back, times], [x, w], fast


def _silu_gate(reads: _Reads, i: int):
    """The gated SiLU a SIGMOID at code[i] starts: out = (g * SIGMOID(g)) * u, every layer in the
    same dtype. Returns (members, inputs, fast step)."""
    ctx, act = reads.ctx, reads.layer(i, "ACTIVATION")
    g = act["inputs"][0]
    if act["attrs"]["type"] != "SIGMOID" or len(reads.internal(g)) != 2:
        raise _NoMatch
    gated = reads.then(i, "ELEMENTWISE", "PROD")
    if reads.beside(gated, reads.out(i)) != g:
        raise _NoMatch
    times = reads.then(gated, "ELEMENTWISE", "PROD")
    u = reads.beside(times, reads.out(gated))
    dtype = ctx.spec(g).torch_dtype
    if ctx.constant(u) is not None or {ctx.spec(u).torch_dtype, reads.dtype(i), reads.dtype(gated),
                                       reads.dtype(times)} != {dtype}:
        raise _NoMatch

    def fast(g, u, *_):
        from pipeline.runtime import triton_rows
        return triton_rows.silu_gate(g, u) if triton_rows.supports_silu_gate(g, u) else None
    return [i, gated, times], [g, u], fast


def _rotary(reads: _Reads, i: int):
    """The rotary embedding by position at code[i], with the query's scale when it follows:
    CAST to FP32, PROD by a one-element constant, CAST back. Returns (members, inputs, fast
    step)."""
    ctx, rope = reads.ctx, reads.layer(i, "ROTARY_EMBEDDING")
    x, cos, sin, positions = (rope["inputs"] + [None] * 4)[:4]
    if positions is None or ctx.constant(cos) is None or ctx.constant(sin) is None or \
            rope["attrs"]["interleaved"] or \
            rope["attrs"]["rotary_embedding_dim"] != ctx.spec(x).shape[-1]:
        raise _NoMatch
    out = reads.dtype(i)
    members, scale = [i], None
    try:
        up = reads.then(i, "CAST")
        times = reads.then(up, "ELEMENTWISE", "PROD")
        factor = reads.constant(reads.beside(times, reads.out(up)), 1)
        down = reads.then(times, "CAST")
        if reads.dtype(up) == factor.dtype == torch.float32 and reads.dtype(down) == out:
            members, scale = [i, up, times, down], float(factor)
    except _NoMatch:
        pass

    def fast(x, positions, cos, sin, *_):
        from pipeline.runtime import triton_rows
        if triton_rows.supports_rotary(x, cos, sin, positions):
            return triton_rows.rotary(x, cos, sin, positions, scale, out)
        return None
    return members, [x, positions, cos, sin], fast


_CHAINS = {"RMS_NORM": _rms_norm, "SILU_GATE": _silu_gate, "ROTARY": _rotary}


def fuse_row_chains(ctx, code: list, outputs: list[str]) -> list:
    """Each normalization, gated SiLU and rotary embedding (`_CHAINS`) whose intermediates
    nothing else reads becomes one step: on CUDA and uncompiled (a prefill), one kernel of
    triton_rows; traced by torch.compile (a decode step, which Inductor fuses itself) or where
    the kernel does not apply, its layers' own steps in order. The step runs where the chain's
    first layer ran."""
    reads = _Reads(ctx, code, outputs)
    fused, taken = {}, set()
    for i in range(len(code)):
        for kind, chain in _CHAINS.items():
            try:
                members, inputs, fast = chain(reads, i)
            except _NoMatch:
                continue
            if taken.isdisjoint(members) and all(reads.made.get(t, -1) < i for t in inputs):
                taken.update(members)
                fused[i] = _fused(ctx, kind, [code[m] for m in members], inputs, fast)
    return [fused.get(i, entry) for i, entry in enumerate(code) if i in fused or i not in taken]


def _fused(ctx, kind: str, entries: list, inputs: list[str], fast) -> tuple:
    """(step, node) running `entries` (single-output steps in order) as one, through `fast`
    when it applies. The step takes `inputs`, then every other constant the entries read, so it
    holds no tensor of its own, and its wiring is positions, not tensor ids: the same chain in
    every layer is one step (blocks.py)."""
    layers = [layer for _, layer in entries]
    inputs = list(dict.fromkeys(inputs + [t for layer in layers for t in layer["inputs"]
                                          if t is not None and ctx.constant(t) is not None]))
    position = {t: i for i, t in enumerate(inputs)}
    wiring = []
    for layer in layers:
        wiring.append(tuple(None if t is None else position[t] for t in layer["inputs"]))
        position[layer["outputs"][0]] = len(position)
    steps = [step for step, _ in entries]

    def step(*xs):
        if not torch.compiler.is_compiling() and xs[0].is_cuda:
            y = fast(*xs)
            if y is not None:
                return y
        values = list(xs)
        for member, at in zip(steps, wiring):
            values.append(member(*[None if i is None else values[i] for i in at]))
        return values[-1]
    node = {"id": "+".join(layer["id"] for layer in layers), "type": kind,
            "name": "fused " + ", ".join(layer["name"] for layer in layers),
            "inputs": inputs, "outputs": [layers[-1]["outputs"][0]], "attrs": {}}
    return step, node
