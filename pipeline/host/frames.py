"""The kernel host's channel: length-prefixed frames of JSON with raw tensors behind it.

A frame is a 24-byte head (magic, JSON length, tensor bytes), the JSON body, then every tensor's
bytes in order. A tensor in a body is `{"tensor": i}`; the body's `tensors` list gives each one's
dtype and shape, and their sizes must add up to the head's count. Everything is bounded before it
is read (`Bounds`), and the side that judges reads with a deadline (`read_frame`): a short,
oversized, late or malformed frame is a `FrameError` naming what was wrong, never a hang or a
traceback. Nothing in a frame is ever unpickled or executed.
"""
from __future__ import annotations

import math
import os
import select
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    import torch

MAGIC = b"TRTH"
HEAD = struct.Struct("<4sQQ")  # magic, JSON bytes, tensor bytes
# dtypes a frame may carry, by name: what slot arguments, hidden states, logits and token ids are
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
          "uint8", "bool")
MAX_TENSORS = 1 << 16
CHUNK = 1 << 22
# A GPU tensor of this many bytes crosses through page-locked memory (a probe call's caches are
# 64 MiB at Qwen3-8B's 16,384 keys, 160 MiB at 40,960); the allocator keeps each block it hands
# out, so the window leaves small tensors and whole-answer batches in ordinary memory.
PINNED = (1 << 20, 256 << 20)


class FrameError(Exception):
    """A frame that is not one the other side sends: what was wrong, in one line."""


@dataclass(frozen=True)
class Bounds:
    """The most a frame may hold, and how long its bytes may take once the first has come."""
    json_bytes: int = 64 << 20
    tensor_bytes: int = 8 << 30
    seconds: float = 120.0


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    import torch
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"tensor": len(tensors) - 1}
    if isinstance(value, dict):
        return {k: _encode(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v, tensors) for v in value]
    return value


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory, contiguous; a GPU tensor through page-locked memory where
    `_pinned_empty` gives some."""
    t = t.detach()
    staged = _pinned_empty(t.shape, t.dtype) if t.is_cuda else None
    return t.contiguous().cpu() if staged is None else staged.copy_(t)


def _pinned_empty(shape: Any, dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised page-locked tensor when its size is within `PINNED`, which the caching
    host allocator hands out again for a later frame of the same size (no fresh pages to fault
    in, and the copy to or from the GPU runs at the bus's speed); None outside the window or
    where CUDA cannot give one (a sticky error of an earlier call): the caller takes ordinary
    memory."""
    import torch
    if not PINNED[0] <= math.prod(shape) * dtype.itemsize <= PINNED[1]:
        return None
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError:
        return None


def _parts(body: dict[str, Any]) -> tuple[bytes, list[memoryview]]:
    """A frame of `body` as its head and JSON, then a view of each tensor's bytes (its tensors,
    anywhere in it, copied to host memory, contiguous, and not copied again)."""
    import torch
    tensors: list[torch.Tensor] = []
    doc = _encode(body, tensors)
    cpu = [_host_copy(t) for t in tensors]
    doc["tensors"] = [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                      for t in cpu]
    raw = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    views = [t.view(-1).view(torch.uint8).numpy().data for t in cpu if t.numel()]
    return HEAD.pack(MAGIC, len(raw), sum(v.nbytes for v in views)) + raw, views


def pack(body: dict[str, Any]) -> bytes:
    """One frame of `body`, whole."""
    head, views = _parts(body)
    return head + b"".join(views)


def write_frame(fd: int, body: dict[str, Any]) -> None:
    head, views = _parts(body)
    for part in (memoryview(head), *views):
        while part:
            n = os.write(fd, part[:CHUNK])
            part = part[n:]


def _read_into(fd: int, into: memoryview, deadline: float | None, what: str) -> None:
    """Fill `into` from `fd`, each read straight into its place."""
    n, got = len(into), 0
    while got < n:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise FrameError(f"{what}: {got} of {n} bytes came before the deadline")
        k = os.readv(fd, [into[got:got + CHUNK]])
        if not k:
            raise FrameError(f"{what}: the channel closed after {got} of {n} bytes")
        got += k


def _read_exactly(fd: int, n: int, deadline: float | None, what: str) -> bytearray:
    data = bytearray(n)
    _read_into(fd, memoryview(data), deadline, what)
    return data


def read_frame(fd: int, bounds: Bounds = Bounds(), timed: bool = True,
               pinned: bool = False) -> dict[str, Any]:
    """The next frame's body with its tensors in place. `timed`: the whole frame must come within
    `bounds.seconds` of this call (the judge's side; the host waits for its requests). `pinned`:
    its tensors of a size `PINNED` spans land in page-locked memory (a host on a GPU, which
    copies each request's tensors there; never the judge, where a head's claim must cost nothing
    until its bytes come)."""
    deadline = time.monotonic() + bounds.seconds if timed else None
    magic, n_json, n_tensor = HEAD.unpack(_read_exactly(fd, HEAD.size, deadline, "frame head"))
    if magic != MAGIC:
        raise FrameError(f"frame head: magic {magic!r}, expected {MAGIC!r}")
    if n_json > bounds.json_bytes or n_tensor > bounds.tensor_bytes:
        raise FrameError(f"frame head: {n_json} JSON and {n_tensor} tensor bytes, more than the "
                         f"{bounds.json_bytes} and {bounds.tensor_bytes} allowed")
    try:
        doc = orjson.loads(_read_exactly(fd, n_json, deadline, "frame body"))
    except orjson.JSONDecodeError as e:
        raise FrameError(f"frame body: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise FrameError("frame body: not a JSON object")
    tensors = _tensors(doc.pop("tensors", []), n_tensor, fd, deadline, pinned)
    body: dict[str, Any] = _decode(doc, tensors)
    return body


def _tensors(specs: Any, total: int, fd: int, deadline: float | None,
             pinned: bool) -> list[torch.Tensor]:
    import torch
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise FrameError(f"frame body: 'tensors' is not a list of at most {MAX_TENSORS}")
    sizes = []
    for i, s in enumerate(specs):
        shape = s.get("shape") if isinstance(s, dict) else None
        dtype = s.get("dtype") if isinstance(s, dict) else None
        if dtype not in DTYPES or not isinstance(shape, list) or len(shape) > 8 or \
                not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape):
            raise FrameError(f"frame body: tensors[{i}] is not a dtype of {DTYPES} and a shape")
        count = 1
        for d in shape:
            count *= d
        sizes.append((getattr(torch, dtype), shape, count * getattr(torch, dtype).itemsize))
    if sum(n for _, _, n in sizes) != total:
        raise FrameError(f"frame: its tensors take {sum(n for _, _, n in sizes)} bytes, the head "
                         f"says {total}")
    out = []
    for dtype, shape, n in sizes:
        # uninitialised memory, so a head's claim costs nothing before its bytes come
        staged = _pinned_empty((max(n, 1),), torch.uint8) if pinned else None
        raw = torch.empty(max(n, 1), dtype=torch.uint8) if staged is None else staged
        _read_into(fd, raw.numpy().data[:n], deadline, "frame tensors")
        out.append(raw[:n].view(dtype).reshape(shape))
    return out


def _decode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if value.keys() == {"tensor"}:
            i = value["tensor"]
            if not isinstance(i, int) or not 0 <= i < len(tensors):
                raise FrameError(f"frame body: tensor reference {i!r} names no tensor")
            return tensors[i]
        return {k: _decode(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    return value
