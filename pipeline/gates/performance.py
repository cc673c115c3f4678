"""Perf gate: native and external timed in one process, alternating, every trial kept.

Each trial times both sides back to back; the side that goes first alternates between trials so a
slow drift (thermal, other load) does not favour one of them. The ratio of a trial is
external throughput / native throughput (= native time / external time).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from pipeline.gates import PERF_DEFAULTS, stats

REPEAT_ADVICE = ("repeat on an idle machine (nothing else running, fixed clocks) or with more "
                 "trials")


def _timer(device) -> tuple[str, Callable[[Callable[[], object], Callable[[], object] | None], float]]:
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


def measure_alternating(run_native: Callable[[], object], run_external: Callable[[], object],
                        trials: int, warmup: int, sync: Callable[[], object] | None = None, *,
                        device=None, items: int = 1) -> dict:
    """Warm both up, then `trials` alternating timed pairs. `items` = work units per call."""
    if trials < 1 or warmup < 0 or items < 1:
        raise ValueError("trials >= 1, warmup >= 0 and items >= 1 are required")
    timer_name, time_one = _timer(device)
    for _ in range(warmup):
        run_native()
        run_external()
    if sync is not None:
        sync()
    records = []
    for i in range(trials):
        order = ("native", "external") if i % 2 == 0 else ("external", "native")
        seconds = {}
        for side in order:
            seconds[side] = time_one(run_native if side == "native" else run_external, sync)
        records.append({"trial": i, "first": order[0], "native_s": seconds["native"],
                        "external_s": seconds["external"],
                        "native_throughput": items / seconds["native"],
                        "external_throughput": items / seconds["external"],
                        "ratio": seconds["native"] / seconds["external"]})
    return {"timer": timer_name, "items_per_call": items, "warmup": warmup, "trials": records}


def perf_report(name: str, measurement: dict, *, threshold: float = PERF_DEFAULTS["threshold"],
                seed: int = PERF_DEFAULTS["seed"], resamples: int = PERF_DEFAULTS["resamples"],
                confidence: float = PERF_DEFAULTS["confidence"], unit: str = "items") -> dict:
    """Median ratio, its seeded bootstrap interval and the verdict, with every trial."""
    trials = measurement["trials"]
    ratios = [t["ratio"] for t in trials]
    lo, hi = stats.bootstrap_median_ci(ratios, seed=seed, resamples=resamples, confidence=confidence)
    verdict = stats.verdict((lo, hi), threshold)
    median = float(np.median(ratios))
    message = {stats.PASS: f"median external/native throughput {median:.3f}, "
                           f"{confidence:.0%} interval [{lo:.3f}, {hi:.3f}] >= {threshold}",
               stats.FAIL: f"median external/native throughput {median:.3f}, "
                           f"{confidence:.0%} interval [{lo:.3f}, {hi:.3f}] < {threshold}",
               stats.INCONCLUSIVE: f"the {confidence:.0%} interval straddles the threshold; {REPEAT_ADVICE} (median {median:.3f}, interval "
                                   f"[{lo:.3f}, {hi:.3f}], threshold {threshold})"}[verdict]
    return {"schema_version": 1, "gate": "perf", "name": name, "passed": verdict == stats.PASS,
            "verdict": verdict, "message": message,
            "settings": {"threshold": threshold, "seed": seed, "resamples": resamples,
                         "confidence": confidence, "timer": measurement["timer"],
                         "warmup": measurement["warmup"], "trials": len(trials),
                         "items_per_call": measurement["items_per_call"], "unit": unit},
            "summary": {"median_ratio": median, "ci_low": lo, "ci_high": hi,
                        "native_median_throughput": float(np.median([t["native_throughput"] for t in trials])),
                        "external_median_throughput": float(np.median([t["external_throughput"] for t in trials]))},
            "trials": trials}


def run_perf_gate(name: str, native, external, items: list[str], *, max_new_tokens: int,
                  trials: int, warmup: int, threshold: float, seed: int, resamples: int,
                  confidence: float) -> dict:
    """The whole gate on two open pipelines: encoders time their networks on pre-tokenized texts
    (tokenizing is not the kernel's cost), decoders time generation of `max_new_tokens`."""
    import torch
    if native.kind == "encoder":
        tok = native.bundle.tokenizer()
        inputs = [native.encode_text(tok, t) for t in items]
        run_native = lambda: [native.encoder(**x) for x in inputs]  # noqa: E731
        run_external = lambda: [external.encoder(**x) for x in inputs]  # noqa: E731
        count, unit = len(items), "texts"
    else:
        run_native = lambda: native.generate(items, max_new_tokens)  # noqa: E731
        run_external = lambda: external.generate(items, max_new_tokens)  # noqa: E731
        count, unit = len(items) * max_new_tokens, "tokens"
    cuda = native.device.type == "cuda"
    with torch.inference_mode():
        m = measure_alternating(run_native, run_external, trials, warmup,
                                sync=torch.cuda.synchronize if cuda else None,
                                device=native.device if cuda else None, items=count)
    return perf_report(name, m, threshold=threshold, seed=seed, resamples=resamples,
                       confidence=confidence, unit=unit)
