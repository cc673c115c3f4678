"""What the gates run on a model, per model kind: each family declares its workload (`Family.
workload`), and the gates and stages ask it instead of telling encoders from decoders.

A workload carries what differs between the kinds: which inputs the spec's `gates` block gives
(texts, or prompts and max_new_tokens), how one end-to-end run is made on an open pipeline, and
how two arms' outputs compare.

* Encoders: per text, max |diff| and cosine of the hidden state over the full [S, H] tensor and
  over its real (unpadded) tokens only, since padding rows can hide a wrong kernel in a
  full-tensor cosine; both must pass. The perf trials time the networks on texts tokenized once.
* Decoders: the greedy tokens must be identical; beside them a teacher-forced run feeds both arms
  native's tokens and compares every step (max |Δlogit|, KL(native||external), top-1 agreement),
  and where the greedy tokens diverge native's top-2 logit margin there tells a near tie from a
  wrong kernel. The perf trials time generation of max_new_tokens.

The comparisons are pure functions over tensors and token lists, so they test without models.
The runs use a pipeline's public calls only (`encode_text`, `encoder`, `generate`,
`teacher_forced_logits`); torch is imported when a run or a comparison is made.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar


# -- comparisons ----------------------------------------------------------------------------------
def _figures(a, b) -> tuple[float, float]:
    import torch
    a64, b64 = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
    diff = float((a64 - b64).abs().max()) if a64.numel() else 0.0
    return diff, float(torch.nn.functional.cosine_similarity(a64, b64, dim=0, eps=1e-30))


def compare_encoder(native: list, external: list, texts: list[str], masks: list | None = None,
                    seconds: list[float] | None = None, *, max_abs_diff: float,
                    min_cosine: float) -> dict:
    """One case per text: max |native - external| and cosine of the hidden states, over all rows
    and over the rows `masks` marks as real tokens (all rows without masks)."""
    import torch
    if not (len(native) == len(external) == len(texts)):
        raise ValueError("native, external and texts must have the same length")
    cases = []
    for i, (text, a, b) in enumerate(zip(texts, native, external)):
        case = {"index": i, "input": text, "passed": False, "max_abs_diff": None, "cosine": None,
                "real_tokens": None, "real_max_abs_diff": None, "real_cosine": None,
                "seconds": seconds[i] if seconds else 0.0, "detail": ""}
        cases.append(case)
        if a.shape != b.shape:
            case["detail"] = f"shape {list(b.shape)} != native {list(a.shape)}"
            continue
        if not bool(torch.isfinite(b).all()):
            case["detail"] = "external output has non-finite values"
            continue
        real = masks[i].bool().cpu() if masks else torch.ones(a.shape[0], dtype=torch.bool)
        case["max_abs_diff"], case["cosine"] = _figures(a, b)
        case["real_max_abs_diff"], case["real_cosine"] = _figures(a.cpu()[real], b.cpu()[real])
        case["real_tokens"] = int(real.sum())
        worst = max(case["max_abs_diff"], case["real_max_abs_diff"])
        cos = min(case["cosine"], case["real_cosine"])
        case["passed"] = worst <= max_abs_diff and cos >= min_cosine
        if not case["passed"]:
            case["detail"] = (f"max |diff| {worst:.4g} (limit {max_abs_diff}), cosine {cos:.6f} "
                              f"(limit {min_cosine}) over all rows / the {case['real_tokens']} "
                              f"real tokens")
    return {"kind": "encoder", "thresholds": {"max_abs_diff": max_abs_diff, "min_cosine": min_cosine},
            "cases": cases}


def teacher_forced(native: list, external: list) -> dict:
    """Per step of one teacher-forced sequence (FP32 logits [vocab] of both arms): max |Δlogit|,
    KL(native||external), top-1 agreement and native's top-2 margin."""
    import torch
    steps = []
    for i, (a, b) in enumerate(zip(native, external)):
        a, b = a.double(), b.double()
        la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        top2 = a.topk(min(2, a.numel())).values
        steps.append({"step": i, "max_abs_logit_diff": float((a - b).abs().max()),
                      "kl": float((la.exp() * (la - lb)).sum()),
                      "top1_agree": bool(a.argmax() == b.argmax()),
                      "native_top2_margin": float(top2[0] - top2[-1])})
    worst = lambda key: float(torch.tensor([s[key] for s in steps]).max()) if steps else 0.0  # noqa: E731
    return {"steps": steps, "max_abs_logit_diff": worst("max_abs_logit_diff"), "max_kl": worst("kl"),
            "top1_agreement": sum(s["top1_agree"] for s in steps) / len(steps) if steps else 1.0}


def _divergence(steps: list[dict], step: int) -> dict:
    """A near tie: at the diverging step the kernel's logit error is no larger than its ordinary
    error (2x the max |Δlogit| over the steps where both arms agree on the top token) and native's
    top-2 margin lies within it, so rounding-level differences flipped a coin-toss token."""
    s = steps[step]
    ordinary = max((x["max_abs_logit_diff"] for x in steps if x["top1_agree"]), default=0.0)
    tie = max(s["max_abs_logit_diff"], s["native_top2_margin"]) <= 2 * ordinary
    return {"step": step, "native_top2_margin": s["native_top2_margin"],
            "max_abs_logit_diff": s["max_abs_logit_diff"], "ordinary_logit_error": ordinary,
            "near_tie": tie}


def compare_decoder(native: list[list[int]], external: list[list[int]], prompts: list[str],
                    forced: list[tuple[list, list]] | None = None,
                    seconds: list[float] | None = None) -> dict:
    """One case per prompt: greedy tokens must be identical; the first mismatch is reported, with
    the teacher-forced figures (`forced`: per prompt, both arms' logits) when given."""
    if not (len(native) == len(external) == len(prompts)):
        raise ValueError("native, external and prompts must have the same length")
    cases = []
    for i, (prompt, a, b) in enumerate(zip(prompts, native, external)):
        a, b = [int(t) for t in a], [int(t) for t in b]
        mismatch = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                        None if len(a) == len(b) else min(len(a), len(b)))
        detail = "" if mismatch is None else f"first mismatch at generated token {mismatch}"
        tf = teacher_forced(*forced[i]) if forced else None
        if tf is not None:
            tf["divergence"] = None
            if mismatch is not None and mismatch < len(tf["steps"]):
                tf["divergence"] = _divergence(tf["steps"], mismatch)
                d = tf["divergence"]
                detail += (f"; native's top-2 margin there {d['native_top2_margin']:.4g}, |Δlogit| "
                           f"{d['max_abs_logit_diff']:.4g} (elsewhere at most "
                           f"{d['ordinary_logit_error']:.4g}): " + (
                               "a near tie" if d["near_tie"] else "not a tie, the kernel changes "
                                                                  "the logits there"))
        cases.append({"index": i, "input": prompt, "passed": mismatch is None,
                      "native_tokens": a, "external_tokens": b, "detail": detail,
                      "seconds": seconds[i] if seconds else 0.0, "teacher_forced": tf})
    return {"kind": "decoder", "thresholds": {}, "cases": cases}


# -- workloads -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EncoderWorkload:
    """An encoder gated on texts: a run is the network on one text (tokenized and padded to the
    bundle's sequence length); outputs compare by hidden state."""
    texts: tuple[str, ...]
    field: ClassVar[str] = "texts"   # the key of the spec's gates block it is made from
    unit: ClassVar[str] = "texts"    # what the perf gate's throughput counts

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

    def replay(self, native, item: str) -> Callable[[object], object]:
        """-> run(pipeline): the network on `item`, tokenized once, so two pipelines see the
        same inputs (the per-instance drift)."""
        x = native.encode_text(native.bundle.tokenizer(), item)
        return lambda p: p.encoder(**x)

    def compare(self, results: list[tuple], seconds: list[float], settings) -> dict:
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

    @staticmethod
    def timed_outputs(native, external, max_abs_diff: float) -> dict:
        """The last trial's hidden states: within `max_abs_diff` and finite."""
        diffs = [float((x.double() - y.double()).abs().max()) for x, y in zip(native, external)]
        worst = max(diffs) if all(math.isfinite(d) for d in diffs) else float("inf")
        ok = worst <= max_abs_diff
        return {"passed": ok, "max_abs_diff": worst,
                "detail": f"hidden-state max |diff| {worst:.4g} {'<=' if ok else '>'} {max_abs_diff}"}


@dataclass(frozen=True)
class DecoderWorkload:
    """A decoder gated on prompts: a run is greedy generation of `max_new_tokens`, beside a
    teacher-forced run of both arms on native's tokens; outputs compare by tokens."""
    prompts: tuple[str, ...]
    max_new_tokens: int
    field: ClassVar[str] = "prompts"
    unit: ClassVar[str] = "tokens"

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
        """-> one(prompt): (native tokens, external tokens, (native, external) teacher-forced
        logits): both arms fed the prompt and native's tokens but the last. `one` keeps native's
        side per prompt, so a later call on the same prompt (the bisection) runs only the
        external."""
        memo: dict = {}

        def one(prompt: str):
            if prompt not in memo:
                (n,) = native.generate([prompt], self.max_new_tokens)
                memo[prompt] = n, native.teacher_forced_logits(n["prompt_ids"], n["token_ids"][:-1])
            n, forced = memo[prompt]
            (e,) = external.generate([prompt], self.max_new_tokens)
            return (n["token_ids"], e["token_ids"],
                    (forced, external.teacher_forced_logits(n["prompt_ids"], n["token_ids"][:-1])))
        return one

    def replay(self, native, item: str) -> Callable[[object], object]:
        """-> run(pipeline): teacher forcing on `item` and the tokens `native` generates for it,
        so two pipelines see the same sequence (the per-instance drift)."""
        (n,) = native.generate([item], self.max_new_tokens)
        return lambda p: p.teacher_forced_logits(n["prompt_ids"], n["token_ids"][:-1])

    def compare(self, results: list[tuple], seconds: list[float], settings) -> dict:
        """The end-to-end comparison of `end_to_end`'s results (exact tokens: no thresholds)."""
        a, b, forced = zip(*results)
        return compare_decoder(list(a), list(b), self.items, list(forced), seconds)

    def timed(self, native, external) -> tuple[Callable[[], object], Callable[[], object]]:
        """(run native, run external) for the perf trials: generation of every prompt."""
        return (lambda: native.generate(self.items, self.max_new_tokens),
                lambda: external.generate(self.items, self.max_new_tokens))

    @staticmethod
    def timed_outputs(native, external, max_abs_diff: float) -> dict:
        """The last trial's greedy tokens: identical."""
        a, b = [r["token_ids"] for r in native], [r["token_ids"] for r in external]
        return {"passed": a == b, "max_abs_diff": None,
                "detail": "greedy tokens identical" if a == b else "greedy tokens differ"}


Workload = EncoderWorkload | DecoderWorkload
