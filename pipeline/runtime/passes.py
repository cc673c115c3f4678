"""Lowering passes of the optimized mode: rewrites of a program's per-call steps, run once at load.

They stand for what an optimizing engine (TensorRT) does around a plugin: GEMMs that read one
activation become one GEMM, a decode step's one-row GEMMs get a GEMV kernel of their own, a
prompt's normalizations, gated SiLUs and rotary embeddings become one kernel each, and so do
the chains a compiled decode step would otherwise run as several small kernels (a residual add
with its normalization; everything from the q/k/v product to the attention). A SLOT is never
merged with anything: it stays an opaque call, exactly a plugin's fusion barrier.
"""
from __future__ import annotations

import math

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
    benchmarks/gpu_decode_kernels.py), else cuBLAS."""
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

    def source(self, t: str, kind: str, reader: int) -> int:
        """The layer making `t`, which must be a `kind` whose output only code[reader] reads."""
        i = self.made.get(t)
        if i is None or self.internal(t) != [reader]:
            raise _NoMatch
        self.layer(i, kind)
        return i

    def dtype(self, i: int) -> torch.dtype:
        return self.ctx.out(self.code[i][1]).torch_dtype


def _rms_norm(reads: _Reads, i: int):
    """The normalization a CAST at code[i] starts, as the Qwen3 family builds it: xf = CAST(x) to
    FP32; r = RECIP(SQRT(AVG(xf * xf over the last dim) + eps)); out = weight * CAST(xf * r).
    Returns (members, inputs, outputs, fast step, attrs)."""
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
    return ([i, square, mean, add, root, recip, scale, back, times], [x, w], [reads.out(times)],
            fast, {"eps": eps})


def _silu_gate(reads: _Reads, i: int):
    """The gated SiLU a SIGMOID at code[i] starts: out = (g * SIGMOID(g)) * u, every layer in the
    same dtype. Returns (members, inputs, outputs, fast step, attrs)."""
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
    return [i, gated, times], [g, u], [reads.out(times)], fast, {}


def _rotary(reads: _Reads, i: int):
    """The rotary embedding by position at code[i], with the query's scale when it follows:
    CAST to FP32, PROD by a one-element constant, CAST back. Returns (members, inputs,
    outputs, fast step, attrs)."""
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
    return members, [x, positions, cos, sin], [reads.out(members[-1])], fast, {"scale": scale}


_CHAINS = {"RMS_NORM": _rms_norm, "SILU_GATE": _silu_gate, "ROTARY": _rotary}


PROBE_ELEMENTS = 1 << 22  # the largest tensor `_rows_to_rows` probes with (a larger one: no match)


def _rows_to_rows(step, shape: list[int]) -> bool:
    """`step` (a SHUFFLE's) moves whole rows of the last dim and keeps that dim: what lets a
    row-wise operation before it run after it. Probed on CPU index tensors, a dynamic dim as 2
    and as 3."""
    d = shape[-1]
    if d < 1:
        return False
    for n in (2, 3):
        dims = [n if s == -1 else s for s in shape]
        if math.prod(dims) > PROBE_ELEMENTS:
            return False
        try:
            y = step(torch.arange(math.prod(dims)).reshape(dims))
        except RuntimeError:
            return False
        rows = y.reshape(-1, d) if y.shape[-1] == d else None
        if rows is None or not (rows - rows[:, :1] == torch.arange(d)).all() or \
                not (rows[:, 0] % d == 0).all():
            return False
    return True


def _attention_operands(reads: _Reads, i: int) -> tuple[str, int, int]:
    """(query, its key cache write, its value cache write) of the attention at code[i]: an
    ATTENTION_INPUT's first three inputs, or those a SLOT in its place reads (a kernel's decode
    attention): one made by a ROTARY, two by KV_CACHE_UPDATEs, the key's fed by a ROTARY."""
    layer = reads.code[i][1]
    kind = lambda t: reads.code[reads.made[t]][1]["type"] if t in reads.made else None  # noqa: E731
    if layer["type"] == "ATTENTION_INPUT":
        q, k_out, v_out = layer["inputs"][:3]
    elif layer["type"] == "SLOT":
        inputs = [t for t in layer["inputs"] if t is not None]
        queries = [t for t in inputs if kind(t) == "ROTARY"]
        caches = sorted((t for t in inputs if kind(t) == "KV_CACHE_UPDATE"),
                        key=lambda t: kind(reads.code[reads.made[t]][1]["inputs"][1]) != "ROTARY")
        if len(queries) != 1 or len(caches) != 2:
            raise _NoMatch
        (q,), (k_out, v_out) = queries, caches
    else:
        raise _NoMatch
    updates = tuple(reads.made.get(t, -1) for t in (k_out, v_out))
    for u in updates:
        reads.layer(u, "KV_CACHE_UPDATE")
    return (q, *updates)


def _attention_inputs(reads: _Reads, i: int):
    """What feeds the attention at code[i] (`_attention_operands`) once `fuse_row_chains` has
    run: the query's and the key's heads each RMS_NORM -> SHUFFLE -> ROTARY (the query's
    scaled), the key's written by a KV_CACHE_UPDATE, the value's written by another at the same
    index; one dtype throughout. Returns (members, inputs, outputs, fast step, attrs)."""
    ctx = reads.ctx
    q, update_k, update_v = _attention_operands(reads, i)
    k_cache, k_rot, start = reads.code[update_k][1]["inputs"][:3]
    v_cache, v, v_start = reads.code[update_v][1]["inputs"][:3]
    if start != v_start or reads.readers.get(k_cache) != [update_k] or \
            reads.readers.get(v_cache) != [update_v]:
        raise _NoMatch
    members, heads, tables, attrs = [], [], [], []
    for t, reader in ((q, i), (k_rot, update_k)):
        rope = reads.source(t, "ROTARY", reader)
        x, *table = reads.code[rope][1]["inputs"][:4]
        shuffle = reads.source(x, "SHUFFLE", rope)
        pre = reads.code[shuffle][1]["inputs"]
        norm = reads.source(pre[0], "RMS_NORM", shuffle)
        head, weight = reads.code[norm][1]["inputs"][:2]
        if any(t is not None for t in pre[1:]) or \
                not _rows_to_rows(reads.code[shuffle][0], list(ctx.spec(head).shape)):
            raise _NoMatch
        members += [norm, shuffle, rope]
        heads.append((head, weight, reads.code[shuffle][0]))
        tables.append(table)
        attrs.append((reads.code[norm][1]["attrs"]["eps"], reads.code[rope][1]["attrs"]["scale"]))
    if tables[0] != tables[1] or attrs[1][1] is not None or len({
            ctx.spec(t).dtype for m in members + [update_k, update_v]
            for t in reads.code[m][1]["outputs"]} | {ctx.spec(v).dtype}) != 1:
        raise _NoMatch
    (q_head, q_weight, q_shuffle), (k_head, k_weight, k_shuffle) = heads
    (q_eps, scale), (k_eps, _) = attrs
    scale = 1.0 if scale is None else scale
    inputs = [q_head, k_head, v, *tables[0], k_cache, v_cache, start, q_weight, k_weight]
    if len(set(inputs)) != len(inputs):
        raise _NoMatch

    def fast(xq, xk, v, positions, cos, sin, k_cache, v_cache, start, wq, wk, *_):
        from pipeline.runtime import triton_rows
        args = (q_shuffle(xq), k_shuffle(xk), v, wq.reshape(-1), wk.reshape(-1), cos, sin,
                positions, start, k_cache, v_cache)
        if not triton_rows.supports_norm_rotary_cache(*args):
            return None
        return triton_rows.norm_rotary_cache(*args, q_eps, k_eps, scale), k_cache, v_cache
    outputs = [q, reads.out(update_k), reads.out(update_v)]
    return members + [update_k, update_v], inputs, outputs, fast, {}


def _add_rms_norm(reads: _Reads, i: int):
    """The normalization at code[i] (an RMS_NORM of `fuse_row_chains`) of a sum that something
    else reads too (a residual stream), with that sum: a + b -> RMS_NORM, one dtype and shape
    throughout. Returns (members, inputs, outputs, fast step, attrs)."""
    ctx, norm = reads.ctx, reads.layer(i, "RMS_NORM")
    x, weight = norm["inputs"][:2]
    add = reads.made.get(x, -1)
    if add < 0 or len(reads.readers.get(x, [])) < 2 and x not in reads.kept:
        raise _NoMatch
    a, b = reads.layer(add, "ELEMENTWISE", "SUM")["inputs"][:2]
    if any(ctx.constant(t) is not None for t in (a, b)) or \
            len({ctx.spec(t).shape for t in (a, b, x)}) != 1 or \
            len({ctx.spec(t).dtype for t in (a, b, x, norm["outputs"][0])}) != 1:
        raise _NoMatch
    eps = norm["attrs"]["eps"]

    def fast(a, b, weight, *_):
        from pipeline.runtime import triton_rows
        weight = weight.reshape(-1)
        if not triton_rows.supports_add_rms_norm(a, b, weight):
            return None
        return triton_rows.add_rms_norm(a, b, weight, eps)
    return [add, i], [a, b, weight], [x, norm["outputs"][0]], fast, {"eps": eps}


def fuse_row_chains(ctx, code: list, outputs: list[str]) -> list:
    """Each normalization, gated SiLU and rotary embedding (`_CHAINS`) whose intermediates
    nothing else reads becomes one step: on CUDA and uncompiled (a prefill), one kernel of
    triton_rows; traced by torch.compile (a decode step, where Inductor fuses a lone chain
    itself) or where the kernel does not apply, its layers' own steps in order."""
    return _fuse(ctx, code, outputs, _CHAINS, traced=False)


_TRACED_CHAINS = {"NORM_ROTARY_CACHE": _attention_inputs, "ADD_RMS_NORM": _add_rms_norm}


def fuse_traced_chains(ctx, code: list, outputs: list[str]) -> list:
    """After `fuse_row_chains`, chains that stay one kernel in a compiled step too (a decode
    step's, where Inductor left them several kernels or two passes over a row), on CUDA
    whether compiled or not: the query's and key's normalizations, rotary embeddings and both
    cache writes before each attention (`_attention_inputs`: triton_rows.norm_rotary_cache),
    and a residual add with the normalization after it (`_add_rms_norm`)."""
    return _fuse(ctx, code, outputs, _TRACED_CHAINS, traced=True)


def _fuse(ctx, code: list, outputs: list[str], chains: dict, traced: bool) -> list:
    """Every match of `chains` (kind -> matcher) whose members no earlier match took becomes one
    `_fused` step, run where its last member ran (so its inputs must be made and its outputs
    read only before and after that). The match names the outputs its fast step returns, in
    order: they must be exactly the members' outputs that anything else reads."""
    reads = _Reads(ctx, code, outputs)
    fused: dict = {}
    taken: set = set()
    for i in range(len(code)):
        for kind, chain in chains.items():
            try:
                members, inputs, returned, fast, attrs = chain(reads, i)
            except _NoMatch:
                continue
            at = max(members)
            made = [t for m in members for t in code[m][1]["outputs"]]
            kept = [t for t in made if t in reads.kept or not set(
                reads.readers.get(t, [])) <= set(members)]
            if taken.isdisjoint(members) and kept == returned \
                    and all(reads.made.get(t, -1) < at for t in inputs) \
                    and all(r > at for t in kept for r in reads.readers.get(t, [])
                            if r not in members):
                taken.update(members)
                fused[at] = _fused(ctx, kind, [code[m] for m in members], inputs, fast, attrs,
                                   returned, traced)
    return [fused.get(i, entry) for i, entry in enumerate(code) if i in fused or i not in taken]


def kernels_run_on(x: torch.Tensor) -> bool:
    """A fused step's kernel runs on x's device: CUDA (the tests stand Triton's interpreter in
    on the CPU)."""
    return x.is_cuda


def _fused(ctx, kind: str, entries: list, inputs: list[str], fast, attrs: dict,
           outputs: list[str], traced: bool) -> tuple:
    """(step, node) running `entries` (single-output steps, in the order given) as one and
    returning `outputs` (a tuple when several), through `fast` when it applies: on CUDA, and
    only uncompiled unless `traced`. The step takes `inputs`, then every other constant the
    entries read, so it holds no tensor of its own, and its wiring is positions, not tensor ids:
    the same chain in every layer is one step (blocks.py)."""
    layers = [layer for _, layer in entries]
    inputs = list(dict.fromkeys(inputs + [t for layer in layers for t in layer["inputs"]
                                          if t is not None and ctx.constant(t) is not None]))
    position = {t: i for i, t in enumerate(inputs)}
    wiring = []
    for layer in layers:
        wiring.append(tuple(None if t is None else position[t] for t in layer["inputs"]))
        position[layer["outputs"][0]] = len(position)
    steps = [step for step, _ in entries]
    returned = tuple(position[t] for t in outputs)

    def step(*xs):
        if kernels_run_on(xs[0]) and (traced or not torch.compiler.is_compiling()):
            y = fast(*xs)
            if y is not None:
                return y
        values = list(xs)
        for member, at in zip(steps, wiring):
            values.append(member(*[None if i is None else values[i] for i in at]))
        return values[returned[0]] if len(returned) == 1 else tuple(values[i] for i in returned)
    node = {"id": "+".join(layer["id"] for layer in layers), "type": kind,
            "name": "fused " + ", ".join(layer["name"] for layer in layers),
            "inputs": inputs, "outputs": list(outputs), "attrs": attrs}
    return step, node
