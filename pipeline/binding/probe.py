"""Region probe: run the native region and the bound kernel on the same fresh random inputs.

Outputs are poisoned first (NaN, or -1 for integers), so a kernel that writes nothing or computes
another function is caught before any end-to-end gate. Tolerances follow common kernel gating
practice (KernelBench/tritonbench): 1e-4 for FP32, 1e-2 for FP16, 2e-2 for BF16, exact for INT32.
"""
from __future__ import annotations

import torch

from pipeline.bundle.reader import Bundle
from pipeline.graph.patch import slots_of
from pipeline.runtime.session import bind_kernels, resolve_device

TORCH_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16,
                "INT32": torch.int32}
TOLERANCE = {"FP32": 1e-4, "FP16": 1e-2, "BF16": 2e-2, "INT32": 0.0}
DYNAMIC_DIM = 7      # size given to -1 dims of probe inputs
INT_RANGE = (1, 16)  # integer inputs are lengths/indices in practice: keep them small and positive


def _random(spec: dict, gen: torch.Generator, device) -> torch.Tensor:
    shape = [DYNAMIC_DIM if d < 0 else d for d in spec["shape"]]
    dtype = TORCH_DTYPES[spec["dtype"]]
    if dtype == torch.int32:
        t = torch.randint(*INT_RANGE, shape, generator=gen, dtype=dtype)
    else:
        t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    return t.to(device)


def _poisoned(spec: dict, shape, device) -> torch.Tensor:
    dtype = TORCH_DTYPES[spec["dtype"]]
    return torch.full(shape, -1 if dtype == torch.int32 else float("nan"), dtype=dtype, device=device)


def _region_program(export: dict, slot: dict, weights, device):
    from pipeline.runtime.program import Program
    sub = {**export, "layers": slot["attrs"]["native_layers"]}
    return Program.lower(sub, weights, device=device, inputs=slot["inputs"], outputs=slot["outputs"])


def region_probe(bundle, kernel_bindings, device: str | None = "cpu", seed: int = 0,
                 checkpoint=None) -> dict:
    b = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle)
    dev = resolve_device(device)
    kernels = bind_kernels(b, kernel_bindings)
    weights = b.weights(checkpoint)
    gen = torch.Generator().manual_seed(seed)
    results = []
    for slot_entry in b.slots:
        export = b.network(slot_entry["engine_role"])
        slot = next(s for s in slots_of(export) if s["attrs"]["binding_id"] == slot_entry["binding_id"])
        abi = slot_entry["abi"]
        tensors = {t["id"]: t for t in export["tensors"]}
        inputs = [_random(spec, gen, dev) for spec in abi["inputs"]]
        names = [tensors[t]["name"] for t in slot["inputs"]]
        native = _region_program(export, slot, weights, dev)(**dict(zip(names, inputs)))
        expected = native[tensors[slot["outputs"][0]]["name"]]
        out = _poisoned(abi["outputs"][0], expected.shape, dev)
        workspace = ([torch.zeros(abi["workspace_bytes"], dtype=torch.uint8, device=dev)]
                     if abi["workspace_bytes"] > 0 else [])
        extras = [a.get("value") for a in abi["extra_args"]]
        kernels[slot_entry["binding_id"]](*inputs, *workspace, out, *extras)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dtype = abi["outputs"][0]["dtype"]
        diff = (out.double() - expected.double()).abs()
        unwritten = int(torch.isnan(out).sum()) if out.is_floating_point() else 0
        max_diff = float("inf") if unwritten else float(diff.max()) if diff.numel() else 0.0
        tol = TOLERANCE[dtype] * max(1.0, float(expected.double().abs().max()))
        results.append({"binding_id": slot_entry["binding_id"], "engine_role": slot_entry["engine_role"],
                        "dtype": dtype, "shape": list(expected.shape), "max_abs_diff": max_diff,
                        "unwritten_elements": unwritten, "tolerance": tol,
                        "passed": bool(max_diff <= tol), "seed": seed})
    return {"passed": all(r["passed"] for r in results), "slots": results, "device": str(dev)}
