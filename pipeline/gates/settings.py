"""The gates' settings, typed: a spec's `gates` block (`GateSettings`) with its `correctness` and
`perf` blocks. Each class owns its defaults, once: a spec fills in from them, and so do the gates'
functions. Importing this module loads no torch.

`from_json` takes a block as the spec schema admits it (a key left out takes its default);
`to_json` gives it back with every default filled in (what the doit stages' options hold).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from pipeline.isolation import Limits


def _json(obj) -> dict:
    """The fields of a settings object as JSON values (tuples as lists, sub-blocks as dicts)."""
    out = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = v.to_json() if hasattr(v, "to_json") else list(v) if isinstance(v, tuple) else v
    return out


@dataclass(frozen=True)
class CorrectnessSettings:
    """`gates.correctness`: the end-to-end thresholds and the probe's seed."""
    max_abs_diff: float = 0.02
    min_cosine: float = 0.999
    # a decoder's greedy tokens may part only at a near tie: native's top two logits, and the two
    # arms' logits at every teacher-forced step, within this many rounding steps of the logits'
    # dtype (one BF16 step at a logit of 20 is 0.125)
    tie_steps: int = 4
    probe_seed: int | None = None  # None: drawn per run and recorded, so a kernel cannot count the calls

    @classmethod
    def from_json(cls, block: dict | None) -> CorrectnessSettings:
        return cls(**(block or {}))

    def to_json(self) -> dict:
        return _json(self)


@dataclass(frozen=True)
class PerfSettings:
    """`gates.perf`: trials (the cap: the sequential rule stops at min_trials + k * check_every
    once the verdict is clear), warm-up, the threshold and the bootstrap."""
    trials: int = 30
    warmup: int = 3
    threshold: float = 0.98
    seed: int = 0
    resamples: int = 2000
    confidence: float = 0.95
    min_trials: int = 20
    check_every: int = 10

    @classmethod
    def from_json(cls, block: dict | None) -> PerfSettings:
        return cls(**(block or {}))

    def to_json(self) -> dict:
        return _json(self)

    @property
    def bootstrap(self) -> dict:
        """The interval's knobs (stats.bootstrap_median_ci's keywords)."""
        return {"seed": self.seed, "resamples": self.resamples, "confidence": self.confidence}


@dataclass(frozen=True)
class GateSettings:
    """`gates`: the inputs (texts for encoders, prompts and max_new_tokens for decoders), the
    device, the engine mode (runtime/pipeline.Mode) and CPU threads, the worker's time limits,
    and the two gates' own blocks."""
    device: str = "cpu"
    mode: str | None = None  # the engine mode of both pipelines; None: the device's default
    cpu_threads: int = 1
    texts: tuple[str, ...] | None = None
    prompts: tuple[str, ...] | None = None
    max_new_tokens: int = 16
    # items each gate run draws besides the texts or prompts (gates/drawn.py), from a seed drawn
    # when it starts: inputs nobody chose in advance
    drawn: int = 3
    call_timeout_s: float = Limits.call_s
    stall_timeout_s: float = Limits.stall_s
    correctness: CorrectnessSettings = field(default_factory=CorrectnessSettings)
    perf: PerfSettings = field(default_factory=PerfSettings)

    @classmethod
    def from_json(cls, block: dict) -> GateSettings:
        top = {k: v for k, v in block.items() if k not in ("correctness", "perf")}
        for key in ("texts", "prompts"):
            if top.get(key) is not None:
                top[key] = tuple(top[key])
        return cls(**top, correctness=CorrectnessSettings.from_json(block.get("correctness")),
                   perf=PerfSettings.from_json(block.get("perf")))

    def to_json(self) -> dict:
        return _json(self)

    @property
    def limits(self) -> Limits:
        """The worker's time limits (pipeline/isolation.py)."""
        return Limits(call_s=self.call_timeout_s, stall_s=self.stall_timeout_s)
