"""Region probe: the native region and the bound kernel of an open pipeline, call by call, on fresh
seeded random inputs across the shape space (gates/harness.py: every length class of each dynamic
dim and of a KV length, plus the dims met in situ), with named anti-cheat checks.

Nothing a kernel can count or recognise: the seed is drawn per run unless given (and recorded),
the number of calls and their order are drawn from it, and each call's output is filled before
the call with one of random finite values, the previous call's output, or a NaN carrying a payload
(the lowest integer for integer outputs), which tells an element never written from a NaN the
kernel wrote. Every case gets at least one NaN-filled call. A slot's workspace gets the call's fill
too (`_workspace`): random bytes, what the kernel left there the call before, or every byte
dtypes.WORKSPACE_POISON; so no constant pattern marks a probe's call.

Tolerance per element: |got - expected| <= atol + rtol * |expected| (dtypes.TOLERANCE).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Collection, Mapping

import torch

from pipeline import dtypes, isolation, progress
from pipeline.errors import UserError
from pipeline.families.workloads import run_replay
from pipeline.gates.drawn import draw_seed
from pipeline.gates.harness import (INT_RANGE, allow_calls, case_label, expected_output,
                                    in_situ_case, native_seconds, random_inputs, shape_cases,
                                    shape_space, space_coverage, workspace)
from pipeline.gates.report_types import ProbeCheck, ProbeReport, SlotProbe, TestedKernel
from pipeline.graph.abi import call_order
from pipeline.runtime.remote import KernelInHost, KernelsInHost
from pipeline.modes import Mode

FILLS = ("nan", "random", "previous")  # what an output holds before a probe call
REPEATS = 8           # at least this many calls repeat a case (a kernel right only at first)
CUDA_CHECKS = ("ordered_on_stream", "graph_capturable")  # what _cuda_checks names
SLEEP_CYCLES = 50_000_000  # ~25 ms of GPU spin queued ahead of the call on our stream


def require_shadow(pipeline) -> None:
    """A correctness gate's external pipeline checks every slot call (open_pipeline's shadow)."""
    if pipeline.regions and pipeline.shadow is None:
        raise UserError(f"{pipeline.bundle.path}: the correctness gate needs the external pipeline "
                        f"opened with open_pipeline(..., shadow=True)")


def tested_kernels(pipeline) -> list[TestedKernel]:
    """What a gate ran: each bound kernel's library and function, with the digest of the bytes
    loaded. Promotion pins a DSO only when every gate report names its digest."""
    return [TestedKernel(k.binding_id, str(k.library), k.function, k.library_sha256, k.abi_sha256)
            for _, k in sorted(pipeline.kernels.items())]


def poison_(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """Fill `t` with the poison of `dtype` (dtypes.poison_bits), in place."""
    bits = dtypes.poison_bits(dtype)
    if bits is not None:
        t.view(bits[0]).fill_(bits[1])
        return t
    return t.fill_(dtypes.poison(dtype))


def _unwritten(t: torch.Tensor, dtype: str) -> torch.Tensor:
    bits = dtypes.poison_bits(dtype)
    if bits is not None:
        return t.view(bits[0]) == bits[1]
    return t == dtypes.poison(dtype)


# -- one comparison ---------------------------------------------------------------------------
def compare(got: torch.Tensor, expected: torch.Tensor, dtype: str) -> dict:
    """Element-wise figures of one call: unwritten, non-finite where native is finite, and the
    worst |diff| / (atol + rtol |expected|) over the elements both sides have finite."""
    atol, rtol = dtypes.tolerance(dtype)
    unwritten = _unwritten(got, dtype).cpu()
    g, e = got.detach().double().cpu(), expected.detach().double().cpu()
    bad = ~unwritten & ~torch.isfinite(g) & torch.isfinite(e)
    both = ~unwritten & torch.isfinite(g) & torch.isfinite(e)
    diff = torch.where(both, (g - e).abs(), 0.0)
    allowed = atol + rtol * e.abs()
    ratio = torch.where(diff > 0, diff / allowed, 0.0)
    worst = int(ratio.flatten().argmax()) if ratio.numel() else 0
    at = lambda t: float(t.flatten()[worst]) if t.numel() else 0.0  # noqa: E731
    nonfinite_at = bad.flatten().nonzero()
    return {"unwritten": int(unwritten.sum()), "non_finite": int(bad.sum()),
            "first_non_finite": _index(int(nonfinite_at[0]), got.shape) if len(nonfinite_at) else None,
            "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
            "max_error_ratio": at(ratio), "max_expected": float(e.abs().max()) if e.numel() else 0.0,
            "worst": {"index": _index(worst, got.shape), "expected": at(e), "got": at(g),
                      "abs_diff": at(diff), "allowed": at(allowed)}}


def _index(flat: int, shape) -> list[int]:
    """The multi-index of flat position `flat` in a row-major `shape` (torch.unravel_index does
    the same, after importing sympy on first use: a third of a second)."""
    index = []
    for size in reversed(tuple(shape)):
        flat, i = divmod(flat, int(size))
        index.append(i)
    return index[::-1]


def passes(c: dict) -> bool:
    """A `compare` result within tolerance: every element written, finite where native is, and
    each within the dtype's tolerance."""
    return c["unwritten"] == 0 and c["non_finite"] == 0 and c["max_error_ratio"] <= 1.0


# -- the probe ----------------------------------------------------------------------------------
def _fill(out: torch.Tensor, dtype: str, fill: str, previous: torch.Tensor | None,
          gen: torch.Generator) -> None:
    """What the output holds before a call (FILLS); "previous" without a previous output of this
    shape is "random"."""
    if fill == "nan":
        poison_(out, dtype)
    elif fill == "previous" and previous is not None and previous.shape == out.shape:
        out.copy_(previous)
    elif out.is_floating_point():
        out.copy_(torch.randn(out.shape, generator=gen, dtype=torch.float32, device=gen.device))
    else:
        out.copy_(torch.randint(*INT_RANGE, out.shape, generator=gen, dtype=out.dtype,
                                device=gen.device))


def _workspace(region, device, fill: str, previous: torch.Tensor | None,
               gen: torch.Generator) -> torch.Tensor | None:
    """The slot's workspace for a call with `fill` (FILLS): every byte WORKSPACE_POISON ("nan"),
    the previous call's workspace as the kernel left it ("previous", when there is one), or
    random bytes; None when the ABI has none."""
    ws = workspace(region, device)
    if ws is None or fill == "nan":
        return ws
    if fill == "previous" and previous is not None:
        return previous
    return ws.copy_(torch.randint(0, 256, ws.shape, generator=gen, dtype=torch.uint8,
                                  device=gen.device))


def _call(region, io, case, seed, device, fill: str, previous,
          previous_ws) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    dtype = region.abi["outputs"][0]["dtype"]
    gen = torch.Generator(device).manual_seed(seed)  # drawn where they are used: a cache at
    inputs = random_inputs(region, io, case, gen, device)  # capacity is ~10^8 normals a call
    clones = [x.clone() for x in inputs]
    expected = expected_output(region, inputs)
    out = torch.empty_like(expected)
    _fill(out, dtype, fill, previous, gen)
    ws = _workspace(region, device, fill, previous_ws, gen)
    t0 = time.perf_counter()
    with isolation.calling(f"'{region.key}' in the probe ({case_label(case)})"):
        region.kernel(*call_order(inputs, ws, [out], region.abi["extra_args"]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    changed = [(i, int((x != c).sum())) for i, (x, c) in enumerate(zip(inputs, clones))]
    c = compare(out, expected, dtype)
    c["inputs_written"] = [{"input": i, "elements": n} for i, n in changed if n]
    c["passed"] = passes(c) and not c["inputs_written"]
    return {"case": case_label(case), "seed": seed, "fill": fill,
            "output_shape": list(expected.shape), "seconds": seconds, **c}, out, ws


def _plan(cases: list[dict], rng: random.Random) -> list[tuple[dict, str]]:
    """(case, fill) per call: every case once with a NaN fill, then a drawn number of repeats
    with drawn fills, all in a drawn order."""
    calls = [(c, "nan") for c in cases]
    repeats = rng.randint(REPEATS + len(cases) // 2, 2 * REPEATS + len(cases))
    calls += [(rng.choice(cases), rng.choice(FILLS)) for _ in range(repeats)]
    rng.shuffle(calls)
    return calls


def _where(call: dict) -> str:
    return (f"call {call['call']} ({call['case']}, seed {call['seed']}, output "
            f"{call['output_shape']}, filled with {call['fill']})")


def _host_checks(calls: list[dict], atol: float, rtol: float) -> list[ProbeCheck]:
    worst = max(calls, key=lambda c: c["max_error_ratio"])
    w = worst["worst"]
    tol = (f"{_where(worst)} index {w['index']}: expected {w['expected']:.6g}, got {w['got']:.6g}, "
           f"|diff| {w['abs_diff']:.3g} vs allowed {w['allowed']:.3g} (atol {atol:g} + rtol {rtol:g}"
           f" * |expected|)")
    wrote = next((c for c in calls if c["inputs_written"]), None)
    partial = max(calls, key=lambda c: c["unwritten"])
    nonfinite = next((c for c in calls if c["non_finite"]), None)
    flip = _flip(calls)
    return [
        ProbeCheck("within_tolerance", worst["max_error_ratio"] <= 1.0,
                   (("worst: " if worst["max_error_ratio"] <= 1.0 else "") + tol)
                   if worst["max_error_ratio"] > 0 else "every compared element equals native's "
                   "(elements unwritten or non-finite are other checks')"),
        ProbeCheck("inputs_unchanged", wrote is None,
                   "no call changed an input" if wrote is None else
                   f"{_where(wrote)} wrote its inputs: " + ", ".join(
                       f"input[{w['input']}] {w['elements']} elements" for w in wrote["inputs_written"])),
        ProbeCheck("output_fully_written", partial["unwritten"] == 0,
                   "every output element written in every call" if not partial["unwritten"] else
                   f"{_where(partial)} left {partial['unwritten']} output elements unwritten (still "
                   f"poison)"),
        ProbeCheck("finite_where_native_is", nonfinite is None,
                   "no NaN/Inf where native is finite" if nonfinite is None else
                   f"{_where(nonfinite)}: {nonfinite['non_finite']} NaN/Inf where native is finite "
                   f"(first at index {nonfinite['first_non_finite']})"),
        ProbeCheck("stable_across_calls", flip is None,
                   f"{len(calls)} calls, fresh inputs and a drawn output fill each: every case "
                   f"gave the same verdict each time" if flip is None else flip),
    ]


def _flip(calls: list[dict]) -> str | None:
    """A call whose verdict differs from an earlier call of the same case (a kernel right only for
    its first N calls, or keeping state between calls), described; None when there is none."""
    first: dict[str, dict] = {}
    for c in calls:
        f = first.setdefault(c["case"], c)
        if c["passed"] != f["passed"]:
            right, wrong = (f, c) if f["passed"] else (c, f)
            n = next(i for i, x in enumerate(calls) if not x["passed"])
            lead = f"right for its first {n} calls only: " if f["passed"] and n else ""
            return f"{lead}{_where(right)} right, {_where(wrong)} wrong (same case, fresh inputs)"
    return None


def cuda_outputs(region, inputs: list[torch.Tensor], device) -> dict:
    """The kernel's output on `inputs` three ways, where the kernel runs: fully synchronized
    (`reference`); on a side stream behind a queued GPU spin, read after syncing an event on that
    stream only (`side`: a kernel launching elsewhere, or returning before its work is ordered on
    ours, leaves poison or races); captured in a CUDA graph and replayed once (`graph`, or
    `capture_error`). Each output was poisoned before its call."""
    from pipeline.runtime.cudagraph import capture
    dtype = region.abi["outputs"][0]["dtype"]
    out = torch.empty_like(expected_output(region, inputs))
    ws = workspace(region, device)
    run = lambda xs: region.kernel(*call_order(xs, ws, [out], region.abi["extra_args"]))  # noqa: E731
    poison_(out, dtype)
    run([x.clone() for x in inputs])
    torch.cuda.synchronize(device)
    got: dict[str, Any] = {"reference": out.clone(), "capture_error": None, "graph": None}
    clones = [x.clone() for x in inputs]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        poison_(out, dtype)
        run(clones)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    got["side"] = out.clone()
    static = [x.clone() for x in inputs]
    try:
        graph, _ = capture(lambda: run(static), device, warmup=1)
    except Exception as e:  # noqa: BLE001 - any capture failure is the finding
        got["capture_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        return got
    for s, x in zip(static, inputs):  # the warm-up and capture calls may have run for real
        s.copy_(x)
    poison_(out, dtype)
    graph.replay()
    torch.cuda.current_stream(device).synchronize()
    got["graph"] = out.clone()
    return got


def _cuda_checks(region, io, case, seed, device) -> list[ProbeCheck]:
    """Two properties of the kernel itself (`cuda_outputs`, run where the kernel runs), each
    judged here against the same call fully synchronized on the same inputs, so a kernel wrong in
    another way is left to the other checks."""
    dtype = region.abi["outputs"][0]["dtype"]
    inputs = random_inputs(region, io, case, torch.Generator(device).manual_seed(seed), device)
    got = region.kernel.cuda_outputs(inputs) if isinstance(region.kernel, KernelInHost) \
        else cuda_outputs(region, inputs, device)
    reference = got["reference"]

    def same(out, what: str) -> tuple[bool, str]:
        c = compare(out, reference, dtype)
        extra = int((_unwritten(out, dtype) & ~_unwritten(reference, dtype)).sum())
        ok = extra == 0 and c["non_finite"] == 0 and c["max_error_ratio"] <= 1.0
        return ok, (f"{what}: vs the same call fully synchronized, {extra} elements left "
                    f"unwritten, max |diff|/allowed {c['max_error_ratio']:.3g} (seed {seed})")
    ordered = ProbeCheck("ordered_on_stream",
                         *same(got["side"], "after syncing an event on the caller's stream only"))
    if got["capture_error"] is not None:
        return [ordered, ProbeCheck("graph_capturable", False,
                                    f"torch.cuda.graph capture failed: {got['capture_error']}")]
    return [ordered, ProbeCheck("graph_capturable", *same(got["graph"], "captured, one replay"))]


def _slot_cases(pipeline, region, space, rng: random.Random, seen: tuple[int, ...],
                in_situ: list | None,
                swept_on: str | None) -> tuple[list[dict], list[str], dict | None]:
    """(cases, notes, coverage) a slot's probe calls: the shape space's cases (`shape_cases`) and
    their coverage, or only the typical case where `swept_on` names the slot that swept it
    (coverage None); then the in-situ inputs, as they were and perturbed afresh."""
    if swept_on is None:
        cases, notes = shape_cases(pipeline, region, rng, seen, space)
        covered = space_coverage(space, cases)
    else:
        cases, covered = [space.typical], None
        notes = [f"shape space and CUDA checks on {swept_on} (the same function and ABI): here "
                 f"the typical case and the in-situ inputs"]
    if in_situ is not None:
        situ = in_situ_case(region, pipeline.family.io, in_situ)
        cases += [situ, {**situ, "perturbed": True}]
        notes.append(f"{case_label(situ)}: the inputs of this slot's last call in a native run "
                     f"of the first item, as they were and perturbed afresh at each call")
    return cases, notes, covered


def probe_region(pipeline, region, seed: int, seen: tuple[int, ...] = (),
                 in_situ: list | None = None, swept_on: str | None = None) -> SlotProbe:
    """One slot: the cases' calls in a drawn plan (`_plan`), then the checks. `seen`: dims the
    region met in situ; `in_situ`: the inputs of one of its calls in a native run, a case too;
    `swept_on`: the slot of the same binding whose probe swept the shape space and ran the CUDA
    checks (the same function and ABI on fresh buffers), so this one probes only the typical case
    and its in-situ inputs, each called repeatedly with drawn fills."""
    device, io = pipeline.device, pipeline.family.io
    dtype = region.abi["outputs"][0]["dtype"]
    atol, rtol = dtypes.tolerance(dtype)
    rng = random.Random(seed)
    space = shape_space(pipeline, region)
    cases, notes, covered = _slot_cases(pipeline, region, space, rng, seen, in_situ, swept_on)
    allow_calls(pipeline, native_seconds(region, space.typical, io, device))
    plan = _plan(cases, rng)
    t0 = time.perf_counter()
    records, previous, previous_ws = [], None, None
    with progress.bar(len(plan), f"probe {region.key}") as bar:
        for i, (case, fill) in enumerate(plan):
            record, previous, previous_ws = _call(region, io, case, rng.getrandbits(31), device,
                                                  fill, previous, previous_ws)
            records.append({"call": i, **record})
            bar.update(1, note=case_label(case))
    checks = _host_checks(records, atol, rtol)
    typical = case_label(space.typical)
    shown = next(r for r in records if r["case"] == typical)
    if swept_on is None and device.type == "cuda":
        checks += _cuda_checks(region, io, space.typical, rng.getrandbits(31), device)
    else:
        evidence = f"checked on {swept_on}" if swept_on else f"CUDA only: not run on {device}"
        checks += [ProbeCheck(n, None, evidence) for n in CUDA_CHECKS]
    clean = all(r["unwritten"] == 0 and r["non_finite"] == 0 for r in records)
    worst = max(records, key=lambda r: r["max_error_ratio"])
    return SlotProbe(
        binding_id=region.key, engine_role=region.engine_role, dtype=dtype,
        shape=tuple(shown["output_shape"]), seed=seed,
        passed=all(c.passed is not False for c in checks),
        max_abs_diff=max(r["max_abs_diff"] for r in records) if clean else float("inf"),
        tolerance=atol + rtol * max(r["max_expected"] for r in records),
        atol=atol, rtol=rtol, unwritten_elements=max(r["unwritten"] for r in records),
        failed_checks=tuple(c.name for c in checks if c.passed is False), checks=tuple(checks),
        notes=tuple(notes), seconds=time.perf_counter() - t0, coverage=covered,
        worst={k: worst[k] for k in ("call", "case", "seed", "output_shape", "worst")},
        calls=tuple({k: v for k, v in r.items()
                     if k not in ("worst", "max_expected", "first_non_finite")}
                    for r in records))


DRIFT_BYTES = 1 << 30  # native slot outputs kept for the drift comparison, at most


@dataclass(frozen=True)
class InSitu:
    """What the eager runs of `run_in_situ` met: per slot key, the inputs of its last native call
    (the probe's in-situ case), and the drift section of the correctness report."""
    inputs: dict[str, list[torch.Tensor]]
    drift: dict


class _Drift:
    """Per slot, each external call's output against the same call's output in the native run."""

    def __init__(self):
        self.native: dict[str, list[torch.Tensor]] = {}
        self.kept, self.dropped = 0, 0
        self.rows: dict[str, dict] = {}

    @staticmethod
    def _row(key: str) -> dict:
        return {"slot": key, "calls": 0, "max_abs_diff": 0.0, "relative": 0.0, "worst_call": 0,
                "non_finite_calls": 0}

    def keep(self, key: str, output: torch.Tensor) -> None:
        nbytes = output.numel() * output.element_size()
        if self.kept + nbytes > DRIFT_BYTES:
            self.dropped += 1
            return
        self.native.setdefault(key, []).append(output.detach().clone())
        self.kept += nbytes

    def compare(self, key: str, output: torch.Tensor) -> None:
        row = self.rows.setdefault(key, self._row(key))
        i, native = row["calls"], self.native.get(key, [])
        if i >= len(native):
            return
        row["calls"] += 1
        a = native[i].float()
        b = output.detach().to(a.device).float()  # a kernel host's outputs come as host copies
        if a.shape != b.shape or not bool(torch.isfinite(b).all()):
            row["non_finite_calls"] += 1
            return
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        relative = diff / max(float(a.abs().max()) if a.numel() else 0.0, 1e-30)
        row["max_abs_diff"] = max(row["max_abs_diff"], diff)
        if relative > row["relative"]:
            row["relative"], row["worst_call"] = relative, i

    def section(self, keys) -> dict:
        notes = [f"native outputs past {DRIFT_BYTES} bytes were not kept: {self.dropped} calls "
                 f"not compared"] if self.dropped else []
        slots = []
        for key in keys:
            row = self.rows.get(key) or self._row(key)
            if row["calls"] != len(self.native.get(key, [])):
                notes.append(f"{key}: {len(self.native.get(key, []))} native calls, "
                             f"{row['calls']} compared")
            if row["non_finite_calls"]:
                row = {**row, "max_abs_diff": None, "relative": None}
            slots.append(row)
        return {"item": 0, "mode": Mode.EAGER.value, "slots": slots, "notes": notes}


def run_in_situ(pipeline, workload) -> InSitu:
    """The workload's first item, teacher-forced (`workload.replay`), run in the eager mode twice:
    every slot on its native region, then every slot on its kernel. Each slot's inputs as the
    native run meets them (a decoder: its longest KV length) become the probe's in-situ case, and
    each slot's drift (max |Δ| of its outputs, and that over max |native|) shows where along the
    instances an error starts and how it compounds: both runs see the same sequence. For a
    pipeline whose kernels run in a kernel host, the native run is made here
    (`HostedPipeline.local`) and the kernels' run there, on the same sequence."""
    from pipeline.runtime.pipeline import reopen
    here = pipeline.local if isinstance(pipeline, KernelsInHost) else pipeline
    taken: dict[str, list[torch.Tensor]] = {}
    drift, phase = _Drift(), [""]  # the run the tap sees: native, then kernel

    def tap(key: str, inputs, output) -> None:
        if phase[0] == "native":
            taken[key] = [x.detach().clone() for x in inputs]
            drift.keep(key, output)
        elif phase[0] == "kernel":
            drift.compare(key, output)
    opened = reopen(here, (), mode=Mode.EAGER, tap=tap)  # one pipeline, switched between runs
    replayed = workload.replay(opened, workload.items[0])
    phase[0] = "native"
    run_replay(opened, replayed)
    if here is pipeline:
        opened.use_kernels(pipeline.regions)
        phase[0] = "kernel"
        run_replay(opened, replayed)
    else:
        for key, outputs in pipeline.tapped(replayed)["outputs"].items():
            for output in outputs:
                drift.compare(key, output)
    return InSitu(taken, drift.section(pipeline.regions))


def region_probe(pipeline, seed: int | None = None,
                 seen: Mapping[str, Collection[int]] | None = None,
                 in_situ: dict[str, list] | None = None) -> ProbeReport:
    """Every slot of `pipeline` (runtime.pipeline.Pipeline) against its native region: the first
    slot of each binding id over the whole shape space, every slot at its in-situ inputs. `seed`:
    None draws one (recorded in the report); `seen`: per slot key, dims met in situ; `in_situ`:
    per slot key, the inputs of a call in a native run (run_in_situ)."""
    seed = draw_seed() if seed is None else seed  # the calls' number and order differ per run
    swept: dict[str, str] = {}  # binding id -> the slot whose probe swept its shape space
    slots = []
    for key, region in pipeline.regions.items():
        slots.append(probe_region(pipeline, region, seed, tuple(sorted((seen or {}).get(key, ()))),
                                  (in_situ or {}).get(key), swept.get(region.binding_id)))
        swept.setdefault(region.binding_id, key)
    return ProbeReport(str(pipeline.device), seed, tuple(slots))
