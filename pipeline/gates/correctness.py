"""Correctness gate: native vs external end to end with every slot call shadowed, then the
region probe.

Encoders: max |diff| and cosine of each text's hidden state, over the full [S, H] tensor and over
its real (unpadded) tokens only, since padding rows can hide a wrong kernel in a full-tensor
cosine; both must pass. Decoders: the greedy tokens must be identical; beside them a
teacher-forced run feeds both arms native's tokens and compares every step (max |Δlogit|,
KL(native||external), top-1 agreement), and where the greedy tokens diverge native's top-2 logit
margin there tells a near tie from a wrong kernel. The comparisons are pure functions over
tensors and token lists, so they test without models.
"""
from __future__ import annotations

import time

import torch

from pipeline.gates import CORRECTNESS_DEFAULTS
from pipeline.gates.reports import REPORT_VERSION, describe



def _figures(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a64, b64 = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
    diff = float((a64 - b64).abs().max()) if a64.numel() else 0.0
    return diff, float(torch.nn.functional.cosine_similarity(a64, b64, dim=0, eps=1e-30))


def compare_encoder(native: list[torch.Tensor], external: list[torch.Tensor], texts: list[str],
                    masks: list[torch.Tensor] | None = None, seconds: list[float] | None = None, *,
                    max_abs_diff: float = CORRECTNESS_DEFAULTS["max_abs_diff"],
                    min_cosine: float = CORRECTNESS_DEFAULTS["min_cosine"]) -> dict:
    """One case per text: max |native - external| and cosine of the hidden states, over all rows
    and over the rows `masks` marks as real tokens (all rows without masks)."""
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


def teacher_forced(native: list[torch.Tensor], external: list[torch.Tensor]) -> dict:
    """Per step of one teacher-forced sequence (FP32 logits [vocab] of both arms): max |Δlogit|,
    KL(native||external), top-1 agreement and native's top-2 margin."""
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


def correctness_report(name: str, comparison: dict, probe: dict | None,
                       kernels: list[dict] = (), shadow: dict | None = None) -> dict:
    """The gate report: passes only when every shadowed slot call, the region probe and every
    case pass. `kernels`: what was tested (probe.tested_kernels); `shadow`: shadow.summary."""
    failed = [c["index"] for c in comparison["cases"] if not c["passed"]]
    probe_ok = probe is None or bool(probe["passed"])
    shadow_ok = shadow is None or bool(shadow["passed"])
    passed = probe_ok and shadow_ok and not failed and bool(comparison["cases"])
    parts = []
    if not shadow_ok:
        first = shadow["first_failure"]
        parts.append(f"shadow execution: {shadow['calls_failed']} of {shadow['calls_checked']} "
                     f"slot calls differ from the native region"
                     + (f"; first: {describe(first)}" if first else " (no call was made)"))
    if not probe_ok:
        parts.append("region probe failed: " + "; ".join(
            f"{s['binding_id']} {', '.join(s['failed_checks'])}" for s in probe["slots"]
            if s["failed_checks"]))
    if failed:
        parts.append(f"{len(failed)} of {len(comparison['cases'])} cases differ (indices {failed})")
    checked = f", {shadow['calls_checked']} slot calls checked" if shadow else ""
    message = "; ".join(parts) or f"all {len(comparison['cases'])} cases match{checked}"
    return {"schema_version": REPORT_VERSION, "gate": "correctness", "name": name,
            "passed": passed, "verdict": "pass" if passed else "fail", "message": message,
            "kernels": list(kernels), "shadow": shadow, "probe": probe, **comparison}


def run_correctness_gate(name: str, native, external, items: list[str], *, max_new_tokens: int,
                         max_abs_diff: float, min_cosine: float, probe_seed: int | None) -> dict:
    """The whole gate on two open pipelines: native vs external end to end, item by item
    (encoders: `items` are texts, decoders: prompts), every slot call of `external` checked by
    shadow execution; then the region probe of `external` over the shape space and the dims the
    end-to-end runs met. `probe_seed` None: drawn."""
    from pipeline import isolation
    from pipeline.gates.probe import (native_seconds, region_probe, require_shadow, seen_dims,
                                      shape_space, tested_kernels)
    from pipeline.runtime.shadow import summary
    require_shadow(external)
    for region in external.regions.values():
        isolation.set_call_limit(native_seconds(region, shape_space(external, region).typical,
                                                external.family.io, external.device))
    if native.kind == "encoder":
        tok = native.bundle.tokenizer()
        one = lambda text: _encode(native, external, tok, text)  # noqa: E731
    else:
        one = lambda prompt: _decode(native, external, prompt, max_new_tokens)  # noqa: E731
    cases, seconds, calls = [], [], []
    for i, item in enumerate(items):
        isolation.beat(f"end-to-end item {i}")
        t0 = time.perf_counter()
        cases.append(one(item))
        seconds.append(time.perf_counter() - t0)
        calls.append(external.shadow.collect())
    seen: dict[str, set[int]] = {}
    for c in (c for item in calls for c in item):
        region = external.regions[c["binding_id"]]
        seen.setdefault(c["binding_id"], set()).update(seen_dims(region, c["input_shapes"]))
    probe = region_probe(external, seed=probe_seed, seen=seen)
    if native.kind == "encoder":
        a, b, masks = zip(*cases)
        comparison = compare_encoder(list(a), list(b), items, list(masks), seconds,
                                     max_abs_diff=max_abs_diff, min_cosine=min_cosine)
    else:
        a, b, forced = zip(*cases)
        comparison = compare_decoder(list(a), list(b), items, list(forced), seconds)
    return correctness_report(name, comparison, probe, tested_kernels(external), summary(calls))


def _encode(native, external, tokenizer, text: str):
    """(native hidden, external hidden, attention mask) of one text; copies, since a program's
    output may be a buffer the next call rewrites."""
    io = native.family.io
    x = native.encode_text(tokenizer, text)
    return (native.encoder(**x)[io.hidden].clone(), external.encoder(**x)[io.hidden].clone(),
            x[io.attention_mask])


def _decode(native, external, prompt: str, max_new_tokens: int):
    """(native tokens, external tokens, (native, external) teacher-forced logits) of one prompt:
    both arms fed the prompt and native's tokens but the last."""
    from pipeline.runtime.generate import teacher_forced_logits
    (n,), (e,) = native.generate([prompt], max_new_tokens), external.generate([prompt], max_new_tokens)
    forced = tuple(teacher_forced_logits(p, n["prompt_ids"], n["token_ids"][:-1])
                   for p in (native, external))
    return n["token_ids"], e["token_ids"], forced
