"""A gate policy: floors a CI job holds every promotion to, whatever the spec asked.

A spec's author sets its gates' thresholds, and a kernel's author may write the spec: a perf
threshold of 0.001, five trials, or a correctness tolerance of 1.0 promote anything that runs.
`trtmc gate verify --policy POLICY.json` checks the settings the two verdicts were reached
under, as their reports record them (verify has checked those against the pinned spec and
re-derived each verdict from them), against the policy's floors; a laxer one is a difference,
so the receipt does not verify.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pipeline import jsonio
from pipeline.families.workloads import of_kind
from pipeline.gates.report_types import GateReport
from pipeline.gates.verification import Check

SCHEMA = "gate_policy"


@dataclass(frozen=True)
class GatePolicy:
    """The floors (None: no floor): where the verdicts were reached, the correctness thresholds
    at their laxest, the perf threshold, confidence and number of trials at their lowest, and the
    capabilities a kernel's library may have been granted (none unless listed)."""
    path: Path
    device: str | None = None
    max_abs_diff: float | None = None
    min_cosine: float | None = None
    max_tie_steps: int | None = None
    min_threshold: float | None = None
    min_confidence: float | None = None
    min_trials: int | None = None
    capabilities: tuple[str, ...] = ()  # what a spec may grant its kernel's library
    min_items: int | None = None
    min_drawn: int | None = None
    min_new_tokens: int | None = None
    min_calls_checked: int | None = None
    min_lengths_probed: int | None = None
    drawn_probe_seed: bool = False

    @classmethod
    def read(cls, path: str | os.PathLike) -> GatePolicy:
        doc = jsonio.read_json(path, SCHEMA)
        return cls(Path(path), doc.get("device"), **doc.get("correctness", {}),
                   **doc.get("perf", {}), **doc.get("evidence", {}),
                   capabilities=tuple(doc.get("capabilities", ())))

    def checks(self, device: str, correctness: GateReport | None, perf: GateReport | None,
               gates=None) -> list[Check]:
        """One check per floor that applies: the receipt's device, the two reports' settings and
        evidence (None: a report verify could not read, which it reports itself), and the pinned
        spec's gate settings (`gates`: a GateSettings, None for a spec of another kind). A floor
        on a figure the report does not have (an encoder's tolerance for a decoder) does not
        apply."""
        corr = None if correctness is None else correctness.correctness
        held = None if corr is None else corr.thresholds  # a field of another kind's: None

        def thresholds(name: str):
            return getattr(held, name, None)
        settings = None if perf is None or perf.perf is None else perf.perf.settings
        evidence = _evidence(correctness, gates)
        floors = [  # (what, the report's figure, the policy's floor, the figure must be at least)
            ("device", device, self.device, None),
            ("correctness max_abs_diff", thresholds("max_abs_diff"), self.max_abs_diff, False),
            ("correctness min_cosine", thresholds("min_cosine"), self.min_cosine, True),
            ("correctness tie_steps", thresholds("tie_steps"), self.max_tie_steps, False),
            ("perf threshold", None if settings is None else settings.threshold,
             self.min_threshold, True),
            ("perf confidence", None if settings is None else settings.confidence,
             self.min_confidence, True),
            ("perf trials", None if perf is None else _trials(perf), self.min_trials, True),
            ("items", evidence["items"], self.min_items, True),
            ("drawn items", evidence["drawn"], self.min_drawn, True),
            ("new tokens", evidence["new_tokens"], self.min_new_tokens, True),
            ("calls checked", evidence["calls_checked"], self.min_calls_checked, True),
            ("lengths probed", evidence["lengths_probed"], self.min_lengths_probed, True),
            ("a drawn probe seed", evidence["probe_seed_drawn"],
             True if self.drawn_probe_seed else None, None),
        ]
        granted = sorted({c for report in (correctness, perf) if report
                          for c in (report.host or {}).get("capabilities", [])})
        beyond = [c for c in granted if c not in self.capabilities]
        out = [Check.of("policy capabilities", self.path, not beyond,
                        f"the kernel's library was granted {', '.join(beyond)}; the policy allows "
                        f"{', '.join(self.capabilities) or 'none'}")]
        for what, figure, floor, at_least in floors:
            if floor is None or (figure is None and at_least is not None):
                continue
            if at_least is None:
                ok, wanted = figure == floor, f"{floor}"
            else:
                ok = figure >= floor if at_least else figure <= floor
                wanted = f"{'at least' if at_least else 'at most'} {floor}"
            out.append(Check.of(f"policy {what}", self.path, ok,
                                f"the verdict's {figure!r}, the policy's {wanted}"))
        return out


def _trials(perf: GateReport) -> int:
    if perf.perf is None:  # an aborted report holds no trials
        raise KeyError("trials")
    return len(perf.perf.trials)


def _evidence(correctness: GateReport | None, gates) -> dict:
    """What the correctness verdict rests on, as its report and the pinned spec say (None: not
    known, or not of this kind of model)."""
    c = None if correctness is None else correctness.correctness  # None: no report, or aborted
    coverages = [slot.coverage for slot in (() if c is None else c.probe_slots)]
    sweeps = [sum(cov["lengths"] for cov in coverage.values() if cov)
              for coverage in coverages if coverage and any(coverage.values())]
    workload = None if c is None else of_kind(c.kind)
    return {"items": None if c is None else len(c.cases),
            "drawn": len((correctness.drawn or {}).get("items", [])) if correctness else None,
            "new_tokens": workload.generated_tokens(gates.max_new_tokens)
            if workload is not None and gates is not None else None,
            "calls_checked": None if c is None or c.shadow is None else c.shadow.calls_checked,
            "lengths_probed": min(sweeps) if sweeps else None,
            "probe_seed_drawn": None if gates is None else gates.correctness.probe_seed is None}
