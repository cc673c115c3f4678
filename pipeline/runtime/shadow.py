"""Shadow execution: every slot call of a pipeline also computed by the native region it replaced,
on a copy of the same inputs taken before the call, and compared there and then.

The kernel gets exactly what an ungated run gives it (the model's own buffers, nothing poisoned),
so nothing in its arguments marks a gate, and no call goes unchecked: not the first N, not the
shapes a probe happened to draw. (The native region and the comparisons run between two calls,
so the calls' timing differs from a run's: docs/pipeline.md, "What the gates cannot see".) Each
call leaves one row in a ledger on the pipeline's device, written
with tensor operations only (no host synchronisation), so a step compiled and replayed as a CUDA
graph is checked on every replay just as an eager step is. `collect()` reads the rows after each
end-to-end item and starts a new ledger. Outside a graph capture each call is synchronised inside
its time limit (pipeline/isolation.py), so a GPU kernel that never finishes is that call's
timeout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import os

import torch

from pipeline.dtypes import TOLERANCE
from pipeline.isolation import calling

# one row per call: what `_row` computes, in this order
FIELDS = ("site", "max_error_ratio", "max_abs_diff", "non_finite", "inputs_changed")
CAPACITY = 1 << 16  # rows per item; later calls share the last row (their worst figures kept)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t`, so a NaN rewritten as another NaN counts as a change."""
    return t if t.dtype == torch.bool else t.view(_BITS[t.element_size()])


@dataclass
class Shadow:
    """The ledger of one pipeline: a device tensor of rows, a device call counter, and the host's
    table of call sites (binding id and shapes), which a row names by index."""
    device: torch.device
    rows: torch.Tensor = field(init=False)
    count: torch.Tensor = field(init=False)
    # (binding id, input shapes) -> the index a row names it by
    sites: dict[tuple[str, tuple], int] = field(default_factory=dict)

    def __post_init__(self):
        self.rows = torch.zeros(CAPACITY, len(FIELDS), dtype=torch.float32, device=self.device)
        self.count = torch.zeros((), dtype=torch.int64, device=self.device)

    def check(self, region, inputs, before, out) -> torch.Tensor:
        """The native region on `before` (the inputs as they were), compared with the kernel's
        `out` and recorded as one row; the row, as a device tensor."""
        atol, rtol = TOLERANCE.get(region.abi["outputs"][0]["dtype"], (0.0, 0.0))
        (expected,) = region.native.step([x.clone() for x in before])
        site = self._site(region.key, [x.shape for x in inputs])
        row = _row(site, out, expected, inputs, before, atol, rtol)
        self._record(row)
        return row

    def _site(self, slot: str, shapes) -> int:
        key = (slot, tuple(tuple(s) for s in shapes))
        return self.sites.setdefault(key, len(self.sites))

    def _record(self, row: torch.Tensor) -> None:
        at = self.count.clamp(max=CAPACITY - 1).view(1)
        self.rows.index_copy_(0, at, torch.maximum(self.rows.index_select(0, at), row.view(1, -1)))
        self.count.add_(1)

    def collect(self) -> list[dict]:
        """The calls since the last collect, one dict each, and a fresh ledger (same memory, as
        a captured graph writes to it)."""
        return calls_of(*self.take())

    def take(self) -> tuple[torch.Tensor, list, int]:
        """(the rows since the last take, as float64 on the host; the call sites in index order;
        how many calls were made), and a fresh ledger: what `calls_of` reads, here or in a
        process that never ran the kernel."""
        n = int(self.count)
        rows = self.rows[:min(n, CAPACITY)].double().cpu()
        self.rows.zero_()
        self.count.zero_()
        return rows, [[slot, [list(s) for s in shapes]] for slot, shapes in self.sites], n


def calls_of(rows: torch.Tensor, sites: list, n: int) -> list[dict]:
    """One dict per ledger row (`Shadow.take`), the site named by its binding id and shapes."""
    calls = []
    for i, row in enumerate(rows.tolist()):
        r = dict(zip(FIELDS, row))
        binding_id, shapes = sites[int(r["site"])]
        calls.append({"call": i, "binding_id": binding_id,
                      "input_shapes": [list(s) for s in shapes],
                      "max_error_ratio": r["max_error_ratio"],
                      "max_abs_diff": r["max_abs_diff"],
                      "non_finite": int(r["non_finite"]),
                      "inputs_changed": int(r["inputs_changed"]),
                      "passed": r["max_error_ratio"] <= 1.0 and not r["non_finite"]
                      and not r["inputs_changed"]})
    if n > CAPACITY:  # the last row holds the worst of the calls past the capacity
        calls[-1]["calls_folded"] = n - CAPACITY + 1
    return calls


def _row(site: int, got: torch.Tensor, expected: torch.Tensor, inputs, before, atol: float,
         rtol: float) -> torch.Tensor:
    """(site, max |diff| / (atol + rtol |expected|), max |diff|, NaN/Inf where native is finite,
    input elements changed) as one FP32 device tensor. A shape or dtype mismatch, which a kernel
    writing in place cannot cause, counts every element as wrong."""
    dev = got.device
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    changed = zero.clone()
    for x, b in zip(inputs, before):
        changed = changed + (_bits(x) != _bits(b)).sum()
    if got.shape != expected.shape or got.numel() == 0:
        wrong = float(max(got.numel(), expected.numel()) if got.shape != expected.shape else 0)
        return torch.stack([zero + site, zero + (float("inf") if wrong else 0.0), zero + wrong,
                            zero + wrong, changed]).float()
    g, e = got.double(), expected.double()
    both = torch.isfinite(g) & torch.isfinite(e)
    bad = (~torch.isfinite(g) & torch.isfinite(e)).sum()
    diff = torch.where(both, (g - e).abs(), zero)
    ratio = torch.where(diff > 0, diff / (atol + rtol * e.abs()), zero)
    return torch.stack([zero + site, ratio.max(), diff.max(), bad.double(), changed]).float()


def summary(items: list[list[dict]]) -> dict:
    """The report's figures over every item's calls: how many were checked, how many failed, the
    slots those were in, the first failing call (item, call, binding id, shapes, figures) and the
    worst error ratio."""
    flat = [{"item": i, **c} for i, calls in enumerate(items) for c in calls]
    failed = [c for c in flat if not c["passed"]]
    worst = max(flat, key=lambda c: c["max_error_ratio"], default=None)
    checked = sum(c.get("calls_folded", 1) for c in flat)
    return {"calls_checked": checked, "calls_failed": len(failed),
            "slots_failed": list(dict.fromkeys(c["binding_id"] for c in failed)),
            "first_failure": failed[0] if failed else None,
            "worst": worst, "per_item": [len(calls) for calls in items],
            "passed": not failed and checked > 0}


AUDIT_BYTES = 1 << 30  # the most bytes of drawn calls kept between two `Audit.take`s
# a gate's audit: every slot call of its end-to-end runs drawn, where AUDIT_BYTES allows
GATE_AUDIT_RATE = 1.0


class Audit:
    """Slot calls drawn after they return, each with probability `rate` from the operating
    system's random source (nothing in the process predicts a draw), kept whole (the inputs as
    the kernel got them, its output, and the shadow's row when there is one) for a process that
    never loaded the kernel to compute again. Calls inside a CUDA graph capture are counted, never
    drawn (a capture records work, it runs none). Once the drawn calls fill AUDIT_BYTES, the kept
    ones are a reservoir: each later draw replaces a kept call chosen at random with the chance
    that keeps every drawn call equally likely to be judged, so the calls a judge computes again
    are not the first ones of a request, which a kernel could count to."""

    def __init__(self, rate: float, budget: int = AUDIT_BYTES):
        self.threshold = round(min(max(rate, 0.0), 1.0) * 2 ** 32)
        self.kept: list = []
        self.budget, self.bytes = budget, 0
        self.calls = self.drawn = 0

    def after(self, key: str, inputs, out: torch.Tensor, row: torch.Tensor | None) -> None:
        self.calls += 1
        if int.from_bytes(os.urandom(4), "little") >= self.threshold:
            return
        if out.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        self.drawn += 1
        nbytes = sum(x.numel() * x.element_size() for x in (*inputs, out))
        replaced = None
        if self.bytes + nbytes > self.budget:
            at = int.from_bytes(os.urandom(8), "little") % self.drawn
            if at >= len(self.kept) or self.bytes - self.kept[at]["bytes"] + nbytes > self.budget:
                return
            replaced = at
        call = {"key": key, "call": self.calls - 1, "bytes": nbytes,
                "inputs": [x.detach().clone() for x in inputs],
                "output": out.detach().clone(),
                "row": None if row is None else row.detach().clone()}
        if replaced is None:
            self.kept.append(call)
        else:
            self.bytes -= self.kept[replaced]["bytes"]
            self.kept[replaced] = call
        self.bytes += nbytes

    def take(self) -> dict:
        """The calls kept since the last take, in the order they were made, with the counts, and
        a fresh start."""
        kept = sorted(self.kept, key=lambda c: c["call"])
        taken = {"calls": self.calls, "drawn": self.drawn,
                 "over_budget": self.drawn - len(kept),
                 "kept": [{k: v for k, v in c.items() if k != "bytes"} for c in kept]}
        self.kept, self.bytes = [], 0
        self.calls = self.drawn = 0
        return taken


def checked(kernel, region, shadow: Shadow | None, audit: Audit | None):
    """The one callable a slot calls its kernel through, with or without checks, so the kernel
    meets the same caller in a gate and in a run: the kernel on the model's own buffers; with a
    `shadow`, the native region on a copy of the inputs taken before the call, compared and
    recorded; with an `audit`, the call drawn or not once it has returned."""
    layout = region.layout
    label = f"'{region.key}'"

    def slot(*args):
        inputs, out = layout.inputs(args), layout.output(args)
        before = [x.clone() for x in inputs] if shadow is not None else None
        with calling(label):
            kernel(*args)
            if shadow is not None and out.is_cuda and not torch.cuda.is_current_stream_capturing():
                torch.cuda.current_stream(out.device).synchronize()  # a GPU hang is this call's
        row = None if shadow is None else shadow.check(region, inputs, before, out)
        if audit is not None:
            audit.after(region.key, inputs if before is None else before, out, row)
    return slot
