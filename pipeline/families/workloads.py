"""What the gates run on a model, per model kind: each family declares its workload (`Family.
workload`), and the gates and stages ask it instead of telling encoders from decoders.

A workload carries what differs between the kinds: which inputs the spec's `gates` block gives
(texts, or prompts and max_new_tokens), how one end-to-end run is made on an open pipeline, and
how two arms' outputs compare.

* Encoders: per text, max |diff| and cosine of the hidden state over the full [S, H] tensor and
  over its real (unpadded) tokens only, since padding rows can hide a wrong kernel in a
  full-tensor cosine; both must pass. The perf trials time the networks on texts tokenized once.
* Decoders: the greedy tokens must be identical, or part at a near tie; a teacher-forced run feeds
  both arms native's tokens and compares every step (max |Δlogit|, KL(native||external), top-1
  agreement) against a tolerance of a few rounding steps of the logits' dtype (`tie_steps`), so
  a tie that rounding flips is told from a kernel that changes the logits. The perf trials time
  generation of max_new_tokens.

The comparisons are pure functions over tensors and token lists, so they test without models.
The runs use a pipeline's public calls only (`encode_text`, `encoder`, `generate`,
`teacher_forced_logits`); torch is imported when a run or a comparison is made.

A workload class also owns every other decision that differs by kind, so no code outside
families/ compares a kind's name: which requests a pipeline refuses (`check_generates`,
`check_embeds`), the thresholds a correctness report records and what its cases must show again
(`thresholds`, `unfounded_passes`), the ledger's figures, the report's Markdown and JUnit lines,
and the new tokens a policy counts. A report's `kind` finds its class through `of_kind`, the one
lookup from a kind's name.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Sequence, TypeVar

from pipeline.errors import UserError
from pipeline.families.cases import (Case, Comparison, DecoderCase, DecoderThresholds,
                                     Divergence, EncoderCase, EncoderThresholds, ForcedStep,
                                     TeacherForced, Thresholds)

Fmt = Callable[[Any], str]  # how a report prints a figure (None: n/a)
T = TypeVar("T")


def _only(kind: type[T], items: Iterable[object]) -> list[T]:
    """`items`, each one of this kind's type (a ValueError otherwise: a report whose `kind` is
    not its cases' or thresholds')."""
    out = list(items)
    for x in out:
        if not isinstance(x, kind):
            raise ValueError(f"{type(x).__name__} where a {kind.__name__} was expected")
    return out  # type: ignore[return-value]


# -- comparisons ----------------------------------------------------------------------------------
def _figures(a, b) -> tuple[float, float]:
    import torch
    a64, b64 = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
    diff = float((a64 - b64).abs().max()) if a64.numel() else 0.0
    return diff, float(torch.nn.functional.cosine_similarity(a64, b64, dim=0, eps=1e-30))


def encoder_case_passes(case: EncoderCase, max_abs_diff: float,
                        min_cosine: float) -> tuple[bool, float, float]:
    """(within the thresholds, worst max |diff|, lowest cosine) of an encoder case's figures, over
    all rows and over the real tokens alike; a figure a report holds as null (not finite) is
    outside them."""
    diffs, cosines = (case.max_abs_diff, case.real_max_abs_diff), (case.cosine, case.real_cosine)
    if None in diffs or None in cosines:
        return False, math.inf, -math.inf
    worst = max(d for d in diffs if d is not None)
    cosine = min(c for c in cosines if c is not None)
    return worst <= max_abs_diff and cosine >= min_cosine, worst, cosine


def compare_encoder(native: list, external: list, texts: list[str], masks: list | None = None,
                    seconds: list[float] | None = None, *, max_abs_diff: float,
                    min_cosine: float) -> Comparison:
    """One case per text: max |native - external| and cosine of the hidden states, over all rows
    and over the rows `masks` marks as real tokens (all rows without masks)."""
    import torch
    if not (len(native) == len(external) == len(texts)):
        raise ValueError("native, external and texts must have the same length")
    cases = []
    for i, (text, a, b) in enumerate(zip(texts, native, external)):
        case = EncoderCase(i, text, False, None, None, None, None, None,
                           seconds[i] if seconds else 0.0, "")
        if a.shape != b.shape:
            cases.append(dataclasses.replace(
                case, detail=f"shape {list(b.shape)} != native {list(a.shape)}"))
            continue
        if not bool(torch.isfinite(b).all()):
            cases.append(dataclasses.replace(case, detail="external output has non-finite values"))
            continue
        real = masks[i].bool().cpu() if masks else torch.ones(a.shape[0], dtype=torch.bool)
        diff, cosine = _figures(a, b)
        real_diff, real_cosine = _figures(a.cpu()[real], b.cpu()[real])
        case = dataclasses.replace(case, max_abs_diff=diff, cosine=cosine,
                                   real_tokens=int(real.sum()), real_max_abs_diff=real_diff,
                                   real_cosine=real_cosine)
        passed, worst, cos = encoder_case_passes(case, max_abs_diff, min_cosine)
        cases.append(dataclasses.replace(case, passed=passed, detail="" if passed else (
            f"max |diff| {worst:.4g} (limit {max_abs_diff}), cosine {cos:.6f} "
            f"(limit {min_cosine}) over all rows / the {case.real_tokens} real tokens")))
    return Comparison("encoder", EncoderThresholds(max_abs_diff, min_cosine), tuple(cases))


def logit_step(dtype, magnitude: float) -> float:
    """The spacing of `dtype`'s values at `magnitude`: the rounding step of a logit there."""
    import torch
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(max(magnitude, info.tiny)))


def teacher_forced(native: list, external: list, precision=None, *,
                   tie_steps: int) -> TeacherForced:
    """Per step of one teacher-forced sequence (both arms' logits [vocab]): max |Δlogit|,
    KL(native||external), top-1 agreement, native's top-2 margin, and the step's tolerance:
    `tie_steps` rounding steps of `precision` (the engine's dtype; the logits' own when None) at
    native's largest |logit|, a bound no kernel sets for itself."""
    import torch
    steps = []
    for i, (a, b) in enumerate(zip(native, external)):
        tolerance = tie_steps * logit_step(precision or a.dtype, float(a.abs().max()))
        a, b = a.double(), b.to(a.device).double()  # a kernel host's logits come as host copies
        la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        top2 = a.topk(min(2, a.numel())).values
        steps.append(ForcedStep(i, float((a - b).abs().max()), float((la.exp() * (la - lb)).sum()),
                                bool(a.argmax() == b.argmax()), float(top2[0] - top2[-1]),
                                tolerance))
    worst = lambda figures: float(torch.tensor(figures).max()) if steps else 0.0  # noqa: E731
    return TeacherForced(tuple(steps), worst([s.max_abs_logit_diff for s in steps]),
                         worst([s.kl for s in steps]),
                         sum(s.top1_agree for s in steps) / len(steps) if steps else 1.0,
                         tie_steps, all(s.max_abs_logit_diff <= s.tolerance  # type: ignore[operator]
                                        for s in steps))


def _divergence(tf: TeacherForced, step: int) -> Divergence:
    """Where the greedy tokens first differ, teacher-forced: a near tie when native's top-2 margin
    and the arms' |Δlogit| there are both within the step's tolerance (rounding flipped a
    coin-toss token); accepted when, besides, every step stays within its tolerance and every
    other top-1 disagreement is a tie too."""
    s = tf.steps[step]
    tie = s.tie
    accepted = tie and tf.within_tolerance and all(x.top1_agree or x.tie for x in tf.steps)
    return Divergence(step, s.native_top2_margin, s.max_abs_logit_diff, s.tolerance, tie, accepted)


def compare_decoder(native: list[list[int]], external: list[list[int]], prompts: list[str],
                    forced: list[tuple[list, list]] | None = None,
                    seconds: list[float] | None = None, *, tie_steps: int) -> Comparison:
    """One case per prompt: the greedy tokens must be identical, or differ first at a near tie
    that the teacher-forced run (`forced`: per prompt, both arms' logits and optionally the
    engine's precision) accepts (`_divergence`); the first mismatch is reported with the
    teacher-forced figures."""
    if not (len(native) == len(external) == len(prompts)):
        raise ValueError("native, external and prompts must have the same length")
    cases = []
    for i, (prompt, a, b) in enumerate(zip(prompts, native, external)):
        a, b = [int(t) for t in a], [int(t) for t in b]
        mismatch = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                        None if len(a) == len(b) else min(len(a), len(b)))
        detail = "" if mismatch is None else f"first mismatch at generated token {mismatch}"
        tf = teacher_forced(*forced[i], tie_steps=tie_steps) if forced else None
        passed = mismatch is None
        if tf is not None and mismatch is not None and mismatch < len(tf.steps):
            d = _divergence(tf, mismatch)
            tf = dataclasses.replace(tf, divergence=d)
            passed = d.accepted
            detail += (f"; native's top-2 margin there {d.native_top2_margin:.4g}, |Δlogit| "
                       f"{d.max_abs_logit_diff:.4g}, tolerance {d.tolerance:.4g} "
                       f"({tie_steps} rounding steps): " + (
                           "a near tie, and every teacher-forced step is within tolerance: "
                           "accepted" if passed else
                           "a near tie, but the teacher-forced logits leave the tolerance "
                           f"(max |Δlogit| {tf.max_abs_logit_diff:.4g})" if d.near_tie else
                           "not a tie, the kernel changes the logits there"))
        cases.append(DecoderCase(i, prompt, passed, tuple(a), tuple(b), detail,
                                 seconds[i] if seconds else 0.0, tf))
    return Comparison("decoder", DecoderThresholds(tie_steps), tuple(cases))


def with_items(workload, items: tuple[str, ...]):
    """`workload` with `items` (texts or prompts: the field its spec block gives) after its own."""
    return dataclasses.replace(workload, **{workload.field: (*getattr(workload, workload.field),
                                                             *items)})


def run_replay(pipeline, replayed: dict):
    """`pipeline` run on what a workload's `replay` gave: an encoder on its inputs, a decoder
    teacher-forced on its prompt and tokens."""
    if "inputs" in replayed:
        return pipeline.encoder(**replayed["inputs"])
    return pipeline.teacher_forced_logits(list(replayed["prompt_ids"]), list(replayed["token_ids"]))


# -- workloads -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EncoderWorkload:
    """An encoder gated on texts: a run is the network on one text (tokenized and padded to the
    bundle's sequence length); outputs compare by hidden state."""
    texts: tuple[str, ...]
    field: ClassVar[str] = "texts"   # the key of the spec's gates block it is made from
    unit: ClassVar[str] = "texts"    # what the perf gate's throughput counts

    case_type: ClassVar[type[EncoderCase]] = EncoderCase  # a report's cases of this kind
    thresholds_type: ClassVar[type[EncoderThresholds]] = EncoderThresholds

    @classmethod
    def of(cls, settings) -> EncoderWorkload | None:
        """From the gates' settings (GateSettings); None when they give no texts."""
        return cls(tuple(settings.texts)) if settings.texts else None

    @property
    def items(self) -> list[str]:
        return list(self.texts)

    @property
    def per_call(self) -> int:
        """Units (texts) one timed run processes."""
        return len(self.texts)

    def end_to_end(self, native, external) -> Callable[[str], tuple]:
        """-> one(text): (native hidden, external hidden, attention mask); copies, since a
        program's output may be a buffer the next call rewrites. `one` keeps native's side per
        text, so a later call on the same text (the bisection) runs only the external."""
        io, tok = native.family.io, native.bundle.tokenizer()
        memo: dict = {}

        def one(text: str):
            if text not in memo:
                x = native.encode_text(tok, text)
                memo[text] = x, native.encoder(**x)[io.hidden].clone()
            x, hidden = memo[text]
            return hidden, external.encoder(**x)[io.hidden].clone(), x[io.attention_mask]
        return one

    def replay(self, native, item: str) -> dict:
        """What `run_replay` runs a pipeline on for `item`: the network's inputs, tokenized once,
        so two pipelines (or two processes) see the same inputs (the per-instance drift)."""
        return {"inputs": native.encode_text(native.bundle.tokenizer(), item)}

    def compare(self, results: list[tuple], seconds: list[float], settings) -> Comparison:
        """The end-to-end comparison of `end_to_end`'s results (settings: CorrectnessSettings)."""
        a, b, masks = zip(*results)
        return compare_encoder(list(a), list(b), self.items, list(masks), seconds,
                               max_abs_diff=settings.max_abs_diff, min_cosine=settings.min_cosine)

    def timed(self, native, external) -> tuple[Callable[[], object], Callable[[], object]]:
        """(run native, run external) for the perf trials: the networks on texts tokenized once
        (tokenizing is not the kernel's cost); each call returns its own results (a graphed
        encoder copies its outputs out of the graph)."""
        tok, hidden = native.bundle.tokenizer(), native.family.io.hidden
        inputs = [native.encode_text(tok, t) for t in self.texts]
        return (lambda: [native.encoder(**x)[hidden] for x in inputs],
                lambda: [external.encoder(**x)[hidden] for x in inputs])

    def reference(self, native, external, settings) -> float:
        """What each perf trial's outputs are held to (settings: CorrectnessSettings): hidden
        states within `max_abs_diff` of native's."""
        return settings.max_abs_diff

    @staticmethod
    def timed_outputs(native, external, max_abs_diff: float) -> dict:
        """One trial's hidden states: within `max_abs_diff` and finite."""
        diffs = [float((x.double() - y.double()).abs().max()) for x, y in zip(native, external)]
        worst = max(diffs) if all(math.isfinite(d) for d in diffs) else float("inf")
        ok = worst <= max_abs_diff
        return {"passed": ok, "max_abs_diff": worst,
                "detail": f"hidden-state max |diff| {worst:.4g} {'<=' if ok else '>'} {max_abs_diff}"}

    # -- the kind's other decisions (see the module's docstring) --
    @staticmethod
    def check_generates(refusal: str) -> None:
        """Generation needs a decoder: a UserError saying `refusal`."""
        raise UserError(refusal)

    @staticmethod
    def check_embeds(refusal: str) -> None:
        """An encoder embeds: nothing refused."""

    @staticmethod
    def thresholds(settings) -> EncoderThresholds:
        """The thresholds a correctness report of this kind records, from the gate's settings
        (CorrectnessSettings)."""
        return EncoderThresholds(settings.max_abs_diff, settings.min_cosine)

    @staticmethod
    def unfounded_passes(cases: Sequence[Case], thresholds: Thresholds) -> list[str]:
        """Each passing case its own figures put outside `thresholds` (a report's, re-derived)."""
        (t,) = _only(EncoderThresholds, [thresholds])
        problems = []
        for case in _only(EncoderCase, cases):
            if case.passed:
                ok, worst, cosine = encoder_case_passes(case, t.max_abs_diff, t.min_cosine)
                if not ok:
                    problems.append(f"case {case.index} passes at max |diff| {worst:.4g}, "
                                    f"cosine {cosine:.6f}")
        return problems

    @staticmethod
    def ledger_figures(cases: Sequence[Case]) -> dict[str, Any]:
        """The cases' figures a ledger line keeps: the largest max |diff|, the lowest cosine over
        the real tokens."""
        ours = _only(EncoderCase, cases)
        return {"max_abs_diff": max((c.max_abs_diff for c in ours if c.max_abs_diff is not None),
                                    default=None),
                "min_real_cosine": min((c.real_cosine for c in ours if c.real_cosine is not None),
                                       default=None)}

    @staticmethod
    def markdown(thresholds: Thresholds, cases: Sequence[Case], fmt: Fmt) -> list[str]:
        """A correctness report's end-to-end section, under its heading: the thresholds and one
        table row per case (`fmt`: the report's figure format)."""
        (t,) = _only(EncoderThresholds, [thresholds])
        lines = [f"Thresholds, over all rows and over the real (unpadded) tokens: max |diff| <= "
                 f"{t.max_abs_diff}, cosine >= {t.min_cosine}", "",
                 "| # | input | max abs diff | cosine | real tokens | real max abs diff | real cosine | result |",
                 "| - | - | - | - | - | - | - | - |"]
        lines += [f"| {c.index} | {c.input[:40]} | {fmt(c.max_abs_diff)} | "
                  f"{fmt(c.cosine)} | {c.real_tokens} | {fmt(c.real_max_abs_diff)} | "
                  f"{fmt(c.real_cosine)} | {'pass' if c.passed else 'FAIL ' + c.detail} |"
                  for c in _only(EncoderCase, cases)]
        return lines

    @staticmethod
    def junit_text(case: Case, thresholds: Thresholds, fmt: Fmt) -> str:
        """A case's figures, the text of its JUnit failure."""
        (c,) = _only(EncoderCase, [case])
        return (f"max |diff| {fmt(c.max_abs_diff)} (real tokens {fmt(c.real_max_abs_diff)}), "
                f"cosine {fmt(c.cosine)} (real tokens {fmt(c.real_cosine)}); thresholds "
                f"{thresholds.to_json()}")

    @staticmethod
    def generated_tokens(max_new_tokens: int) -> int | None:
        """The new tokens per item a verdict's evidence counts: none for an encoder."""
        return None


@dataclass(frozen=True)
class DecoderWorkload:
    """A decoder gated on prompts: a run is greedy generation of `max_new_tokens`, beside a
    teacher-forced run of both arms on native's tokens; outputs compare by tokens."""
    prompts: tuple[str, ...]
    max_new_tokens: int
    field: ClassVar[str] = "prompts"
    unit: ClassVar[str] = "tokens"

    case_type: ClassVar[type[DecoderCase]] = DecoderCase  # a report's cases of this kind
    thresholds_type: ClassVar[type[DecoderThresholds]] = DecoderThresholds

    @classmethod
    def of(cls, settings) -> DecoderWorkload | None:
        """From the gates' settings (GateSettings); None when they give no prompts."""
        return cls(tuple(settings.prompts), settings.max_new_tokens) if settings.prompts else None

    @property
    def items(self) -> list[str]:
        return list(self.prompts)

    @property
    def per_call(self) -> int:
        """Units (generated tokens) one timed run produces."""
        return len(self.prompts) * self.max_new_tokens

    def end_to_end(self, native, external) -> Callable[[str], tuple]:
        """-> one(prompt): (native tokens, external tokens, (native, external teacher-forced
        logits, the engine's precision)): both arms fed the prompt and native's tokens but the
        last. `one` keeps native's side per prompt, so a later call on the same prompt (the
        bisection) runs only the external."""
        memo: dict = {}

        def one(prompt: str):
            if prompt not in memo:
                (n,) = native.generate([prompt], self.max_new_tokens)
                memo[prompt] = n, native.teacher_forced_logits(n["prompt_ids"], n["token_ids"][:-1])
            n, forced = memo[prompt]
            (e,) = external.generate([prompt], self.max_new_tokens)
            return (n["token_ids"], e["token_ids"],
                    (forced, external.teacher_forced_logits(n["prompt_ids"], n["token_ids"][:-1]),
                     native.precision))
        return one

    def replay(self, native, item: str) -> dict:
        """What `run_replay` runs a pipeline on for `item`: teacher forcing on the prompt and the
        tokens `native` generates for it, so two pipelines (or two processes) see the same
        sequence (the per-instance drift)."""
        (n,) = native.generate([item], self.max_new_tokens)
        return {"prompt_ids": n["prompt_ids"], "token_ids": n["token_ids"][:-1]}

    def compare(self, results: list[tuple], seconds: list[float], settings) -> Comparison:
        """The end-to-end comparison of `end_to_end`'s results (exact tokens: no thresholds)."""
        a, b, forced = zip(*results)
        return compare_decoder(list(a), list(b), self.items, list(forced), seconds,
                               tie_steps=settings.tie_steps)

    def timed(self, native, external) -> tuple[Callable[[], object], Callable[[], object]]:
        """(run native, run external) for the perf trials: generation of every prompt."""
        return (lambda: native.generate(self.items, self.max_new_tokens),
                lambda: external.generate(self.items, self.max_new_tokens))

    def reference(self, native, external, settings) -> dict:
        """What each perf trial's outputs are held to: both arms' tokens from one untimed run,
        judged as the correctness gate judges them (identical, or parted at an accepted near tie;
        settings: CorrectnessSettings). Every trial must give these tokens again, so a kernel
        cannot act otherwise while it is timed."""
        one = self.end_to_end(native, external)
        results = [one(prompt) for prompt in self.items]
        judged = _only(DecoderCase, self.compare(results, [0.0] * len(results), settings).cases)
        failed = [c for c in judged if not c.passed]
        same = all(c.native_tokens == c.external_tokens for c in judged)
        return {"native": [list(c.native_tokens) for c in judged],
                "external": [list(c.external_tokens) for c in judged], "passed": not failed,
                "detail": f"prompt {failed[0].index}: {failed[0].detail}" if failed else
                "greedy tokens identical" if same else
                "greedy tokens identical but where they part at an accepted near tie"}

    @staticmethod
    def timed_outputs(native, external, reference: dict) -> dict:
        """One trial's greedy tokens: those of `reference` (`DecoderWorkload.reference`), and
        that reference passed."""
        tokens = lambda results: [[int(t) for t in r["token_ids"]] for r in results]  # noqa: E731
        again = tokens(native) == reference["native"] and tokens(external) == reference["external"]
        detail = (reference["detail"] if again else
                  "greedy tokens differ from those of the untimed run the trials are held to")
        return {"passed": again and reference["passed"], "max_abs_diff": None, "detail": detail}

    # -- the kind's other decisions (see the module's docstring) --
    @staticmethod
    def check_generates(refusal: str) -> None:
        """A decoder generates: nothing refused."""

    @staticmethod
    def check_embeds(refusal: str) -> None:
        """Embedding needs an encoder: a UserError saying `refusal`."""
        raise UserError(refusal)

    @staticmethod
    def thresholds(settings) -> DecoderThresholds:
        """The thresholds a correctness report of this kind records, from the gate's settings
        (CorrectnessSettings)."""
        return DecoderThresholds(settings.tie_steps)

    @staticmethod
    def unfounded_passes(cases: Sequence[Case], thresholds: Thresholds) -> list[str]:
        """None: a decoder's case passes by its tokens and teacher-forced steps, no threshold of
        the report's own is re-derived per case."""
        return []

    @staticmethod
    def ledger_figures(cases: Sequence[Case]) -> dict[str, Any]:
        """The cases' figures a ledger line keeps: the teacher-forced runs' largest |Δlogit| and
        KL."""
        tf = [c.teacher_forced for c in _only(DecoderCase, cases) if c.teacher_forced]
        return {"max_abs_logit_diff": max((t.max_abs_logit_diff for t in tf),  # type: ignore[type-var]
                                          default=None),
                "max_kl": max((t.max_kl for t in tf), default=None)}  # type: ignore[type-var]

    @staticmethod
    def markdown(thresholds: Thresholds, cases: Sequence[Case], fmt: Fmt) -> list[str]:
        """A correctness report's end-to-end section, under its heading: the rule and one table
        row per case (`fmt`: the report's figure format)."""
        (t,) = _only(DecoderThresholds, [thresholds])
        lines = [f"Greedy tokens must be identical, or part at a near tie: native's top two logits "
                 f"and both arms' logits at every teacher-forced step (both fed native's tokens) "
                 f"within {t.tie_steps} rounding steps of the "
                 f"logits' dtype.", "",
                 "| # | prompt | tokens | max abs Δlogit | max KL | top-1 agreement | result |",
                 "| - | - | - | - | - | - | - |"]
        for c in _only(DecoderCase, cases):
            tf = c.teacher_forced
            agree = None if tf is None else tf.top1_agreement
            lines.append(f"| {c.index} | {c.input[:40]} | {len(c.native_tokens)} | "
                         f"{fmt(None if tf is None else tf.max_abs_logit_diff)} | "
                         f"{fmt(None if tf is None else tf.max_kl)} | "
                         f"{'n/a' if agree is None else f'{agree:.0%}'} | "
                         f"{'pass' if c.passed else 'FAIL ' + c.detail} |")
        return lines

    @staticmethod
    def junit_text(case: Case, thresholds: Thresholds, fmt: Fmt) -> str:
        """A case's tokens and teacher-forced figures, the text of its JUnit failure."""
        (c,) = _only(DecoderCase, [case])
        tf = c.teacher_forced
        return (f"native {list(c.native_tokens)}\nexternal {list(c.external_tokens)}\n"
                f"teacher-forced: max |Δlogit| {fmt(None if tf is None else tf.max_abs_logit_diff)}, "
                f"max KL {fmt(None if tf is None else tf.max_kl)}, "
                f"top-1 agreement {fmt(None if tf is None else tf.top1_agreement)}")

    @staticmethod
    def generated_tokens(max_new_tokens: int) -> int | None:
        """The new tokens per item a verdict's evidence counts: the gate's max_new_tokens."""
        return max_new_tokens


Workload = EncoderWorkload | DecoderWorkload
WorkloadKind = type[EncoderWorkload] | type[DecoderWorkload]
KINDS: dict[str, WorkloadKind] = {"encoder": EncoderWorkload, "decoder": DecoderWorkload}


def of_kind(kind: str) -> WorkloadKind:
    """The workload class of a kind's name (a family's `kind`, a correctness report's): the one
    place a kind's name is looked up."""
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"kind {kind!r}: expected one of {', '.join(KINDS)}") from None
