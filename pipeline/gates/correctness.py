"""Correctness gate: native vs external end to end with every slot call shadowed, then the
region probe.

What the end-to-end runs are and how the two arms compare is the model's workload
(families/workloads.py). Encoders: max |diff| and cosine of each text's hidden state, over the
full [S, H] tensor and over its real (unpadded) tokens only, since padding rows can hide a wrong
kernel in a full-tensor cosine; both must pass. Decoders: the greedy tokens must be identical;
beside them a teacher-forced run feeds both arms native's tokens and compares every step (max
|Δlogit|, KL(native||external), top-1 agreement), and where the greedy tokens diverge native's
top-2 logit margin there tells a near tie from a wrong kernel. The comparisons are pure functions
over tensors and token lists, so they test without models.
"""
from __future__ import annotations

import time
from typing import Sequence

from pipeline import isolation, progress
from pipeline.families import workloads
from pipeline.families.cases import Comparison
from pipeline.families.workloads import teacher_forced  # noqa: F401
from pipeline.gates.report_types import CorrectnessSections, GateReport, Shadow, TestedKernel
from pipeline.gates.reports import describe
from pipeline.gates.verdict import Verdict
from pipeline.gates.settings import CorrectnessSettings, GateSettings
from pipeline.runtime.remote import KernelsInHost


def compare_encoder(native: list, external: list, texts: list[str], masks: list | None = None,
                    seconds: list[float] | None = None, *,
                    max_abs_diff: float = CorrectnessSettings.max_abs_diff,
                    min_cosine: float = CorrectnessSettings.min_cosine) -> Comparison:
    """One case per text: max |native - external| and cosine of the hidden states, over all rows
    and over the rows `masks` marks as real tokens (families/workloads.py: compare_encoder), at
    the gate's default thresholds unless given."""
    return workloads.compare_encoder(native, external, texts, masks, seconds,
                                     max_abs_diff=max_abs_diff, min_cosine=min_cosine)


def compare_decoder(native: list, external: list, prompts: list[str], forced: list | None = None,
                    seconds: list[float] | None = None, *,
                    tie_steps: int = CorrectnessSettings.tie_steps) -> Comparison:
    """One case per prompt: identical greedy tokens, or tokens that part at a near tie the
    teacher-forced logits (`forced`) accept (families/workloads.py: compare_decoder), at the
    gate's default tolerance unless given."""
    return workloads.compare_decoder(native, external, prompts, forced, seconds, tie_steps=tie_steps)


def correctness_report(name: str, comparison: Comparison, probe,
                       kernels: Sequence[TestedKernel] = (), shadow: dict | None = None,
                       drift: dict | None = None) -> dict:
    """The gate report (`GateReport.as_dict`): passes only when every shadowed slot call, the
    region probe and every case pass. `probe`: a probe.ProbeReport or None; `kernels`: what was
    tested (probe.tested_kernels); `shadow`: shadow.summary; `drift`: probe.run_in_situ's drift
    section."""
    return _report(name, comparison, probe, kernels, shadow, drift=drift).as_dict()


def bisect_instances(external, one, workload, settings: GateSettings) -> dict:
    """When the gate fails with many slots: `locate`'s answer over the slots in graph order (no
    slot when the cases break with every slot native too). A subset breaks when a shadowed call
    of its kernels differs from the native region or an end-to-end case fails; the calls come
    first, since tokens alone can break at a near tie that another slot's rounding flips.
    `external` itself is switched between subsets (and back to every slot), so a run compiles
    nothing; `one` (the gate's `end_to_end`) keeps native's side from the gate's own run."""

    def breaks(subset) -> bool:
        isolation.beat(f"bisection: {len(subset)} slots")
        line.update(0, note=f"{len(subset)} slots on their kernel")
        external.use_kernels(subset)
        cases, wrong_call = [], False
        for item in workload.items:
            cases.append(one(item))
            wrong_call |= not all(c["passed"] for c in external.shadow.collect())
        compared = workload.compare(cases, [0.0] * len(cases), settings.correctness)
        return wrong_call or not all(c.passed for c in compared.cases)
    try:
        with progress.spinner("bisecting the slots") as line:
            return locate(list(external.regions), breaks)
    finally:
        external.use_kernels(external.regions)


def locate(keys: list[str], breaks) -> dict:
    """The bisection's answer: first every slot on its native region; when that breaks too, the
    difference is not the kernels' (the slots' native regions round differently from
    the native engine's own code, or the first divergence is a near tie) and no slot is named;
    otherwise `first_breaking`."""
    if breaks([]):
        return {"slot": None, "breaks_alone": None, "runs": 1, "slots": len(keys),
                "without_kernels_breaks": True}
    found = first_breaking(keys, breaks)
    return {**found, "runs": found["runs"] + 1, "without_kernels_breaks": False}


def first_breaking(keys: list[str], breaks) -> dict:
    """The shortest prefix of `keys` for which `breaks(prefix)` holds (the whole list does), by
    binary search; its last key, and whether that key alone breaks."""
    runs = 0

    def run(subset) -> bool:
        nonlocal runs
        runs += 1
        return breaks(subset)

    lo, hi = 1, len(keys)  # every prefix of length >= hi breaks
    while lo < hi:
        mid = (lo + hi) // 2
        if run(keys[:mid]):
            hi = mid
        else:
            lo = mid + 1
    first = keys[hi - 1]
    return {"slot": first, "breaks_alone": run([first]), "runs": runs, "slots": len(keys)}


def judged_section(audited) -> dict:
    """The drawn calls this process computed again (host.client.Audited), as the report says
    them: a failed one, or one whose host figures differ from ours, fails the gate."""
    failed = [c for c in audited.judged if not c["passed"]]
    disagree = [c for c in audited.judged if not c["host_agrees"]]
    first = (failed or disagree or [None])[0]
    return {"calls": audited.calls, "drawn": audited.drawn, "over_budget": audited.over_budget,
            "judged": len(audited.judged), "failed": len(failed), "host_disagrees": len(disagree),
            "first_failure": first, "passed": not failed and not disagree}


def _host_section(external) -> dict | None:
    if not isinstance(external, KernelsInHost):
        return None  # the kernel ran in this process (a library caller's own gate)
    return {"confinement": external.confinement, "judged": judged_section(external.audited)}


def _report(name: str, comparison: Comparison, probe, kernels: Sequence[TestedKernel],
            shadow_summary: dict | None,
            bisection: dict | None = None, drift: dict | None = None,
            host: dict | None = None) -> GateReport:
    shadow = None if shadow_summary is None else Shadow.from_json(shadow_summary)
    failed = comparison.failed
    probe_ok = probe is None or probe.passed
    shadow_ok = shadow is None or bool(shadow.passed)
    judged = None if host is None else host["judged"]
    judged_ok = judged is None or judged["passed"]
    passed = probe_ok and shadow_ok and judged_ok and comparison.passed
    parts = []
    if judged is not None and not judged_ok:
        first = judged["first_failure"]
        parts.append(f"judged again outside the kernel's process: {judged['failed']} of "
                     f"{judged['judged']} drawn slot calls differ from the native region, and the "
                     f"host's own figures disagree with the judge's on {judged['host_disagrees']} "
                     f"(first: call {first['call']} of {first['slot']}, error ratio "
                     f"{first['max_error_ratio']:.3g})")
    if shadow is not None and not shadow_ok:
        first = shadow.first_failure
        slots = shadow.slots_failed
        parts.append(f"shadow execution: {shadow.calls_failed} of {shadow.calls_checked} "
                     f"slot calls differ from the native region"
                     + (f", in {len(slots)} slot{'s' if len(slots) > 1 else ''} "
                        f"({', '.join(slots[:4])}{', ...' if len(slots) > 4 else ''})"
                        if slots else "")
                     + (f"; first: {describe(first)}" if first else " (no call was made)"))
    if not probe_ok:
        parts.append("region probe failed: " + probe.failures())
    if failed:
        parts.append(f"{len(failed)} of {len(comparison.cases)} cases differ (indices {failed})")
    if bisection and bisection["without_kernels_breaks"]:
        parts.append("with every slot on its native region the cases break as well, so the "
                     "break is not the kernels' alone (the slots' native regions round otherwise "
                     "than the native engine, or a near tie): no slot is named")
    elif bisection:
        parts.append(f"the first slot whose kernel breaks them: {bisection['slot']} "
                     f"({'alone too' if bisection['breaks_alone'] else 'only with the slots before it'}"
                     f"; {bisection['runs']} bisection runs over {bisection['slots']} slots)")
    checked = f", {shadow.calls_checked} slot calls checked" if shadow else ""
    message = "; ".join(parts) or f"all {len(comparison.cases)} cases match{checked}"
    return GateReport("correctness", name, Verdict.PASS if passed else Verdict.FAIL, message,
                      tuple(kernels), CorrectnessSections(
                          shadow,
                          probe, comparison.kind, comparison.thresholds, comparison.cases,
                          bisection=bisection or None, instance_drift=drift or None,
                          host=host or None))


def run_correctness_gate(name: str, native, external, workload,
                         settings: GateSettings = GateSettings()) -> GateReport:
    """The whole gate on two open pipelines: native vs external end to end, item by item
    (`workload`, families/workloads.py: an encoder's texts, a decoder's prompts), every slot call
    of `external` checked by shadow execution; then the region probe of `external` over the shape
    space and the dims the end-to-end runs met, compared at `settings.correctness`
    (`probe_seed` None: drawn)."""
    from pipeline.gates.harness import allow_calls, native_seconds, seen_dims, shape_space
    from pipeline.gates.probe import region_probe, require_shadow, run_in_situ, tested_kernels
    from pipeline.runtime.shadow import summary
    require_shadow(external)
    for region in external.regions.values():
        allow_calls(external, native_seconds(region, shape_space(external, region).typical,
                                             external.family.io, external.device))
    one = workload.end_to_end(native, external)
    cases, seconds, calls = [], [], []
    with progress.bar(len(workload.items), "end-to-end items, every slot call shadowed") as bar:
        for i, item in enumerate(workload.items):
            isolation.beat(f"end-to-end item {i}")
            t0 = time.perf_counter()
            cases.append(one(item))
            seconds.append(time.perf_counter() - t0)
            calls.append(external.shadow.collect())
            bar.update(1, note=f"{seconds[-1]:.1f} s")
    seen: dict[str, set[int]] = {}
    for c in (c for item in calls for c in item):
        region = external.regions[c["binding_id"]]
        seen.setdefault(c["binding_id"], set()).update(seen_dims(region, c["input_shapes"]))
    isolation.beat("in-situ runs")
    with progress.spinner("in-situ runs: the first item native, then on every kernel (eager)"):
        situ = run_in_situ(external, workload)
    probe = region_probe(external, seed=settings.correctness.probe_seed, seen=seen,
                         in_situ=situ.inputs)
    comparison = workload.compare(cases, seconds, settings.correctness)
    shadow = summary(calls)
    bisection = None
    if len(external.regions) > 1 and not (
            shadow["passed"] and all(c.passed for c in comparison.cases)):
        bisection = bisect_instances(external, one, workload, settings)
    report = _report(name, comparison, probe, tested_kernels(external), shadow,
                     bisection, situ.drift, _host_section(external))
    report.to_json()  # checked against the schema
    return report
