"""Statistics of the perf gate: median ratio, a seeded percentile bootstrap, and the verdict.

The bootstrap RNG is seeded, so the same trials always give the same interval and verdict; what
varies between runs is only the measured data.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.gates.settings import PerfSettings
from pipeline.gates.verdict import Verdict


def bootstrap_median_ci(values: Sequence[float], *, seed: int = PerfSettings.seed,
                        resamples: int = PerfSettings.resamples,
                        confidence: float = PerfSettings.confidence) -> tuple[float, float]:
    """Percentile bootstrap interval of the median: resample with replacement, take each median."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError("bootstrap needs a non-empty 1-D sample")
    rng = np.random.default_rng(seed)
    medians = np.median(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(medians, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def verdict(ci: tuple[float, float], threshold: float) -> Verdict:
    """pass: the whole interval clears the threshold; fail: wholly below; otherwise inconclusive."""
    lo, hi = ci
    if lo >= threshold:
        return Verdict.PASS
    if hi < threshold:
        return Verdict.FAIL
    return Verdict.INCONCLUSIVE


def sequential_verdict(ratios: Sequence[float], *, threshold: float, min_trials: int, check_every: int,
                       seed: int = PerfSettings.seed, resamples: int = PerfSettings.resamples,
                       confidence: float = PerfSettings.confidence) -> Verdict | None:
    """Early stop: at a checkpoint (min_trials trials, then every check_every more) the verdict
    when the interval clears the threshold or lies wholly below it, else None (go on). Peeking
    at checkpoints makes the interval's coverage somewhat lower than `confidence`; the trials
    cap (the caller's) bounds the cost of an unclear case."""
    n = len(ratios)
    if n < min_trials or (n - min_trials) % check_every:
        return None
    v = verdict(bootstrap_median_ci(ratios, seed=seed, resamples=resamples, confidence=confidence),
                threshold)
    return None if v == Verdict.INCONCLUSIVE else v
