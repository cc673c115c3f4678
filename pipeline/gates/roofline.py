"""The copy roofline: the memory bandwidth a memory-bound kernel is judged against, measured once
per process per device by `measure_roofline`, which the perf gate, `trtmc bench` and the GPU
scripts of benchmarks/ share.

On CUDA: device-to-device copies (`torch.Tensor.copy_`) of CUDA_SIZES (1, 2 and 4 GiB), each
timed with CUDA events, REPEATS times after WARMUP untimed copies; a copy moves twice its buffer
(read once, written once); the figure is the best of the per-size medians. A size whose two
buffers and HEADROOM_BYTES do not fit in the device's free memory is skipped, and the method says
so; when none fits, the largest copy that does is measured instead, and the method says that too
(a copy under 1 GiB reads below the sustained bandwidth: it is no roofline to judge by).

On a CPU: a host copy of CPU_SIZES, the same way with perf_counter. That figure is no GPU
roofline, and its method says so; the reports print no roofline share for a CPU region.
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

MIB, GIB = 1 << 20, 1 << 30
CUDA_SIZES = (1 * GIB, 2 * GIB, 4 * GIB)
CPU_SIZES = (64 * MIB,)   # past a CPU's last-level cache; the figure is informative only
REPEATS = {"cuda": 20, "cpu": 3}
WARMUP = 2
HEADROOM_BYTES = 256 * MIB  # left free beside the two buffers of a copy
SUSTAINED_MIN_BYTES = GIB   # a smaller copy reads below the sustained bandwidth

_CACHE: dict[tuple, "Roofline"] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Roofline:
    """A measured copy roofline. `sizes`: the buffer bytes measured (a copy moves twice that);
    `median_s`: each size's median copy time; `bytes_per_s`: the best of the sizes' read +
    written bytes / median; `skipped`: requested sizes that did not fit; `method`: all of it in
    words."""
    bytes_per_s: float
    method: str
    sizes: tuple[int, ...]
    median_s: tuple[float, ...]
    repeats: int
    timer: str
    skipped: tuple[int, ...] = ()

    @property
    def size_bytes_per_s(self) -> tuple[float, ...]:
        """Each size's read + written bytes / its median time."""
        return tuple(2 * n / t for n, t in zip(self.sizes, self.median_s))

    @property
    def gpu(self) -> bool:
        return self.timer == "cuda_events"

    def to_json(self) -> dict[str, Any]:
        """The perf report's `roofline` object (schemas/gate_report.schema.json)."""
        return {"bytes_per_s": self.bytes_per_s, "method": self.method, "sizes": list(self.sizes),
                "median_s": list(self.median_s), "repeats": self.repeats, "timer": self.timer,
                "skipped": list(self.skipped)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Roofline:
        """A roofline as a report holds it (`to_json`)."""
        return cls(doc["bytes_per_s"], doc["method"], tuple(doc["sizes"]), tuple(doc["median_s"]),
                   doc["repeats"], doc["timer"], tuple(doc["skipped"]))


def _device(device):
    """`device` as a torch.device; a CUDA device with its index (the current one when none)."""
    import torch
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def size_text(nbytes: int) -> str:
    """1 GiB, 1.50 GiB, 384 MiB, 4096 B."""
    for unit, name in ((GIB, "GiB"), (MIB, "MiB")):
        if nbytes >= unit:
            return f"{nbytes // unit} {name}" if nbytes % unit == 0 else f"{nbytes / unit:.2f} {name}"
    return f"{nbytes} B"


def _available_bytes(device) -> int | None:
    """Bytes a copy's buffers may take: on CUDA the device's free memory plus what torch's
    allocator holds unused; on a CPU /proc/meminfo's MemAvailable; None when unknown."""
    import torch
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def plan_sizes(sizes: Sequence[int], available: int | None,
               headroom: int = HEADROOM_BYTES) -> tuple[list[int], list[int]]:
    """(sizes to measure, sizes skipped): a size fits when its two buffers and `headroom` do
    (`available` None: every size is tried). When none fits, the largest copy that does (whole
    MiB, at least one) is measured instead."""
    if available is None:
        return list(sizes), []
    fit = [n for n in sizes if 2 * n + headroom <= available]
    skipped = [n for n in sizes if n not in fit]
    if not fit:
        fit = [max(MIB, (available - headroom) // 2 // MIB * MIB)]
    return fit, skipped


def _copy_seconds(device, nbytes: int, repeats: int) -> list[float] | None:
    """Seconds of each of `repeats` copies of an `nbytes` buffer on `device` after WARMUP
    untimed ones (CUDA events on CUDA, perf_counter on a CPU); None when the buffers cannot be
    allocated."""
    import torch
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
    except RuntimeError:  # torch.OutOfMemoryError is one
        return None
    src.fill_(0x5A)
    for _ in range(WARMUP):
        dst.copy_(src)
    seconds = []
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)
            for _ in range(repeats):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                end.record()
                end.synchronize()
                seconds.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - t0)
    return seconds


def _release(device) -> None:
    """Hand a CUDA copy's freed buffers back to the device (torch's allocator would keep them)."""
    if device.type == "cuda":
        import torch
        torch.cuda.empty_cache()


def _measure(device, sizes: tuple[int, ...], repeats: int) -> Roofline:
    cuda = device.type == "cuda"
    available = _available_bytes(device)
    planned, skipped = plan_sizes(sizes, available)
    measured, medians, failed = [], [], []
    for n in planned:
        seconds = _copy_seconds(device, n, repeats)
        _release(device)
        if seconds is None:
            failed.append(n)
            continue
        measured.append(n)
        medians.append(statistics.median(seconds))
    if not measured:
        raise RuntimeError(f"no copy roofline on {device}: buffers of "
                           f"{', '.join(map(size_text, planned))} could not be allocated")
    rates = [2 * n / t for n, t in zip(measured, medians)]
    best = max(range(len(rates)), key=rates.__getitem__)
    kind = "device-to-device" if cuda else "host memory"
    timer = "cuda_events" if cuda else "perf_counter"
    parts = [f"{kind} copies (torch copy_) of {', '.join(map(size_text, measured))}, each timed "
             f"with {'CUDA events' if cuda else 'perf_counter'}, median of {repeats} after "
             f"{WARMUP} warm-up copies; bytes = read + written (twice the buffer); the best "
             f"median across sizes ({size_text(measured[best])})"]
    if skipped:
        free = "unknown" if available is None else size_text(available)
        parts.append(f"skipped, not fitting in the {free} free with {size_text(HEADROOM_BYTES)} "
                     f"of headroom: {', '.join(map(size_text, skipped))}")
    if failed:
        parts.append(f"skipped, allocation failed: {', '.join(map(size_text, failed))}")
    if not set(measured) & set(sizes):
        parts.append("no requested size fit, so the largest copy that fits was measured")
    if cuda and max(measured) < SUSTAINED_MIN_BYTES:
        parts.append(f"a copy under {size_text(SUSTAINED_MIN_BYTES)} reads below the sustained "
                     f"bandwidth, so this roofline reads low")
    if not cuda:
        parts.append("a CPU copy figure, not a GPU roofline")
    return Roofline(bytes_per_s=rates[best], method="; ".join(parts), sizes=tuple(measured),
                    median_s=tuple(medians), repeats=repeats, timer=timer, skipped=tuple(
                        skipped + failed))


def measure_roofline(device, *, sizes: Sequence[int] | None = None,
                     repeats: int | None = None) -> Roofline:
    """The copy roofline of `device` (module docstring), measured once per process for a device,
    sizes and repeats (CUDA_SIZES or CPU_SIZES, REPEATS by default): later calls return the same
    Roofline."""
    device = _device(device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    sizes = tuple(int(n) for n in (sizes or (CUDA_SIZES if kind == "cuda" else CPU_SIZES)))
    repeats = int(repeats or REPEATS[kind])
    if not sizes or min(sizes) < 1 or repeats < 1:
        raise ValueError("sizes must be positive byte counts and repeats >= 1")
    key = (str(device), sizes, repeats)
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _measure(device, sizes, repeats)
        return _CACHE[key]
