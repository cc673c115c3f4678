"""The region harness the probe and the perf gate share: a slot's shape space (its dynamic dims
traced to the optimization profile, the KV cache capacity, the typical case), the shape cases
probed, fresh random inputs of a case, the workspace, and the native region's expected output.

Shapes: every dynamic dimension (-1 in the ABI) traced to the optimization profile's range of the
network input it depends on (FALLBACK_DIMS where that is unknown, said in `notes`), at every
length class of that range (`length_classes`: 1, 2, small odd lengths, every power of two and its
neighbours, random lengths, the maximum), plus any length a caller saw in situ; a KV length input
(the family's `total_length`) at every length class of 1..cache capacity.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from pipeline import dtypes, isolation
from pipeline.graph.model import Graph
from pipeline.runtime.remote import KernelsInHost

FALLBACK_DIMS = (1, 7, 64)  # a dynamic dim no profile bounds: small, typical, a capped max
INT_RANGE = (1, 16)   # other integer inputs are lengths/indices in practice: small and positive
RANDOM_LENGTHS = 2    # random lengths per dynamic range, besides the fixed classes
EVERY_LENGTH = 256    # a range of at most this many lengths is probed at every one of them
# a longer one at a drawn length of every residue modulo this, so of every residue modulo each
# tile size that divides it (8, 16, 32, 64): a fault tied to one residue is met at some length
RESIDUE_MODULUS = 128
MODULI = (8, 16, 32, 64, 128)  # the tile sizes a probe's coverage is stated for


# -- shapes -------------------------------------------------------------------------------------
def _network_sources(g: Graph, export: dict, tensor_id: str) -> set[str]:
    """The network inputs `tensor_id` is computed from."""
    inputs = set(export["inputs"])
    found = {tensor_id} & inputs
    for layer in g.live(inputs, [tensor_id]):
        found.update(t for t in layer["inputs"] if t in inputs)
    return found


def length_classes(lo: int, hi: int, rng: random.Random | None = None,
                   seen: tuple[int, ...] = ()) -> list[int]:
    """Every length of [lo, hi] when it holds at most EVERY_LENGTH; else every length class: 1, 2,
    small odd lengths, each power of two and its neighbours, the lengths `seen` in situ, hi, and
    with `rng` RANDOM_LENGTHS random lengths and a drawn length of every residue modulo
    RESIDUE_MODULUS."""
    if hi - lo + 1 <= EVERY_LENGTH:
        return list(range(lo, hi + 1))
    fixed = {1, 2, 3, 5, 7, hi, lo, *seen}
    p = 1
    while p <= hi:
        fixed |= {p - 1, p, p + 1}
        p *= 2
    if rng is not None:
        fixed |= {rng.randint(lo, hi) for _ in range(RANDOM_LENGTHS)}
        for r in range(RESIDUE_MODULUS):
            first = lo + (r - lo) % RESIDUE_MODULUS  # the least length of residue r
            if first <= hi:
                fixed.add(first + RESIDUE_MODULUS * rng.randint(0, (hi - first) // RESIDUE_MODULUS))
    return sorted(n for n in fixed if lo <= n <= hi)


def coverage(lengths, lo: int, hi: int) -> dict:
    """What a probe's lengths cover of [lo, hi]: how many, whether every one, and per modulus in
    MODULI the share of its residues met (1.0: a fault tied to any one residue is met)."""
    lengths = sorted(set(lengths))
    return {"range": [lo, hi], "lengths": len(lengths), "every_length": len(lengths) == hi - lo + 1,
            "residues": {str(m): len({n % m for n in lengths}) / min(m, hi - lo + 1)
                         for m in MODULI}}


def space_coverage(space: ShapeSpace, cases: list[dict]) -> dict:
    """The probe's coverage (`coverage`) of the dynamic dims' range and of the KV lengths."""
    out: dict[str, dict | None] = {"dims": None, "kv_length": None}
    if space.dims is not None:
        out["dims"] = coverage([c["dim"] for c in cases], space.dims[0], space.dims[2])
    if space.capacity is not None:
        out["kv_length"] = coverage([c["kv_length"] for c in cases], 1, space.capacity)
    return out


def _dim_range(pipeline, region, export) -> tuple[tuple[int, int, int] | None, list[str]]:
    """(min, typical, max) of the region's dynamic dims from the profile, FALLBACK_DIMS when they
    trace to no single profiled range (said in the notes), None when the inputs are static."""
    profile = pipeline.family.profile(region.engine_role, pipeline.bundle.manifest["build_options"])
    tensors = {t["id"]: t for t in export["tensors"]}
    g, ranges = Graph.of_export(export), set()
    for tid, spec in zip(region.input_ids, region.abi["inputs"]):
        if -1 not in spec["shape"]:
            continue
        for src in _network_sources(g, export, tid):
            name = tensors[src]["name"]
            if name in profile:
                lo, opt, hi = profile[name]
                ranges |= {(lo[d], opt[d], hi[d]) for d, n in enumerate(tensors[src]["shape"]) if n < 0}
    if len(ranges) == 1:
        return next(iter(ranges)), []
    if any(-1 in s["shape"] for s in region.abi["inputs"]):
        return FALLBACK_DIMS, [f"dynamic dims not traced to one profiled network input range "
                               f"({sorted(ranges) or 'no profile'}): probed in {FALLBACK_DIMS[0]}.."
                               f"{FALLBACK_DIMS[-1]} (a capped max)"]
    return None, []


def _capacity(pipeline, region, export) -> int | None:
    """The KV cache capacity when the region takes a KV length input, else None."""
    if _kv_input(region, pipeline.family.io) is None:
        return None
    return next(t["shape"][2] for t in export["tensors"]
                if t["id"] in export["inputs"] and pipeline.family.io.is_cache(t["name"]))


@dataclass(frozen=True)
class ShapeSpace:
    """What a region's shapes may be, traced once through the network export: its dynamic dims'
    (min, typical, max), the KV cache capacity, and the typical case (the profile's typical dims
    and half the cache: the case a region is timed at)."""
    dims: tuple[int, int, int] | None
    capacity: int | None
    notes: tuple[str, ...]

    @property
    def typical(self) -> dict:
        return {"dim": None if self.dims is None else self.dims[1],
                "kv_length": None if self.capacity is None else (self.capacity + 1) // 2}


def shape_space(pipeline, region) -> ShapeSpace:
    export = pipeline.bundle.network(region.engine_role)
    dims, notes = _dim_range(pipeline, region, export)
    return ShapeSpace(dims, _capacity(pipeline, region, export), tuple(notes))


def shape_cases(pipeline, region, rng: random.Random | None = None,
                seen: tuple[int, ...] = (), space: ShapeSpace | None = None
                ) -> tuple[list[dict], list[str]]:
    """-> (cases {"dim": value of every dynamic dim or None, "kv_length": int or None}, notes):
    every length class of the dims at the typical KV length, and of the KV length at the typical
    dims. `seen`: dims met in situ, probed too; `space`: the region's, when traced already."""
    space = space or shape_space(pipeline, region)
    typical, notes = space.typical, list(space.notes)
    cases = [typical]
    if space.dims is not None:
        lo, _, hi = space.dims
        cases += [{**typical, "dim": d} for d in length_classes(lo, hi, rng, seen)]
    if space.capacity is not None:
        kv = _kv_input(region, pipeline.family.io)
        lengths = length_classes(1, space.capacity, rng)
        cases += [{**typical, "kv_length": n} for n in lengths]
        notes.append(f"input[{kv}] '{region.input_names[kv]}' is the KV length: probed at "
                     f"{len(lengths)} lengths in 1..{space.capacity} (the cache capacity)")
    unique = {case_label(c): c for c in cases}
    return sorted(unique.values(), key=lambda c: (c["dim"] or 0, c["kv_length"] or 0)), notes


def seen_dims(region, input_shapes: list[list[int]]) -> set[int]:
    """The values the region's dynamic dims took in one call with these input shapes."""
    return {shape[j] for spec, shape in zip(region.abi["inputs"], input_shapes)
            for j, d in enumerate(spec["shape"]) if d < 0}


def _kv_input(region, io) -> int | None:
    name = getattr(io, "total_length", None)
    for i, (n, spec) in enumerate(zip(region.input_names, region.abi["inputs"])):
        if n == name and spec["dtype"] == "INT32" and spec["shape"] == [1]:
            return i
    return None


def in_situ_case(region, io, inputs: list[torch.Tensor]) -> dict:
    """A case whose inputs are a slot call's own, as a run met them (`in_situ`)."""
    kv = _kv_input(region, io)
    dims = seen_dims(region, [list(x.shape) for x in inputs])
    return {"dim": min(dims) if dims else None,
            "kv_length": None if kv is None else int(inputs[kv].reshape(-1)[0]),
            "in_situ": tuple(x.detach().clone() for x in inputs)}


PERTURBATION = 0.05  # a perturbed in-situ case scales each float by 1 + this x a standard normal


def random_inputs(region, io, case: dict, gen: torch.Generator, device) -> list[torch.Tensor]:
    """Fresh inputs of one case: normal floats, small positive integers, the KV length as given;
    an in-situ case's own inputs, copied, and a perturbed one's with every float scaled by a fresh
    1 + PERTURBATION x N(0, 1) (values like the model's own, never the same twice). They are drawn
    on the generator's device (a CPU generator gives the same values everywhere)."""
    if "in_situ" in case:
        out = [x.clone().to(device) for x in case["in_situ"]]
        if case.get("perturbed"):
            for x in out:
                if x.is_floating_point():
                    noise = torch.randn(x.shape, generator=gen, dtype=torch.float32, device=gen.device)
                    x.mul_((1 + PERTURBATION * noise).to(device=x.device, dtype=x.dtype))
        return out
    kv = _kv_input(region, io)
    out = []
    for i, spec in enumerate(region.abi["inputs"]):
        shape = [case["dim"] if d < 0 else d for d in spec["shape"]]
        dtype = dtypes.torch_dtype(spec["dtype"])
        if i == kv:
            t = torch.tensor([case["kv_length"]], dtype=dtype)
        elif not dtypes.BY_NAME[spec["dtype"]].floating:
            t = torch.randint(*INT_RANGE, shape, generator=gen, dtype=dtype, device=gen.device)
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float32, device=gen.device).to(dtype)
        out.append(t.to(device))
    return out


# -- one call's buffers ---------------------------------------------------------------------------
def workspace(region, device) -> torch.Tensor | None:
    """The slot's scratch for one call, every byte dtypes.WORKSPACE_POISON (never zeros)."""
    n = region.abi["workspace_bytes"]
    return torch.full((n,), dtypes.WORKSPACE_POISON, dtype=torch.uint8, device=device) if n > 0 else None


def expected_output(region, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The native region on copies, so its result never depends on what the kernel does."""
    return region.native(**dict(zip(region.input_names, [x.clone() for x in inputs])))[region.output_name]


def case_label(case: dict) -> str:
    parts = ([f"dim={case['dim']}"] if case["dim"] is not None else []) + \
            ([f"kv_length={case['kv_length']}"] if case["kv_length"] is not None else [])
    label = " ".join(parts) or "static"
    if "in_situ" in case:
        return f"in situ{' perturbed' if case.get('perturbed') else ''} {label}"
    return label


def allow_calls(pipeline, native_s: float) -> None:
    """Raise the per-call limit of wherever `pipeline`'s kernels run from the native region's
    time: a kernel host's (pipeline/host), or this worker's (pipeline/isolation.py)."""
    isolation.set_call_limit(native_s, pipeline.call_limits()
                             if isinstance(pipeline, KernelsInHost) else None)


def native_seconds(region, case: dict, io, device) -> float:
    """One call of the native region at `case` (after one to warm up), synchronised: what a
    kernel call's time limit is derived from (pipeline/isolation.py)."""
    inputs = random_inputs(region, io, case, torch.Generator().manual_seed(0), device)
    expected_output(region, inputs)
    t0 = time.perf_counter()
    expected_output(region, inputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
