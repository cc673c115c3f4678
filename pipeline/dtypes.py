"""The one table of tensor dtypes: our names (snapshots, ABIs, exports) and what each library
calls them. Every mapping in the project reads this table; torch and numpy are imported only when
a column of theirs is asked for, so JSON-only commands stay light."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str                  # ours: "FP16"
    trt: str                   # TensorRT DataType member: "HALF"
    torch: str | None          # torch attribute: "float16"
    numpy: str | None          # numpy storage type of the raw bits (BF16 travels as uint16)
    safetensors: str | None    # safetensors header code: "F16"
    dlpack: tuple[int, int] | None  # (DLDataTypeCode, bits)
    floating: bool
    # what a gate allows a kernel per element, (atol, rtol): |got - expected| <= atol + rtol
    # |expected| (TOLERANCE below says why); None: must match exactly
    tolerance: tuple[float, float] | None = None
    # an output's poison before a gated call: a quiet NaN whose payload no arithmetic produces,
    # as the bits of a same-width integer (None: poison() gives the value)
    nan_payload: int | None = None
    # FlashInfer-Bench's name in a Definition (None: it has none); TensorRT's FP8 is E4M3, its FP4
    # E2M1
    flashinfer_bench: str | None = None


TABLE = (
    DType("FP32", "FLOAT", "float32", "float32", "F32", (2, 32), True, (1e-5, 1e-5), 0x7FC5A5A5,
          flashinfer_bench="float32"),
    DType("FP16", "HALF", "float16", "float16", "F16", (2, 16), True, (1e-3, 1e-3), 0x7E5A,
          flashinfer_bench="float16"),
    DType("BF16", "BF16", "bfloat16", "uint16", "BF16", (4, 16), True, (1e-2, 1.6e-2), 0x7FE5,
          flashinfer_bench="bfloat16"),
    DType("INT32", "INT32", "int32", "int32", "I32", (0, 32), False, flashinfer_bench="int32"),
    DType("INT64", "INT64", "int64", "int64", "I64", (0, 64), False, flashinfer_bench="int64"),
    DType("BOOL", "BOOL", "bool", "bool_", "BOOL", (6, 8), False, flashinfer_bench="bool"),
    DType("INT8", "INT8", "int8", "int8", "I8", (0, 8), False, flashinfer_bench="int8"),
    DType("UINT8", "UINT8", "uint8", "uint8", "U8", (1, 8), False),
    DType("FP8", "FP8", None, None, None, None, True, flashinfer_bench="float8_e4m3"),
    DType("INT4", "INT4", None, None, None, None, False),
    DType("FP4", "FP4", None, None, None, None, True, flashinfer_bench="float4_e2m1"),
    DType("E8M0", "E8M0", None, None, None, None, False),
)
BY_NAME = {d.name: d for d in TABLE}
BY_TRT = {d.trt: d for d in TABLE}
BY_SAFETENSORS = {d.safetensors: d for d in TABLE if d.safetensors}
BY_TORCH = {d.torch: d for d in TABLE if d.torch}


def _present(name: str, what: str, value):
    """A field of `name`'s row that this use needs, or ValueError where the dtype has none."""
    if value is None:
        raise ValueError(f"{name}: no {what}")
    return value


def torch_dtype(name: str):
    import torch
    return getattr(torch, _present(name, "torch dtype", BY_NAME[name].torch))


def name_of(torch_dtype) -> str:
    """torch.float16 -> "FP16"."""
    attr = str(torch_dtype).removeprefix("torch.")
    return next(d.name for d in TABLE if d.torch == attr)


def numpy_storage(name: str):
    import numpy as np
    return getattr(np, _present(name, "numpy storage type", BY_NAME[name].numpy))


# Every byte of a slot's workspace before a gated call: the workspace is scratch, undefined at each
# call (as TensorRT's plugin workspace is), so a kernel may rely neither on zeros nor on what it
# left there the call before.
WORKSPACE_POISON = 0xFF


# What a gate allows a kernel per element, (atol, rtol): |got - expected| <= atol + rtol |expected|,
# torch.testing's and FlashInfer-Bench's practice (KernelBench allows more). BF16's rtol admits two
# ulps: a BF16 output is itself rounded, so a kernel accumulating in another order is ~1 ulp off.
# Other dtypes must match exactly. The values are the table's `tolerance` column.
TOLERANCE = {d.name: d.tolerance for d in TABLE if d.tolerance is not None}


def tolerance(name: str) -> tuple[float, float]:
    """(atol, rtol) of `name`; (0, 0), exact, for a dtype without one."""
    return TOLERANCE.get(name, (0.0, 0.0))


def poison_bits(name: str):
    """(integer torch dtype of the same width, bits) of `name`'s NaN payload, or None when the
    dtype has none (integers: poison() is their lowest value)."""
    payload = BY_NAME[name].nan_payload if name in BY_NAME else None
    if payload is None:
        return None
    import torch
    bits = _present(name, "DLPack type", BY_NAME[name].dlpack)[1]
    return getattr(torch, f"int{bits}"), payload


def poison(name: str) -> float | int:
    """What an output is filled with before a kernel call: NaN, or the lowest integer, so a
    kernel that does not write it is caught."""
    if BY_NAME[name].floating:
        return float("nan")
    import torch
    return torch.iinfo(torch_dtype(name)).min
