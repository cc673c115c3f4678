"""A gate report as typed data: what a gate hands on and what every reader of a report file reads.

`GateReport` holds what every report says (the gate, the spec's name, the verdict and its
message, the kernels the gate ran) and the gate's own sections: `CorrectnessSections`,
`PerfSections`, or `Aborted` for a gate whose worker ended before its verdict. `to_json` gives
the report as the gate_report schema (schemas/gate_report.schema.json) names it, its keys in the
order the gates write them; `from_json` reads one back from a document already checked against
that schema (`read_report` reads and checks a file), so that `GateReport.from_json(doc).to_json()
== doc` for every report the gates write (a file holds its keys sorted).

The parts a reader computes with are typed: a perf report's every `Trial`, every region's
`RegionTiming` with its `RegionOutputs`, the `NativeAlone` baseline and the copy roofline
(roofline.py's `Roofline`); a correctness report's `ProbeReport`, one `SlotProbe` a slot with its
`ProbeCheck`s, the shadow's `first_failure` and `worst` calls (`ShadowCall`), and its kind's
thresholds and cases (families/cases.py: `EncoderThresholds` and `EncoderCase`,
`DecoderThresholds` and `DecoderCase` with its `TeacherForced` run; the kind's workload reads
them from JSON, since only families/ knows what differs between the kinds); either report's
`kernels` (`TestedKernel`). What is only recorded, rendered or counted stays JSON mappings, as
the schema defines them: a probe slot's `coverage`, `worst` and every probe call; a correctness
report's `bisection` and `instance_drift` (each read in one place, for one figure or one
table); a region's `host_enqueue_s`; either's `host` (the confinement is a free-form map, and
its judged calls' `first_failure` is an open object) and `drawn` (only counted and rendered).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.families.cases import Case, Thresholds
from pipeline.families.workloads import of_kind
from pipeline.files import shown
from pipeline.gates.roofline import Roofline
from pipeline.gates.verdict import Verdict

SCHEMA = "gate_report"
REPORT_VERSION = 6  # the schema's schema_version

Json = Mapping[str, Any]


def _maps(items: Sequence[Json]) -> tuple[Json, ...]:
    return tuple(items)


def _optional(doc: Json, key: str) -> Json | None:
    """An optional section: None where the report does not hold it."""
    value: Json | None = doc.get(key)
    return value


@dataclass(frozen=True)
class Aborted:
    """A gate whose worker ended (`how`: exit, signal, timeout, stalled, channel), with its exit
    status or signal number (None where there is none) and where it was."""
    how: str
    status: int | None
    where: str

    def to_json(self) -> dict[str, Any]:
        return {"aborted": {"how": self.how, "status": self.status, "where": self.where}}

    @classmethod
    def from_json(cls, doc: Json) -> Aborted:
        a = doc["aborted"]
        return cls(a["how"], a["status"], a["where"])


@dataclass(frozen=True)
class TestedKernel:
    """One bound kernel a gate ran (probe.tested_kernels): its slot, library and function, with
    the digests of the library's bytes as loaded and of its ABI."""
    __test__ = False  # not a test class, for pytest
    binding_id: str
    library: str
    function: str
    library_sha256: str
    abi_sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"binding_id": self.binding_id, "library": self.library, "function": self.function,
                "library_sha256": self.library_sha256, "abi_sha256": self.abi_sha256}

    @classmethod
    def from_json(cls, doc: Json) -> TestedKernel:
        return cls(doc["binding_id"], doc["library"], doc["function"], doc["library_sha256"],
                   doc["abi_sha256"])


@dataclass(frozen=True)
class ShadowCall:
    """One shadowed slot call (runtime/shadow.py: summary): its item, its index among the item's
    calls, the slot and input shapes, the figures against the native region (None: not finite)
    and the verdict; `calls_folded`: on the ledger's last row, the calls past its capacity whose
    worst figures it holds (None: not a folded row)."""
    item: int
    call: int
    binding_id: str
    input_shapes: tuple[tuple[int, ...], ...]
    max_error_ratio: float | None
    max_abs_diff: float | None
    non_finite: int
    inputs_changed: int
    passed: bool
    calls_folded: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"item": self.item, "call": self.call, "binding_id": self.binding_id,
                "input_shapes": [list(s) for s in self.input_shapes],
                "max_error_ratio": self.max_error_ratio, "max_abs_diff": self.max_abs_diff,
                "non_finite": self.non_finite, "inputs_changed": self.inputs_changed,
                "passed": self.passed,
                **({} if self.calls_folded is None else {"calls_folded": self.calls_folded})}

    @classmethod
    def from_json(cls, doc: Json) -> ShadowCall:
        return cls(doc["item"], doc["call"], doc["binding_id"],
                   tuple(tuple(s) for s in doc["input_shapes"]), doc["max_error_ratio"],
                   doc["max_abs_diff"], doc["non_finite"], doc["inputs_changed"], doc["passed"],
                   doc.get("calls_folded"))


def _call(doc: Json | None) -> ShadowCall | None:
    return None if doc is None else ShadowCall.from_json(doc)


@dataclass(frozen=True)
class Shadow:
    """Every slot call of the end-to-end runs checked against the native region (runtime/shadow.py:
    summary), with the first failing call and the call of the worst error ratio (None: none)."""
    calls_checked: int
    calls_failed: int
    slots_failed: tuple[str, ...]
    first_failure: ShadowCall | None
    worst: ShadowCall | None
    per_item: tuple[int, ...]
    passed: bool

    def to_json(self) -> dict[str, Any]:
        first, worst = self.first_failure, self.worst
        return {"calls_checked": self.calls_checked, "calls_failed": self.calls_failed,
                "slots_failed": list(self.slots_failed),
                "first_failure": None if first is None else first.to_json(),
                "worst": None if worst is None else worst.to_json(),
                "per_item": list(self.per_item), "passed": self.passed}

    @classmethod
    def from_json(cls, doc: Json) -> Shadow:
        return cls(doc["calls_checked"], doc["calls_failed"], tuple(doc["slots_failed"]),
                   _call(doc["first_failure"]), _call(doc["worst"]), tuple(doc["per_item"]),
                   doc["passed"])


@dataclass(frozen=True)
class ProbeCheck:
    """One named anti-cheat check of a probed slot (pipeline/gates/probe.py): passed, failed, or
    None where it was not run here (a CUDA check on a CPU, or one run on another slot)."""
    name: str
    passed: bool | None
    evidence: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "evidence": self.evidence}

    @classmethod
    def from_json(cls, doc: Json) -> ProbeCheck:
        return cls(doc["name"], doc["passed"], doc["evidence"])


@dataclass(frozen=True)
class SlotProbe:
    """One slot's probe: its verdict, the worst difference against the loosest per-element bound
    (`tolerance`, so a passing slot has max_abs_diff <= tolerance; inf when an element was left
    unwritten or non-finite, None as a report file reads it back), the named checks, and every
    call made. Three parts stay JSON, as the schema defines them: `coverage`
    (harness.space_coverage of its sweep; None: swept on another slot, or not recorded), read
    only for a policy's count of lengths; `worst` (the call with the largest error ratio, and its
    worst element), only recorded; `calls`, hundreds a slot, only rendered."""
    binding_id: str         # the slot key: the binding id, or ID:INSTANCE of many
    engine_role: str
    dtype: str
    shape: tuple[int, ...]  # the typical case's output shape
    seed: int
    passed: bool
    max_abs_diff: float | None
    tolerance: float
    atol: float
    rtol: float
    unwritten_elements: int
    failed_checks: tuple[str, ...]
    checks: tuple[ProbeCheck, ...]
    notes: tuple[str, ...]
    seconds: float
    coverage: Json | None
    worst: Json
    calls: tuple[Json, ...]

    def to_json(self) -> dict[str, Any]:
        return {"binding_id": self.binding_id, "engine_role": self.engine_role,
                "dtype": self.dtype, "shape": list(self.shape), "seed": self.seed,
                "passed": self.passed, "max_abs_diff": self.max_abs_diff,
                "tolerance": self.tolerance, "atol": self.atol, "rtol": self.rtol,
                "unwritten_elements": self.unwritten_elements,
                "failed_checks": list(self.failed_checks),
                "checks": [c.to_json() for c in self.checks], "notes": list(self.notes),
                "seconds": self.seconds, "coverage": self.coverage, "worst": self.worst,
                "calls": list(self.calls)}

    @classmethod
    def from_json(cls, doc: Json) -> SlotProbe:
        return cls(doc["binding_id"], doc["engine_role"], doc["dtype"], tuple(doc["shape"]),
                   doc["seed"], doc["passed"], doc["max_abs_diff"], doc["tolerance"], doc["atol"],
                   doc["rtol"], doc["unwritten_elements"], tuple(doc["failed_checks"]),
                   tuple(ProbeCheck.from_json(c) for c in doc["checks"]), tuple(doc["notes"]),
                   doc["seconds"], doc.get("coverage"), doc["worst"], _maps(doc["calls"]))


@dataclass(frozen=True)
class ProbeReport:
    """Every slot's probe, the `probe` section of a correctness report; it passes when every
    slot does."""
    device: str
    seed: int
    slots: tuple[SlotProbe, ...]

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.slots)

    def failures(self) -> str:
        """The failed checks, slot by slot, in one line."""
        return "; ".join(f"{s.binding_id} {', '.join(s.failed_checks)}" for s in self.slots
                         if s.failed_checks)

    def as_dict(self) -> dict[str, Any]:
        """The section as the gate_report schema names it (not checked)."""
        return {"passed": self.passed, "device": self.device, "seed": self.seed,
                "slots": [s.to_json() for s in self.slots]}

    def to_json(self) -> dict[str, Any]:
        """`as_dict`, checked against its schema section: a UserError names the field at fault."""
        report = self.as_dict()
        jsonio.validate_written(report, "gate_report#probe", "probe report")
        return report

    @classmethod
    def from_json(cls, doc: Json) -> ProbeReport:
        """A ValueError for a section whose `passed` is not its slots'."""
        probe = cls(doc["device"], doc["seed"], tuple(SlotProbe.from_json(s) for s in doc["slots"]))
        if probe.passed != doc["passed"]:
            raise ValueError(f"$.probe.passed: {doc['passed']!r} with slots that "
                             f"{'all' if probe.passed else 'do not all'} pass")
        return probe


@dataclass(frozen=True)
class CorrectnessSections:
    """The correctness gate's sections: the shadow execution and the region probe (None where not
    run), the model's kind with its thresholds and one case per item (the kind's own types,
    families/cases.py), and the optional parts (None: not in the report)."""
    shadow: Shadow | None
    probe: ProbeReport | None
    kind: str
    thresholds: Thresholds
    cases: tuple[Case, ...]
    bisection: Json | None = None
    instance_drift: Json | None = None
    host: Json | None = None
    drawn: Json | None = None

    @property
    def probe_passed(self) -> bool | None:
        return None if self.probe is None else self.probe.passed

    @property
    def probe_slots(self) -> tuple[SlotProbe, ...]:
        return () if self.probe is None else self.probe.slots

    def to_json(self) -> dict[str, Any]:
        return {"shadow": None if self.shadow is None else self.shadow.to_json(),
                "probe": None if self.probe is None else self.probe.as_dict(), "kind": self.kind,
                "thresholds": self.thresholds.to_json(),
                "cases": [c.to_json() for c in self.cases],
                **({"bisection": self.bisection} if self.bisection is not None else {}),
                **({"instance_drift": self.instance_drift} if self.instance_drift is not None else {}),
                **({"host": self.host} if self.host is not None else {}),
                **({"drawn": self.drawn} if self.drawn is not None else {})}

    @classmethod
    def from_json(cls, doc: Json) -> CorrectnessSections:
        shadow, probe, workload = doc["shadow"], doc["probe"], of_kind(doc["kind"])
        return cls(None if shadow is None else Shadow.from_json(shadow),
                   None if probe is None else ProbeReport.from_json(probe), doc["kind"],
                   workload.thresholds_type.from_json(doc["thresholds"]),
                   tuple(workload.case_type.from_json(c) for c in doc["cases"]), _optional(doc, "bisection"),
                   _optional(doc, "instance_drift"), _optional(doc, "host"),
                   _optional(doc, "drawn"))


@dataclass(frozen=True)
class TimingSettings:
    """How the perf gate timed and judged the trials, as its report records them: the threshold
    and bootstrap, the timer, the trials run and the early-stop rule (`stopped_at` None: ran to
    `max_trials`), and on a CPU the threads both arms were given (`cpu_threads`, None on a GPU;
    `cpu_threads_written`: False for a report that does not hold the key)."""
    threshold: float
    seed: int
    resamples: int
    confidence: float
    timer: str
    warmup: int
    trials: int
    max_trials: int
    min_trials: int
    check_every: int
    stopped_at: int | None
    stop_reason: str
    items_per_call: int
    unit: str
    cpu_threads: int | None = None
    cpu_threads_written: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "seed": self.seed, "resamples": self.resamples,
                "confidence": self.confidence, "timer": self.timer, "warmup": self.warmup,
                "trials": self.trials, "max_trials": self.max_trials,
                "min_trials": self.min_trials, "check_every": self.check_every,
                "stopped_at": self.stopped_at, "stop_reason": self.stop_reason,
                "items_per_call": self.items_per_call, "unit": self.unit,
                **({"cpu_threads": self.cpu_threads} if self.cpu_threads_written else {})}

    @classmethod
    def from_json(cls, doc: Json) -> TimingSettings:
        return cls(doc["threshold"], doc["seed"], doc["resamples"], doc["confidence"],
                   doc["timer"], doc["warmup"], doc["trials"], doc["max_trials"],
                   doc["min_trials"], doc["check_every"], doc["stopped_at"], doc["stop_reason"],
                   doc["items_per_call"], doc["unit"], doc.get("cpu_threads"),
                   "cpu_threads" in doc)


# the summary's figures that may be null and may also be left out of a report
_NULLABLE_SUMMARY = ("predicted_ratio", "native_cpu_cores", "external_cpu_cores")
# the summary's figures of a report with a native_alone baseline (never null)
_ALONE_SUMMARY = ("native_alone_median_throughput", "native_beside_over_alone",
                  "external_over_alone")


@dataclass(frozen=True)
class PerfSummary:
    """The perf gate's figures: the median external/native throughput ratio, its bootstrap
    interval and what the interval alone says (`interval_verdict`), each arm's median
    throughput, the ratio the regions predict, against the native baseline timed alone (None
    without one), and each arm's CPU cores kept busy. `left_out`: the nullable figures the report
    does not hold at all."""
    median_ratio: float
    ci_low: float
    ci_high: float
    interval_verdict: Verdict
    native_median_throughput: float
    external_median_throughput: float
    predicted_ratio: float | None = None
    native_alone_median_throughput: float | None = None
    native_beside_over_alone: float | None = None
    external_over_alone: float | None = None
    native_cpu_cores: float | None = None
    external_cpu_cores: float | None = None
    left_out: frozenset[str] = field(default_factory=frozenset)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "median_ratio": self.median_ratio, "ci_low": self.ci_low, "ci_high": self.ci_high,
            "interval_verdict": self.interval_verdict.value,
            "native_median_throughput": self.native_median_throughput}
        if "predicted_ratio" not in self.left_out:
            out["predicted_ratio"] = self.predicted_ratio
        out.update({k: getattr(self, k) for k in _ALONE_SUMMARY if getattr(self, k) is not None})
        out["external_median_throughput"] = self.external_median_throughput
        out.update({k: getattr(self, k) for k in _NULLABLE_SUMMARY[1:] if k not in self.left_out})
        return out

    @classmethod
    def from_json(cls, doc: Json) -> PerfSummary:
        return cls(doc["median_ratio"], doc["ci_low"], doc["ci_high"],
                   Verdict(doc["interval_verdict"]), doc["native_median_throughput"],
                   doc["external_median_throughput"],
                   **{k: doc.get(k) for k in (*_NULLABLE_SUMMARY, *_ALONE_SUMMARY)},
                   left_out=frozenset(k for k in _NULLABLE_SUMMARY if k not in doc))


@dataclass(frozen=True)
class TimedOutputs:
    """Every trial's outputs of both arms compared, untimed: passed, the worst trial's max |diff|
    (None: not finite), in words, and how many trials were checked (None: not recorded)."""
    passed: bool
    max_abs_diff: float | None
    detail: str
    trials_checked: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "max_abs_diff": self.max_abs_diff, "detail": self.detail,
                **({"trials_checked": self.trials_checked}
                   if self.trials_checked is not None else {})}

    @classmethod
    def from_json(cls, doc: Json) -> TimedOutputs:
        return cls(doc["passed"], doc["max_abs_diff"], doc["detail"], doc.get("trials_checked"))


@dataclass(frozen=True)
class Trial:
    """One perf trial: both arms timed back to back (`first` went first), each arm's seconds and
    throughput, the ratio (external / native throughput), and each arm's CPU seconds over its
    run (None: not recorded)."""
    trial: int
    first: str
    native_s: float
    external_s: float
    native_throughput: float
    external_throughput: float
    ratio: float
    native_cpu_s: float | None = None
    external_cpu_s: float | None = None

    @property
    def cores(self) -> tuple[float, float] | None:
        """Each arm's CPU seconds over its wall seconds (native, external): the cores it kept
        busy; None where the trial holds no CPU seconds."""
        if self.native_cpu_s is None or self.external_cpu_s is None:
            return None
        return self.native_cpu_s / self.native_s, self.external_cpu_s / self.external_s

    def to_json(self) -> dict[str, Any]:
        cpu_s = {"native_cpu_s": self.native_cpu_s, "external_cpu_s": self.external_cpu_s}
        return {"trial": self.trial, "first": self.first, "native_s": self.native_s,
                "external_s": self.external_s, **{k: v for k, v in cpu_s.items() if v is not None},
                "native_throughput": self.native_throughput,
                "external_throughput": self.external_throughput, "ratio": self.ratio}

    @classmethod
    def from_json(cls, doc: Json) -> Trial:
        return cls(doc["trial"], doc["first"], doc["native_s"], doc["external_s"],
                   doc["native_throughput"], doc["external_throughput"], doc["ratio"],
                   doc.get("native_cpu_s"), doc.get("external_cpu_s"))


@dataclass(frozen=True)
class RegionOutputs:
    """A region timing's kernel calls, each output checked against the native rule: how many,
    the worst error ratio (1 is the dtype's tolerance), and the first wrong call (None: every
    call right)."""
    calls_checked: int
    max_error_ratio: float
    first_wrong_call: int | None

    def to_json(self) -> dict[str, Any]:
        return {"calls_checked": self.calls_checked, "max_error_ratio": self.max_error_ratio,
                "first_wrong_call": self.first_wrong_call}

    @classmethod
    def from_json(cls, doc: Json) -> RegionOutputs:
        """A null error ratio (non-finite, as JSON carries it across the kernel host's channel)
        reads as inf."""
        ratio = doc["max_error_ratio"]
        return cls(doc["calls_checked"], float("inf") if ratio is None else ratio,
                   doc["first_wrong_call"])


@dataclass(frozen=True)
class RegionTiming:
    """One slot's region timed alone (performance.time_region): native region vs bound kernel at
    the typical case, as the engine runs them, against the floor the copy roofline sets for the
    bytes it moves. `host_enqueue_s`: on CUDA each arm's host launch seconds (None on a CPU)."""
    binding_id: str
    case: str
    timer: str
    engine: str
    trials: int
    l2_flush_bytes: int
    bytes: int
    bandwidth_bytes_per_s: float
    floor_s: float
    native_median_s: float
    kernel_median_s: float
    kernel_speedup: float
    kernel_roofline_fraction: float
    native_roofline_fraction: float
    outputs: RegionOutputs
    host_enqueue_s: Mapping[str, float] | None = None

    @property
    def wrong(self) -> bool:
        """Some timed call's output was wrong: the timing is no speed of a right kernel."""
        return self.outputs.first_wrong_call is not None

    def to_json(self) -> dict[str, Any]:
        return {"binding_id": self.binding_id, "case": self.case, "timer": self.timer,
                "engine": self.engine, "trials": self.trials,
                "l2_flush_bytes": self.l2_flush_bytes,
                **({} if self.host_enqueue_s is None else {"host_enqueue_s": self.host_enqueue_s}),
                "bytes": self.bytes, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "floor_s": self.floor_s, "native_median_s": self.native_median_s,
                "kernel_median_s": self.kernel_median_s, "kernel_speedup": self.kernel_speedup,
                "kernel_roofline_fraction": self.kernel_roofline_fraction,
                "native_roofline_fraction": self.native_roofline_fraction,
                "outputs": self.outputs.to_json()}

    @classmethod
    def from_json(cls, doc: Json) -> RegionTiming:
        return cls(doc["binding_id"], doc["case"], doc["timer"], doc["engine"], doc["trials"],
                   doc["l2_flush_bytes"], doc["bytes"], doc["bandwidth_bytes_per_s"],
                   doc["floor_s"], doc["native_median_s"], doc["kernel_median_s"],
                   doc["kernel_speedup"], doc["kernel_roofline_fraction"],
                   doc["native_roofline_fraction"], RegionOutputs.from_json(doc["outputs"]),
                   doc.get("host_enqueue_s"))


@dataclass(frozen=True)
class NativeAlone:
    """The native engine timed before the kernel's library was loaded (performance.native_alone):
    each run's seconds and the median throughput."""
    timer: str
    native_s: tuple[float, ...]
    median_throughput: float

    def to_json(self) -> dict[str, Any]:
        return {"timer": self.timer, "native_s": list(self.native_s),
                "median_throughput": self.median_throughput}

    @classmethod
    def from_json(cls, doc: Json) -> NativeAlone:
        return cls(doc["timer"], tuple(doc["native_s"]), doc["median_throughput"])


@dataclass(frozen=True)
class PerfSections:
    """The perf gate's sections: its settings and summary, the timed outputs' comparison (None:
    not compared), every region's timing and every trial, and the optional parts (None: not in
    the report)."""
    settings: TimingSettings
    summary: PerfSummary
    outputs: TimedOutputs | None
    regions: tuple[RegionTiming, ...]
    trials: tuple[Trial, ...]
    native_alone: NativeAlone | None = None
    roofline: Roofline | None = None
    host: Json | None = None
    drawn: Json | None = None

    def to_json(self) -> dict[str, Any]:
        return {"settings": self.settings.to_json(), "summary": self.summary.to_json(),
                "outputs": None if self.outputs is None else self.outputs.to_json(),
                "regions": [r.to_json() for r in self.regions],
                "trials": [t.to_json() for t in self.trials],
                **({"native_alone": self.native_alone.to_json()} if self.native_alone is not None
                   else {}),
                **({"roofline": self.roofline.to_json()} if self.roofline is not None else {}),
                **({"host": self.host} if self.host is not None else {}),
                **({"drawn": self.drawn} if self.drawn is not None else {})}

    @classmethod
    def from_json(cls, doc: Json) -> PerfSections:
        outputs, alone, roofline = doc["outputs"], doc.get("native_alone"), doc.get("roofline")
        return cls(TimingSettings.from_json(doc["settings"]), PerfSummary.from_json(doc["summary"]),
                   None if outputs is None else TimedOutputs.from_json(outputs),
                   tuple(RegionTiming.from_json(r) for r in doc["regions"]),
                   tuple(Trial.from_json(t) for t in doc["trials"]),
                   None if alone is None else NativeAlone.from_json(alone),
                   None if roofline is None else Roofline.from_json(roofline),
                   _optional(doc, "host"), _optional(doc, "drawn"))


Sections = CorrectnessSections | PerfSections | Aborted


@dataclass(frozen=True)
class GateReport:
    """One gate's report: what every report says (the gate, the spec's name, the verdict and its
    message, the kernels the gate ran) and the gate's own sections. Passed means the verdict is
    pass."""
    gate: str
    name: str
    verdict: Verdict
    message: str
    kernels: tuple[TestedKernel, ...]
    sections: Sections

    @property
    def passed(self) -> bool:
        return self.verdict == Verdict.PASS

    @property
    def aborted(self) -> Aborted | None:
        return self.sections if isinstance(self.sections, Aborted) else None

    @property
    def correctness(self) -> CorrectnessSections | None:
        """The correctness sections; None for a perf or an aborted report."""
        return self.sections if isinstance(self.sections, CorrectnessSections) else None

    @property
    def perf(self) -> PerfSections | None:
        """The perf sections; None for a correctness or an aborted report."""
        return self.sections if isinstance(self.sections, PerfSections) else None

    @property
    def host(self) -> Json | None:
        return None if isinstance(self.sections, Aborted) else self.sections.host

    @property
    def drawn(self) -> Json | None:
        return None if isinstance(self.sections, Aborted) else self.sections.drawn

    def with_sections(self, **changes: Any) -> GateReport:
        """The report with these fields of its sections replaced (e.g. `host`, `drawn`)."""
        return replace(self, sections=replace(self.sections, **changes))

    def as_dict(self) -> dict[str, Any]:
        """The report's fields as the gate_report schema names them (not checked)."""
        return {"schema_version": REPORT_VERSION, "gate": self.gate, "name": self.name,
                "passed": self.passed, "verdict": self.verdict.value, "message": self.message,
                "kernels": [k.to_json() for k in self.kernels], **self.sections.to_json()}

    def to_json(self) -> dict[str, Any]:
        """`as_dict`, checked against the gate_report schema as its file will read back (a
        non-finite figure is null there): a UserError names the field at fault."""
        report = self.as_dict()
        jsonio.validate_written(report, SCHEMA, f"{self.gate} report of {self.name}")
        return report

    @classmethod
    def from_json(cls, doc: Json) -> GateReport:
        """A report from a document already checked against the gate_report schema; a ValueError
        for one whose `passed` is not its verdict's, or whose probe's is not its slots'."""
        sections: Sections
        if "aborted" in doc:
            sections = Aborted.from_json(doc)
        elif doc["gate"] == "perf":
            sections = PerfSections.from_json(doc)
        else:
            sections = CorrectnessSections.from_json(doc)
        report = cls(doc["gate"], doc["name"], Verdict(doc["verdict"]), doc["message"],
                     tuple(TestedKernel.from_json(k) for k in doc["kernels"]), sections)
        if report.passed != doc["passed"]:
            raise ValueError(f"$.passed: {doc['passed']!r} with the verdict "
                             f"{report.verdict.value!r} (expected passed only with pass)")
        return report


def read_report(path: str | os.PathLike[str]) -> GateReport:
    """The gate report file at `path`, read as strictly as any JSON file and checked against the
    gate_report schema (a UserError naming the file otherwise)."""
    doc = jsonio.read_json(path, SCHEMA)
    try:
        return GateReport.from_json(doc)
    except ValueError as e:
        raise UserError(f"{shown(path)}: {e} (expected a valid {SCHEMA} file)") from None
