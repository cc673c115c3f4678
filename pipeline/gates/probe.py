"""Region probe: run the native region and the bound kernel of an open pipeline on the same fresh
random inputs.

Outputs are poisoned first (NaN, or the lowest integer), so a kernel that writes nothing or
computes another function is caught before any end-to-end gate. Tolerances follow common kernel
gating practice (KernelBench/tritonbench): 1e-4 for FP32, 1e-2 for FP16, 2e-2 for BF16, exact for
INT32, scaled by max(1, max |expected|).
"""
from __future__ import annotations

import torch

from pipeline import dtypes
from pipeline.graph.abi import call_order

TOLERANCE = {"FP32": 1e-4, "FP16": 1e-2, "BF16": 2e-2, "INT32": 0.0}
DYNAMIC_DIM = 7      # size given to -1 dims of probe inputs
INT_RANGE = (1, 16)  # integer inputs are lengths/indices in practice: keep them small and positive


def _random(spec: dict, gen: torch.Generator, device) -> torch.Tensor:
    shape = [DYNAMIC_DIM if d < 0 else d for d in spec["shape"]]
    dtype = dtypes.torch_dtype(spec["dtype"])
    if dtype == torch.int32:
        t = torch.randint(*INT_RANGE, shape, generator=gen, dtype=dtype)
    else:
        t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    return t.to(device)


def _poisoned(spec: dict, shape, device) -> torch.Tensor:
    return torch.full(shape, dtypes.poison(spec["dtype"]), dtype=dtypes.torch_dtype(spec["dtype"]),
                      device=device)


def region_probe(pipeline, seed: int = 0) -> dict:
    """Every slot of `pipeline` (runtime.pipeline.Pipeline) against its native region."""
    dev = pipeline.device
    gen = torch.Generator().manual_seed(seed)
    results = []
    for region in pipeline.regions.values():
        abi = region.abi
        inputs = [_random(spec, gen, dev) for spec in abi["inputs"]]
        expected = region.native(**dict(zip(region.input_names, inputs)))[region.output_name]
        out = _poisoned(abi["outputs"][0], expected.shape, dev)
        workspace = (torch.zeros(abi["workspace_bytes"], dtype=torch.uint8, device=dev)
                     if abi["workspace_bytes"] > 0 else None)
        region.kernel(*call_order(inputs, workspace, [out], abi["extra_args"]))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dtype = abi["outputs"][0]["dtype"]
        diff = (out.double() - expected.double()).abs()
        unwritten = int(torch.isnan(out).sum()) if out.is_floating_point() else 0
        max_diff = float("inf") if unwritten else float(diff.max()) if diff.numel() else 0.0
        tol = TOLERANCE[dtype] * max(1.0, float(expected.double().abs().max()))
        results.append({"binding_id": region.binding_id, "engine_role": region.engine_role,
                        "dtype": dtype, "shape": list(expected.shape), "max_abs_diff": max_diff,
                        "unwritten_elements": unwritten, "tolerance": tol,
                        "passed": bool(max_diff <= tol), "seed": seed})
    return {"passed": all(r["passed"] for r in results), "slots": results, "device": str(dev)}
