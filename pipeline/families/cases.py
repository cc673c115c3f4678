"""A correctness report's end-to-end part as typed data, one type per model kind: the thresholds
the cases were judged at and one case per item, as the gate_report schema names them
(schemas/gate_report.schema.json: `thresholds`, `encoder_case`, `decoder_case`).

Each kind's workload (workloads.py) makes its own cases and thresholds, names their types
(`EncoderWorkload.case_type`, `.thresholds_type`) and is the only reader of what differs between
them; what every case holds (`index`, `input`, `passed`, `seconds`, `detail`) any reader may read.
`to_json` gives a part with its keys in the order the gate writes them; `from_json` reads one from
a document already checked against the schema, so that `from_json(doc).to_json() == doc`. A
figure that was not finite is None here, as a report file holds it (null).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

Json = Mapping[str, Any]


# -- thresholds ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EncoderThresholds:
    """An encoder's cases pass within max |diff| and at least the cosine, over all rows and over
    the real tokens alike."""
    max_abs_diff: float
    min_cosine: float

    def to_json(self) -> dict[str, Any]:
        return {"max_abs_diff": self.max_abs_diff, "min_cosine": self.min_cosine}

    @classmethod
    def from_json(cls, doc: Json) -> EncoderThresholds:
        return cls(doc["max_abs_diff"], doc["min_cosine"])


@dataclass(frozen=True)
class DecoderThresholds:
    """A decoder's teacher-forced steps are held to `tie_steps` rounding steps of the logits'
    dtype."""
    tie_steps: int

    def to_json(self) -> dict[str, Any]:
        return {"tie_steps": self.tie_steps}

    @classmethod
    def from_json(cls, doc: Json) -> DecoderThresholds:
        return cls(doc["tie_steps"])


# -- an encoder's case -----------------------------------------------------------------------------
@dataclass(frozen=True)
class EncoderCase:
    """One text: max |diff| and cosine of the hidden states over all rows and over the real
    (unpadded) tokens (None: not compared, the shapes differed or the output was not finite, or a
    figure not finite), and why it failed (`detail`, empty when it passed)."""
    index: int
    input: str
    passed: bool
    max_abs_diff: float | None
    cosine: float | None
    real_tokens: int | None
    real_max_abs_diff: float | None
    real_cosine: float | None
    seconds: float
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "input": self.input, "passed": self.passed,
                "max_abs_diff": self.max_abs_diff, "cosine": self.cosine,
                "real_tokens": self.real_tokens, "real_max_abs_diff": self.real_max_abs_diff,
                "real_cosine": self.real_cosine, "seconds": self.seconds, "detail": self.detail}

    @classmethod
    def from_json(cls, doc: Json) -> EncoderCase:
        return cls(doc["index"], doc["input"], doc["passed"], doc["max_abs_diff"], doc["cosine"],
                   doc["real_tokens"], doc["real_max_abs_diff"], doc["real_cosine"],
                   doc["seconds"], doc["detail"])


# -- a decoder's case ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForcedStep:
    """One teacher-forced step: max |Δlogit|, KL(native||external), top-1 agreement, native's
    top-2 margin and the step's tolerance."""
    step: int
    max_abs_logit_diff: float | None
    kl: float | None
    top1_agree: bool
    native_top2_margin: float | None
    tolerance: float | None

    @property
    def tie(self) -> bool:
        """Native's top two logits are closer than the step's tolerance, and so are the arms."""
        assert self.native_top2_margin is not None and self.max_abs_logit_diff is not None \
            and self.tolerance is not None
        return max(self.native_top2_margin, self.max_abs_logit_diff) <= self.tolerance

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "max_abs_logit_diff": self.max_abs_logit_diff, "kl": self.kl,
                "top1_agree": self.top1_agree, "native_top2_margin": self.native_top2_margin,
                "tolerance": self.tolerance}

    @classmethod
    def from_json(cls, doc: Json) -> ForcedStep:
        return cls(doc["step"], doc["max_abs_logit_diff"], doc["kl"], doc["top1_agree"],
                   doc["native_top2_margin"], doc["tolerance"])


@dataclass(frozen=True)
class Divergence:
    """Where the greedy tokens first differ, teacher-forced: whether it is a near tie, and whether
    the case is accepted there."""
    step: int
    native_top2_margin: float | None
    max_abs_logit_diff: float | None
    tolerance: float | None
    near_tie: bool
    accepted: bool

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "native_top2_margin": self.native_top2_margin,
                "max_abs_logit_diff": self.max_abs_logit_diff, "tolerance": self.tolerance,
                "near_tie": self.near_tie, "accepted": self.accepted}

    @classmethod
    def from_json(cls, doc: Json) -> Divergence:
        return cls(doc["step"], doc["native_top2_margin"], doc["max_abs_logit_diff"],
                   doc["tolerance"], doc["near_tie"], doc["accepted"])


@dataclass(frozen=True)
class TeacherForced:
    """Both arms fed native's tokens: every step, the worst |Δlogit| and KL, the top-1 agreement,
    the tolerance in rounding steps, whether every step is within its tolerance, and where the
    greedy tokens diverge (None: they do not, or past the forced steps)."""
    steps: tuple[ForcedStep, ...]
    max_abs_logit_diff: float | None
    max_kl: float | None
    top1_agreement: float
    tie_steps: int
    within_tolerance: bool
    divergence: Divergence | None = None

    def to_json(self) -> dict[str, Any]:
        return {"steps": [s.to_json() for s in self.steps],
                "max_abs_logit_diff": self.max_abs_logit_diff, "max_kl": self.max_kl,
                "top1_agreement": self.top1_agreement, "tie_steps": self.tie_steps,
                "within_tolerance": self.within_tolerance,
                "divergence": None if self.divergence is None else self.divergence.to_json()}

    @classmethod
    def from_json(cls, doc: Json) -> TeacherForced:
        d = doc["divergence"]
        return cls(tuple(ForcedStep.from_json(s) for s in doc["steps"]),
                   doc["max_abs_logit_diff"], doc["max_kl"], doc["top1_agreement"],
                   doc["tie_steps"], doc["within_tolerance"],
                   None if d is None else Divergence.from_json(d))


@dataclass(frozen=True)
class DecoderCase:
    """One prompt: both arms' greedy tokens, why they count as different (`detail`, empty when
    identical), and the teacher-forced run (None: not made)."""
    index: int
    input: str
    passed: bool
    native_tokens: tuple[int, ...]
    external_tokens: tuple[int, ...]
    detail: str
    seconds: float
    teacher_forced: TeacherForced | None

    def to_json(self) -> dict[str, Any]:
        tf = self.teacher_forced
        return {"index": self.index, "input": self.input, "passed": self.passed,
                "native_tokens": list(self.native_tokens),
                "external_tokens": list(self.external_tokens), "detail": self.detail,
                "seconds": self.seconds, "teacher_forced": None if tf is None else tf.to_json()}

    @classmethod
    def from_json(cls, doc: Json) -> DecoderCase:
        tf = doc["teacher_forced"]
        return cls(doc["index"], doc["input"], doc["passed"], tuple(doc["native_tokens"]),
                   tuple(doc["external_tokens"]), doc["detail"], doc["seconds"],
                   None if tf is None else TeacherForced.from_json(tf))


Case = EncoderCase | DecoderCase
Thresholds = EncoderThresholds | DecoderThresholds


@dataclass(frozen=True)
class Comparison:
    """A workload's end-to-end comparison (`compare`): its kind's name, the thresholds it judged
    at, one case per item. It passes when there are cases and every one passes."""
    kind: str
    thresholds: Thresholds
    cases: tuple[Case, ...]

    @property
    def failed(self) -> list[int]:
        """The failed cases' indices."""
        return [c.index for c in self.cases if not c.passed]

    @property
    def passed(self) -> bool:
        return bool(self.cases) and not self.failed
