"""Perf gate: native and external timed in one process, alternating, every trial kept.

Each trial times both sides back to back; the side that goes first alternates between trials so a
slow drift (thermal, other load) does not favour one of them. The ratio of a trial is
external throughput / native throughput (= native time / external time). The trials stop early
once the verdict is clear (stats.sequential_verdict); every trial's outputs of both sides must
agree (a fast kernel that computes nothing, in any trial, is no pass: one that counts its calls
cannot be wrong while timed and right by the last trial). Beside the end-to-end verdict, the
region alone is timed in situ (native region vs bound kernel) against the floor the copy roofline
(`roofline.measure_roofline`, measured once per process and device) sets for the bytes it must
move, every timed kernel call's output checked.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from pipeline import isolation, progress
from pipeline.gates import harness, stats
from pipeline.gates.report_types import (GateReport, NativeAlone, PerfSections,
                                         PerfSummary, RegionOutputs, RegionTiming, TestedKernel,
                                         TimedOutputs, TimingSettings, Trial)
from pipeline.gates.reports import roofline_share
from pipeline.gates.verdict import Verdict
from pipeline.gates.roofline import Roofline, measure_roofline
from pipeline.gates.settings import GateSettings, PerfSettings
from pipeline.graph.abi import call_order
from pipeline.runtime.remote import KernelsInHost
from pipeline.modes import Mode

REPEAT_ADVICE = ("repeat on an idle machine (nothing else running, fixed clocks) or with more "
                 "trials")
# CUDA, between region trials: this many bytes written, then as many others read, more than any
# L2. The read leaves the L2 holding clean lines, as a decode step's weight reads do; a write alone
# would leave an L2 of dirty lines for the timed call to write back.
FLUSH_BYTES = 256 << 20
# CUDA, after the flush: a GPU spin of SPIN_COVER times the timed arm's host enqueue, plus the
# slack, at most SPIN_MAX_S (an arm that waits on the GPU inside would otherwise spin for nothing)
SPIN_COVER, SPIN_SLACK_S, SPIN_MAX_S = 2.0, 20e-6, 0.02


# time_one(fn, sync) -> seconds of one call of fn (sync: waits for the device's queued work)
TimeOne = Callable[[Callable[[], object], Callable[[], object] | None], float]


def _timer(device) -> tuple[str, TimeOne]:
    """-> (name, time_one(fn, sync) -> seconds): CUDA events on a CUDA device, else perf_counter."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        def time_cuda(fn, sync):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return "cuda_events", time_cuda

    def time_cpu(fn, sync):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        return time.perf_counter() - t0
    return "perf_counter", time_cpu


def time_runs(run: Callable[[], object], runs: int, warmup: int,
              sync: Callable[[], object] | None = None) -> float:
    """Seconds for `runs` back-to-back calls after `warmup` untimed ones (wall clock, synced)."""
    for _ in range(warmup):
        run()
    if sync is not None:
        sync()
    start = time.perf_counter()
    for _ in range(runs):
        run()
    if sync is not None:
        sync()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Measurement:
    """What `measure_alternating` timed: every trial, the timer, the work units a call and the
    untimed warm-up runs, the verdict that ended the trials early (None: they ran to the cap),
    and every trial's outputs compared in one (None: not compared)."""
    timer: str
    items_per_call: int
    warmup: int
    trials: tuple[Trial, ...]
    stopped: Verdict | None = None
    outputs: TimedOutputs | None = None


def measure_alternating(run_native: Callable[[], object], run_external: Callable[[], object],
                        trials: int, warmup: int, sync: Callable[[], object] | None = None, *,
                        device=None, items: int = 1,
                        stop: Callable[[list[float]], Verdict | None] | None = None,
                        check: Callable[[object, object], TimedOutputs] | None = None,
                        label: str = "perf trials",
                        cpu: dict[str, Callable[[], float]] | None = None) -> Measurement:
    """Warm both up, then up to `trials` alternating timed pairs (each arm's wall time and this
    process's CPU time over it, every thread's); `stop(ratios)` returning a verdict ends them
    early. `items` = work units per call. `check(native result, external
    result)` compares each trial's results, untimed (`compare_outputs`); the outputs hold every
    trial's comparison in one (`trial_outputs`), None without `check`. `label`: the progress
    bar's; `cpu`: each arm's CPU clock (a kernel host's, read from outside), this process's by
    default."""
    if trials < 1 or warmup < 0 or items < 1:
        raise ValueError("trials >= 1, warmup >= 0 and items >= 1 are required")
    timer_name, time_one = _timer(device)
    for _ in range(warmup):
        run_native()
        run_external()
    if sync is not None:
        sync()
    arms = {"native": run_native, "external": run_external}
    records: list[Trial] = []
    checked: list[TimedOutputs] = []
    stopped = None
    with progress.bar(trials, label) as bar:
        for i in range(trials):
            trial, results = _trial(i, arms, time_one, sync, cpu or {}, items)
            records.append(trial)
            if check is not None:
                checked.append(check(results["native"], results["external"]))
            ratios = [t.ratio for t in records]
            stopped = stop(ratios) if stop is not None else None
            bar.update(1, note=f"median ratio {np.median(ratios):.4f}")
            isolation.beat(f"perf trial {i}")  # replayed graphs call no kernel from Python
            if stopped is not None:
                break
        bar.update(0, note=f"{len(records)} trials, median ratio {float(np.median(ratios)):.4f}"
                           + (f", stopped: {stopped}" if stopped else ""))
    return Measurement(timer_name, items, warmup, tuple(records), stopped,
                       trial_outputs(checked) if check is not None else None)


def _trial(i: int, arms: dict[str, Callable[[], object]], time_one: TimeOne,
           sync: Callable[[], object] | None, cpu: dict[str, Callable[[], float]],
           items: int) -> tuple[Trial, dict[str, object]]:
    """Trial `i`: both arms timed back to back, native first in even trials, each arm's CPU time
    over its run read from its clock in `cpu` (this process's, every thread, by default); and
    each arm's result."""
    seconds: dict[str, float] = {}
    cpu_s: dict[str, float] = {}
    results: dict[str, object] = {}
    order = ("native", "external") if i % 2 == 0 else ("external", "native")
    for side in order:
        clock = cpu.get(side, time.process_time)
        cpu_s[side] = clock()
        seconds[side] = time_one(lambda: results.__setitem__(side, arms[side]()), sync)
        cpu_s[side] = clock() - cpu_s[side]
    native, external = seconds["native"], seconds["external"]
    return Trial(i, order[0], native, external, items / native, items / external,
                 native / external, cpu_s["native"], cpu_s["external"]), results


def _timed_on(*pipelines) -> dict:
    """`measure_alternating`'s sync, device and CPU clocks for the arms' pipelines: for kernel
    hosts, this process's wall clock around each answer (the host synchronizes before it answers)
    and each host's CPU time read from outside; in this process, CUDA events and a synchronize on
    a GPU, perf_counter on a CPU."""
    import torch
    if all(isinstance(p, KernelsInHost) for p in pipelines):
        return {"sync": None, "device": None,
                "cpu": dict(zip(("native", "external"), (p.cpu_seconds for p in pipelines)))}
    device = pipelines[0].device
    cuda = device.type == "cuda"
    return {"sync": torch.cuda.synchronize if cuda else None, "device": device if cuda else None}


# native runs timed before the kernel's library is loaded (`native_alone`), at most this many
ALONE_TRIALS = 20


def native_alone(native, workload, perf: PerfSettings, twin=None) -> NativeAlone:
    """The native arm timed before the kernel's library is loaded anywhere: the trials'
    alternation (`measure_alternating`, min(ALONE_TRIALS, trials) pairs after the warm-up) with a
    native engine in both places, the native arm's side kept. `twin`: a second native engine in a
    process of its own, in the kernel's place, so the native arm shares the machine's caches with
    another process as it will in the trials (None: the native engine in both places). A library
    can start threads or processes when it loads or on its first call, or leave the caches cold
    after its calls, and so load the machine only while the native arm is timed: the native arm
    beside the kernel (the trials) slower than here is that, and the gate does not pass
    (`_report`)."""
    import torch
    other = native if twin is None else twin
    run_native, run_other = workload.timed(native, other)
    with torch.inference_mode():
        m = measure_alternating(run_native, run_other, min(ALONE_TRIALS, perf.trials), perf.warmup,
                                **_timed_on(native, other), items=workload.per_call,
                                label="native timed alone")
    seconds = tuple(t.native_s for t in m.trials)
    return NativeAlone(m.timer, seconds, workload.per_call / float(np.median(seconds)))


def compare_outputs(workload, native, external, reference) -> TimedOutputs:
    """One trial's results, as the workload compares them against its `reference`
    (families/workloads.py: an untimed run's accepted tokens for decoders, hidden states within
    the reference's max |diff| of native's and finite for encoders)."""
    return TimedOutputs.from_json(workload.timed_outputs(native, external, reference))


def trial_outputs(checked: list[TimedOutputs]) -> TimedOutputs:
    """Every trial's `compare_outputs` in one: passed when each trial passed, the worst max
    |diff| (None for tokens), and the first failing trial named."""
    failed = [i for i, c in enumerate(checked) if not c.passed]
    diffs = [c.max_abs_diff for c in checked if c.max_abs_diff is not None]
    if failed:
        detail = (f"trial {failed[0]}, the first of {len(failed)} of {len(checked)} trials whose "
                  f"outputs differ: {checked[failed[0]].detail}")
    else:
        detail = f"all {len(checked)} trials: {checked[-1].detail if checked else 'none run'}"
    return TimedOutputs(not failed, max(diffs) if diffs else None, detail, len(checked))


def measure_bandwidth(device) -> float:
    """Bytes/s of `device`'s copy roofline (`roofline.measure_roofline`: read + written, the
    best per-size median; measured once per process and device)."""
    return measure_roofline(device).bytes_per_s


def _region_arms(pipeline, region, static: list, ws, out) -> tuple[str, dict]:
    """(how the arms run, {arm: call}) over the `static` inputs: as the pipeline's engine runs
    them. Eager: the native region's lowered layers and one kernel call. The optimized mode on
    CUDA: the native region compiled whole (Inductor, with the lowering passes; a decode
    attention becomes the runtime's own kernels) and each arm replayed from its own CUDA graph,
    so neither pays launch overhead the engine would not."""
    arms = {"native": lambda: region.native.step(static),
            "kernel": lambda: region.kernel(*call_order(static, ws, [out], region.abi["extra_args"]))}
    if not pipeline.mode.graphed(pipeline.device):
        return Mode.EAGER.value, arms
    from pipeline.runtime.compiled import compile_step
    from pipeline.runtime.cudagraph import capture
    native = compile_step(region.native)
    arms["native"] = lambda: native(static)
    return "compiled + CUDA graph", {arm: capture(fn, pipeline.device)[0].replay
                                     for arm, fn in arms.items()}


def _l2_flush(device) -> Callable[[], object]:
    """A call that writes FLUSH_BYTES, then reads as many other bytes, leaving the L2 clean."""
    import torch
    written = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    read = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device=device)
    return lambda: (written.zero_(), read.sum())


def _spin_cycles_per_s() -> float:
    """torch.cuda._sleep's rate on the current device (cycles a second), timed once."""
    import torch
    cycles = 10_000_000
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def _host_enqueue_s(fn: Callable[[], object], device) -> float:
    """Seconds the host takes to launch `fn`'s work (its second call, past any lazy set-up)."""
    import torch
    fn()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize(device)
    return seconds


def _before_timed_calls(device, arms: dict) -> tuple[Callable[[str], object], dict]:
    """-> (before(side), each arm's host enqueue seconds). before: the L2 flush, then a GPU spin
    that outlasts the arm's launching (SPIN_COVER times it, plus SPIN_SLACK_S; SPIN_MAX_S at
    most), so the events time the GPU's work and not the gaps where it waits for the host's next
    launch: an eager region is a chain of launches, and a flush alone covered only part of them
    (the eager native attention timed 176, 464 and 264 us in three runs on one H200)."""
    import torch
    flush, rate = _l2_flush(device), _spin_cycles_per_s()  # the pipeline's device is current
    enqueue = {side: _host_enqueue_s(arm, device) for side, arm in arms.items()}
    cycles = {side: int(rate * min(SPIN_COVER * s + SPIN_SLACK_S, SPIN_MAX_S))
              for side, s in enqueue.items()}
    return lambda side: (flush(), torch.cuda._sleep(cycles[side])), enqueue


def time_region(pipeline, region, *, trials: int, warmup: int, seed: int, bandwidth: float,
                keep: dict | None = None) -> RegionTiming:
    """The region alone at its typical shapes, native region vs bound kernel, each run as the
    pipeline's engine runs it (`_region_arms`), alternating; fresh random inputs are copied into
    the arms' inputs (outside the timing) every trial, drawn on the device; on CUDA the L2 is
    flushed before each timed call and left clean (FLUSH_BYTES), and the call is queued behind a
    GPU spin, so its launching is not timed (`_before_timed_calls`); on a CPU the inputs are
    cache-hot, so the fraction may pass 1. The floor: `_bytes_moved` at `bandwidth`. Every
    call's output (poisoned before it) is compared with the native rule on its inputs, untimed,
    as the probe compares (`region_outputs`), so a kernel that skips work only when it is timed
    alone is caught, not reported as fast."""
    import torch

    from pipeline.gates.probe import compare, poison_
    if isinstance(pipeline, KernelsInHost):  # timed in the host, its last call judged here
        answer = pipeline.time_region(region.key, trials=trials, warmup=warmup, seed=seed,
                                      bandwidth=bandwidth)
        return judged_region(region, RegionTiming.from_json(answer["figures"]), answer["inputs"],
                             answer["out"])

    device, io = pipeline.device, pipeline.family.io
    cuda = device.type == "cuda"
    timer_name, time_one = _timer(device if cuda else None)
    space = harness.shape_space(pipeline, region)
    case = space.typical
    gen = torch.Generator(device).manual_seed(seed)  # on the device: no host draw between trials
    ws = harness.workspace(region, device)
    fresh = lambda: harness.random_inputs(region, io, case, gen, device)  # noqa: E731
    static = fresh()
    out = torch.empty_like(harness.expected_output(region, static))
    engine, arms = _region_arms(pipeline, region, static, ws, out)
    before, enqueue = _before_timed_calls(device, arms) if cuda else (None, None)
    dtype = region.abi["outputs"][0]["dtype"]
    times: dict[str, list[float]] = {"native": [], "kernel": []}
    checked = []
    for i in range(warmup + trials):
        for s, x in zip(static, fresh()):
            s.copy_(x)
        poison_(out, dtype)
        for side in (("native", "kernel") if i % 2 == 0 else ("kernel", "native")):
            if before is not None:
                before(side)
            t = time_one(arms[side], torch.cuda.synchronize if cuda else None)
            if i >= warmup:
                times[side].append(t)
        checked.append(compare(out, harness.expected_output(region, static), dtype))
    if keep is not None:  # the last call's, for a judge to compute again
        keep.update(inputs=[x.clone() for x in static], out=out.clone())
    native_s, kernel_s = (float(np.median(times[k])) for k in ("native", "kernel"))
    nbytes = _bytes_moved([*static, out], case, space.capacity)
    floor = nbytes / bandwidth
    return RegionTiming(
        binding_id=region.key, case=harness.case_label(case), timer=timer_name, engine=engine,
        trials=trials, l2_flush_bytes=FLUSH_BYTES if cuda else 0, host_enqueue_s=enqueue,
        bytes=nbytes, bandwidth_bytes_per_s=bandwidth, floor_s=floor, native_median_s=native_s,
        kernel_median_s=kernel_s, kernel_speedup=native_s / kernel_s,
        kernel_roofline_fraction=floor / kernel_s, native_roofline_fraction=floor / native_s,
        outputs=region_outputs(checked))


def _bytes_moved(tensors, case: dict, capacity: int | None) -> int:
    """The bytes a region must move: every boundary input and the output, read or written once;
    a KV cache input ([B, H, capacity, D]) counts only the case's active length, since keys past
    it need not be read."""
    def needed(x) -> int:
        whole = x.numel() * x.element_size()
        cache = capacity is not None and x.dim() == 4 and x.shape[2] == capacity
        return whole * case["kv_length"] // capacity if cache else whole
    return sum(needed(x) for x in tensors)


def judged_region(region, timing: RegionTiming, inputs: list, out) -> RegionTiming:
    """A kernel host's region timing with its last timed call computed again here: a wrong
    output there is the timing's first wrong call, whatever the host's figures say (they are
    the host's own; the verdict rests on the end-to-end trials timed here)."""
    from pipeline.gates.probe import compare, passes
    dtype = region.abi["outputs"][0]["dtype"]
    inputs = [x.to(region.native.device) for x in inputs]
    c = compare(out, harness.expected_output(region, inputs), dtype)
    if passes(c):
        return timing
    o, last = timing.outputs, timing.outputs.calls_checked - 1
    ratio = c["max_error_ratio"] if c["non_finite"] == 0 and c["unwritten"] == 0 else float("inf")
    return replace(timing, outputs=replace(
        o, first_wrong_call=last if o.first_wrong_call is None else min(o.first_wrong_call, last),
        max_error_ratio=max(o.max_error_ratio, ratio)))


def region_outputs(checked: list[dict]) -> RegionOutputs:
    """A region timing's calls (warm-up included), each as `probe.compare` saw it: how many, the
    worst error ratio (1 is the dtype's tolerance), and the first call that is not right
    (unwritten, non-finite or beyond the tolerance), None when every call is."""
    from pipeline.gates.probe import passes
    wrong = [i for i, c in enumerate(checked) if not passes(c)]
    return RegionOutputs(len(checked), max((c["max_error_ratio"] for c in checked), default=0.0),
                         wrong[0] if wrong else None)


def _verdict_message(median: float, lo: float, hi: float, threshold: float, confidence: float,
                     verdict: Verdict) -> str:
    change = f"the external engine is {abs(median - 1):.1%} {'faster' if median >= 1 else 'slower'}"
    return {Verdict.PASS: f"{change}: median external/native throughput {median:.3f}, "
                        f"{confidence:.0%} interval [{lo:.3f}, {hi:.3f}] >= {threshold}",
            Verdict.FAIL: f"{change}: median external/native throughput {median:.3f}, "
                        f"{confidence:.0%} interval [{lo:.3f}, {hi:.3f}] < {threshold}",
            Verdict.INCONCLUSIVE: f"the {confidence:.0%} interval straddles the threshold; "
                                f"{REPEAT_ADVICE} (median {median:.3f}, interval [{lo:.3f}, "
                                f"{hi:.3f}], threshold {threshold})"}[verdict]


def perf_report(name: str, measurement: Measurement, settings: PerfSettings = PerfSettings(), *,
                max_trials: int | None = None, unit: str = "items",
                regions: Sequence[RegionTiming] = (), kernels: Sequence[TestedKernel] = (),
                roofline: Roofline | None = None, alone: NativeAlone | None = None,
                cpu_threads: int | None = None) -> dict:
    """Median ratio, its seeded bootstrap interval and the verdict (`settings`: threshold,
    bootstrap, the early-stop rule), with every trial; a fail whatever the timing when the timed
    outputs disagree; inconclusive, unless a fail, when the native arm ran slower beside the
    kernel's library than `alone` (`native_alone`) by more than the threshold allows.
    `kernels`: what was timed (probe.tested_kernels); `roofline`: the copy roofline the regions
    were judged against; `cpu_threads`: on a CPU, the threads both arms
    are given (`gates.cpu_threads`): a kernel's arm that keeps more cores busy than
    CPU_CORES_SLACK times that is a fail. The report's fields (`GateReport.as_dict`)."""
    return _report(name, measurement, settings, max_trials, unit, regions, kernels, roofline,
                   alone, cpu_threads).as_dict()


def rederived(report: GateReport, settings: PerfSettings | None = None,
              cpu_threads: int | None = None) -> GateReport:
    """`report` computed again from its own trials, timed outputs, regions and native baseline,
    under `settings` (the spec's `gates.perf`; None: the report's own) and, for a report timed
    on a CPU, `cpu_threads` (the spec's `gates.cpu_threads`; None: the report's own): a report
    whose verdict or message differs from this one does not follow from what it says was
    measured."""
    perf = report.perf
    if perf is None:  # an aborted report: nothing was measured
        raise KeyError("settings")
    s = perf.settings
    if s.cpu_threads is None:
        cpu_threads = None  # timed on a GPU
    elif cpu_threads is None:
        cpu_threads = s.cpu_threads
    if settings is None:
        settings = PerfSettings(threshold=s.threshold, seed=s.seed, resamples=s.resamples,
                                confidence=s.confidence, min_trials=s.min_trials,
                                check_every=s.check_every)
    measurement = Measurement(s.timer, s.items_per_call, s.warmup, perf.trials,
                              perf.summary.interval_verdict if s.stopped_at else None,
                              perf.outputs)
    return _report(report.name, measurement, settings, s.max_trials, s.unit, perf.regions,
                   report.kernels, perf.roofline, perf.native_alone, cpu_threads)


def _regions_message(regions: Sequence[RegionTiming]) -> str:
    """The regions in one line: one region by name; many as the range of the kernel's speedup
    and the slowest region by name (the report's table lists every one)."""
    if not regions:
        return ""
    if len(regions) == 1:
        (r,) = regions
        return (f"; region {r.binding_id}: kernel {r.kernel_speedup:.2f}x native, "
                f"{roofline_share(r)}")
    slowest = min(regions, key=lambda r: r.kernel_speedup)
    fastest = max(r.kernel_speedup for r in regions)
    return (f"; {len(regions)} regions: kernel {slowest.kernel_speedup:.2f}x to {fastest:.2f}x "
            f"native, the slowest {slowest.binding_id} ({roofline_share(slowest)})")


# on a CPU, a kernel's arm may keep at most this many times `gates.cpu_threads` cores busy (CPU
# time over wall time, the median trial): the native arm runs on that many threads
CPU_CORES_SLACK = 1.5


def _cores(trials: Sequence[Trial]) -> tuple[float | None, float | None]:
    """The median trial's cores kept busy (`Trial.cores`), native and external; None for trials
    without CPU seconds."""
    cores = [t.cores for t in trials]
    if not cores or any(c is None for c in cores):
        return None, None
    native, external = zip(*(c for c in cores if c is not None))
    return float(np.median(native)), float(np.median(external))


def _summary(m: Measurement, settings: PerfSettings, regions: Sequence[RegionTiming],
             alone: NativeAlone | None) -> PerfSummary:
    """The trials' figures: the median ratio and its bootstrap interval, each arm's median
    throughput, the ratio the regions predict, both arms against the native engine alone, and
    the cores each kept busy."""
    ratios = [t.ratio for t in m.trials]
    lo, hi = stats.bootstrap_median_ci(ratios, **settings.bootstrap)
    native = float(np.median([t.native_throughput for t in m.trials]))
    external = float(np.median([t.external_throughput for t in m.trials]))
    base = None if alone is None else alone.median_throughput
    native_cores, external_cores = _cores(m.trials)
    return PerfSummary(median_ratio=float(np.median(ratios)), ci_low=lo, ci_high=hi,
                       interval_verdict=stats.verdict((lo, hi), settings.threshold),
                       native_median_throughput=native, external_median_throughput=external,
                       predicted_ratio=predicted_ratio(native, regions),
                       native_alone_median_throughput=base,
                       native_beside_over_alone=None if base is None else native / base,
                       external_over_alone=None if base is None else external / base,
                       native_cpu_cores=native_cores, external_cpu_cores=external_cores)


def _verdict(s: PerfSummary, outputs: TimedOutputs | None, regions: Sequence[RegionTiming],
             settings: PerfSettings, unit: str, cpu_threads: int | None) -> tuple[Verdict, str]:
    """The verdict and its message: the interval's; a fail when the timed outputs or a region's
    timed calls are wrong; inconclusive, unless a fail, when the native engine timed alone shows
    the trials held back; a fail when the kernel's arm kept more cores busy than it was given."""
    threshold = settings.threshold
    verdict = s.interval_verdict
    message = _verdict_message(s.median_ratio, s.ci_low, s.ci_high, threshold,
                               settings.confidence, verdict)
    if outputs is not None and not outputs.passed:
        verdict, message = Verdict.FAIL, f"timed outputs differ from native ({outputs.detail}); {message}"
    wrong = [r for r in regions if r.wrong]
    if wrong:
        r = wrong[0]
        verdict, message = Verdict.FAIL, (
            f"{r.binding_id} timed alone: the kernel's output differs from the native rule from "
            f"call {r.outputs.first_wrong_call} (worst error ratio "
            f"{r.outputs.max_error_ratio:.3g}, {len(wrong)} of {len(regions)} regions); "
            f"{message}")
    base, beside, over_alone = (s.native_alone_median_throughput, s.native_beside_over_alone,
                                s.external_over_alone)
    if base is not None and beside is not None and over_alone is not None:
        against = f"against {base:.4g} {unit}/s"
        if beside < threshold and verdict != Verdict.FAIL:
            verdict, message = Verdict.INCONCLUSIVE, (
                f"the native engine ran {1 - beside:.1%} slower beside the kernel's library than "
                f"before it was loaded (median throughput {s.native_median_throughput:.4g} "
                f"{against}): something it started loads the machine while the native engine is "
                f"timed, or the machine changed; {REPEAT_ADVICE}; {message}")
        elif over_alone < threshold and verdict == Verdict.PASS:
            # a slowdown of the native arm under the beside/alone threshold would otherwise add
            # to the kernel's own slack under the ratio's
            verdict, message = Verdict.INCONCLUSIVE, (
                f"the kernel's arm ran {1 - over_alone:.1%} slower than the native engine before "
                f"the kernel's library was loaded (median throughput "
                f"{s.external_median_throughput:.4g} {against}), more than the threshold allows; "
                f"{REPEAT_ADVICE}; {message}")
    cores = s.external_cpu_cores
    if cpu_threads is not None and cores is not None and cores > CPU_CORES_SLACK * cpu_threads \
            and verdict != Verdict.FAIL:
        verdict, message = Verdict.FAIL, (
            f"the kernel's arm kept {cores:.2f} cores busy (CPU time over wall time, median "
            f"trial), more than {CPU_CORES_SLACK} x gates.cpu_threads = {cpu_threads} allows: on "
            f"a CPU both arms are timed on that many threads (the native arm kept "
            f"{s.native_cpu_cores:.2f} busy); {message}")
    message += _regions_message(regions)
    if s.predicted_ratio is not None and len(regions) > 1:
        message += f"; the {len(regions)} regions' timings predict {s.predicted_ratio:.3f} end to end"
    return verdict, message


def _timing_settings(m: Measurement, settings: PerfSettings, max_trials: int | None, unit: str,
                     cpu_threads: int | None) -> TimingSettings:
    """The settings section: how the trials were timed and judged, and how they ended."""
    n, stopped = len(m.trials), m.stopped
    return TimingSettings(
        threshold=settings.threshold, seed=settings.seed, resamples=settings.resamples,
        confidence=settings.confidence, timer=m.timer, warmup=m.warmup, trials=n,
        max_trials=max_trials or n, min_trials=settings.min_trials,
        check_every=settings.check_every, stopped_at=n if stopped else None,
        stop_reason=(f"interval {'>=' if stopped == Verdict.PASS else '<'} threshold at trial {n}"
                     if stopped else "trials cap reached"),
        items_per_call=m.items_per_call, unit=unit, cpu_threads=cpu_threads)


def _report(name: str, m: Measurement, settings: PerfSettings, max_trials: int | None,
            unit: str, regions: Sequence[RegionTiming], kernels: Sequence[TestedKernel],
            roofline: Roofline | None = None, alone: NativeAlone | None = None,
            cpu_threads: int | None = None) -> GateReport:
    summary = _summary(m, settings, regions, alone)
    verdict, message = _verdict(summary, m.outputs, regions, settings, unit, cpu_threads)
    return GateReport("perf", name, verdict, message, tuple(kernels), PerfSections(
        _timing_settings(m, settings, max_trials, unit, cpu_threads), summary, m.outputs,
        tuple(regions), m.trials, alone, roofline))


def predicted_ratio(native_throughput: float, regions: Sequence[RegionTiming]) -> float | None:
    """The end-to-end ratio the in-situ region timings predict (Amdahl), each slot called once
    per unit of throughput (a decode step, an encoded text): a native step of 1/throughput
    seconds saves each region's native minus kernel time. None without regions, or when the
    regions alone would take longer than the whole step (timings that do not add up)."""
    if not regions or native_throughput <= 0:
        return None
    step = 1.0 / native_throughput
    saved = sum(r.native_median_s - r.kernel_median_s for r in regions)
    return step / (step - saved) if step - saved > 0 else None


def run_perf_gate(name: str, native, external, workload,
                  settings: GateSettings = GateSettings(),
                  alone: NativeAlone | None = None) -> GateReport:
    """The whole gate on two open pipelines: the trials time `workload`'s runs
    (families/workloads.py: an encoder's networks on texts tokenized once, since tokenizing is
    not the kernel's cost; a decoder's generation) as `settings.perf` says, every trial's outputs
    compared untimed against the workload's reference (hidden states within
    `settings.correctness.max_abs_diff`; a decoder's tokens from one untimed run that the
    correctness rule accepts); then every
    region is timed alone against the device's copy roofline (measured once per process).
    `alone`: the native arm timed before the kernel's library was loaded (`native_alone`)."""
    import torch

    from pipeline.gates.probe import tested_kernels
    perf = settings.perf
    run_native, run_external = workload.timed(native, external)
    with torch.inference_mode():
        reference = workload.reference(native, external, settings.correctness)
        m = measure_alternating(run_native, run_external, perf.trials, perf.warmup,
                                **_timed_on(native, external), items=workload.per_call,
                                stop=lambda r: stats.sequential_verdict(
                                    r, threshold=perf.threshold,
                                    min_trials=min(perf.min_trials, perf.trials),
                                    check_every=perf.check_every, **perf.bootstrap),
                                check=lambda n, e: compare_outputs(workload, n, e, reference))
        roofline = measure_roofline(external.device)
        regions = [time_region(external, r, trials=len(m.trials), warmup=perf.warmup,
                               seed=perf.seed, bandwidth=roofline.bytes_per_s)
                   for r in external.regions.values()]
    host = {"confinement": external.confinement} if isinstance(external, KernelsInHost) else None
    report = _report(name, m, perf, perf.trials, workload.unit, regions,
                     tested_kernels(external), roofline, alone,
                     settings.cpu_threads if native.device.type == "cpu" else None)
    if host is not None:
        report = report.with_sections(host=host)
    report.to_json()  # checked against the schema
    return report
