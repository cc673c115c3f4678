"""Correctness gate: compare native and external outputs end to end (after the region probe).

Encoders: max |diff| and cosine over each text's full hidden state. Decoders: exact equality of the
greedy tokens per prompt. Pure functions over tensors/token lists, so they test without models.
"""
from __future__ import annotations

import torch

from pipeline.gates import CORRECTNESS_DEFAULTS

PROBE_KEYS = ("max_abs_diff", "tolerance", "passed")


def compare_encoder(native: list[torch.Tensor], external: list[torch.Tensor], texts: list[str], *,
                    max_abs_diff: float = CORRECTNESS_DEFAULTS["max_abs_diff"],
                    min_cosine: float = CORRECTNESS_DEFAULTS["min_cosine"]) -> dict:
    """One case per text: max |native - external| and cosine of the flattened hidden states."""
    if not (len(native) == len(external) == len(texts)):
        raise ValueError("native, external and texts must have the same length")
    cases = []
    for i, (text, a, b) in enumerate(zip(texts, native, external)):
        if a.shape != b.shape:
            cases.append({"index": i, "input": text, "passed": False, "max_abs_diff": None,
                          "cosine": None, "detail": f"shape {list(b.shape)} != native {list(a.shape)}"})
            continue
        a64, b64 = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
        finite = bool(torch.isfinite(b64).all())
        diff = float((a64 - b64).abs().max()) if a64.numel() else 0.0
        cos = float(torch.nn.functional.cosine_similarity(a64, b64, dim=0, eps=1e-30))
        ok = finite and diff <= max_abs_diff and cos >= min_cosine
        detail = "" if finite else "external output has non-finite values"
        cases.append({"index": i, "input": text, "passed": ok, "max_abs_diff": diff if finite else None,
                      "cosine": cos if finite else None, "detail": detail})
    return {"kind": "encoder", "thresholds": {"max_abs_diff": max_abs_diff, "min_cosine": min_cosine},
            "cases": cases}


def compare_decoder(native: list[list[int]], external: list[list[int]], prompts: list[str]) -> dict:
    """One case per prompt: greedy tokens must be identical; the first mismatch is reported."""
    if not (len(native) == len(external) == len(prompts)):
        raise ValueError("native, external and prompts must have the same length")
    cases = []
    for i, (prompt, a, b) in enumerate(zip(prompts, native, external)):
        a, b = [int(t) for t in a], [int(t) for t in b]
        mismatch = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                        None if len(a) == len(b) else min(len(a), len(b)))
        detail = "" if mismatch is None else f"first mismatch at generated token {mismatch}"
        cases.append({"index": i, "input": prompt, "passed": mismatch is None,
                      "native_tokens": a, "external_tokens": b, "detail": detail})
    return {"kind": "decoder", "thresholds": {}, "cases": cases}


def correctness_report(name: str, comparison: dict, probe: dict | None) -> dict:
    """The gate report: passes only when the region probe and every case pass."""
    probe = None if probe is None else {k: probe[k] for k in PROBE_KEYS}
    failed = [c["index"] for c in comparison["cases"] if not c["passed"]]
    probe_ok = probe is None or bool(probe["passed"])
    passed = probe_ok and not failed and bool(comparison["cases"])
    parts = []
    if not probe_ok:
        parts.append(f"region probe failed (max |diff| {probe['max_abs_diff']:.3g} > "
                     f"tolerance {probe['tolerance']:.3g})")
    if failed:
        parts.append(f"{len(failed)} of {len(comparison['cases'])} cases differ (indices {failed})")
    message = "; ".join(parts) or f"all {len(comparison['cases'])} cases match"
    return {"schema_version": 1, "gate": "correctness", "name": name, "passed": passed,
            "verdict": "pass" if passed else "fail", "message": message, "probe": probe,
            **comparison}


def run_correctness_gate(name: str, native, external, items: list[str], *, max_new_tokens: int,
                         max_abs_diff: float, min_cosine: float, probe_seed: int) -> dict:
    """The whole gate on two open pipelines: the region probe of `external`, then native vs
    external end to end (encoders on `items` as texts, decoders as prompts)."""
    from pipeline.gates.probe import region_probe
    probe = region_probe(external, seed=probe_seed)
    probe_summary = {"max_abs_diff": max((s["max_abs_diff"] for s in probe["slots"]), default=0.0),
                     "tolerance": min((s["tolerance"] for s in probe["slots"]), default=0.0),
                     "passed": probe["passed"]}
    if native.kind == "encoder":
        comparison = compare_encoder(native.embed(items), external.embed(items), items,
                                     max_abs_diff=max_abs_diff, min_cosine=min_cosine)
    else:
        tokens = [[r["token_ids"] for r in pipe.generate(items, max_new_tokens)]
                  for pipe in (native, external)]
        comparison = compare_decoder(*tokens, items)
    return correctness_report(name, comparison, probe_summary)
