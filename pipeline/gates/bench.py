"""Benchmarks over an open pipeline, with the gates' and the runtime's own primitives: a
slot-ready pipeline's regions timed alone (`bench_region`), and a decoder pipeline's decode
tokens/s (`bench_decode`). Each returns a typed result: `to_json()` for the figures, `lines()` for
what `trtmc bench` prints."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from pipeline.errors import UserError
from pipeline.gates.report_types import RegionOutputs, RegionTiming
from pipeline.gates.reports import roofline_share
from pipeline.gates.roofline import Roofline, measure_roofline, size_text


def _sync(device):
    """Waits for the device's queued work (nothing on a CPU)."""
    if device.type == "cuda":
        import torch
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _size(nbytes: int) -> str:
    return size_text(nbytes)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


# -- region --------------------------------------------------------------------------------------
def require_slots(bundle) -> None:
    """A region bench needs a slot-ready bundle: checkable before any weight is loaded."""
    if not bundle.slots:
        raise UserError(f"{bundle.path}: has no kernel slots (a native bundle); bench region "
                        f"times a slot-ready bundle's regions")


@dataclass(frozen=True)
class RegionBench:
    """Every slot's region timed alone (`performance.time_region`, one per slot) and the
    device's copy roofline they are measured against."""
    bundle: str
    device: str
    mode: str
    trials: int
    warmup: int
    seed: int
    roofline: Roofline
    regions: tuple[RegionTiming, ...]

    def to_json(self) -> dict:
        return {"bundle": self.bundle, "device": self.device, "mode": self.mode,
                "trials": self.trials, "warmup": self.warmup, "seed": self.seed,
                "roofline": self.roofline.to_json(), "regions": [r.to_json() for r in self.regions]}

    @property
    def wrong(self) -> list[str]:
        """The slots whose kernel gave a wrong output in some timed call: their timing is no
        speed of a right kernel."""
        return [r.binding_id for r in self.regions if r.wrong]

    def lines(self) -> list[str]:
        """One line per slot: medians, speedup, bytes and their copy time, roofline share, and
        whether every timed call's output was right."""

        def outputs(o: RegionOutputs) -> str:
            if o.first_wrong_call is None:
                return f"outputs right ({o.calls_checked} calls)"
            return f"WRONG output from call {o.first_wrong_call} (error ratio {o.max_error_ratio:.3g})"
        return [f"{r.binding_id}  native {_us(r.native_median_s)}  kernel "
                f"{_us(r.kernel_median_s)}  speedup {r.kernel_speedup:.2f}x  bytes "
                f"{_size(r.bytes)} (copy {_us(r.floor_s)})  {roofline_share(r)}  "
                f"{outputs(r.outputs)}" for r in self.regions]


def bench_region(pipe, *, trials: int, warmup: int, seed: int) -> RegionBench:
    """Every slot's region at its typical shapes: the native region against the bound kernel
    (`performance.time_region`, as the perf gate times them), and the time a copy of the same
    bytes takes at the device's copy roofline (`roofline.measure_roofline`)."""
    import torch

    from pipeline.gates.performance import time_region
    require_slots(pipe.bundle)
    with torch.inference_mode():
        roofline = measure_roofline(pipe.device)
        regions = tuple(time_region(pipe, r, trials=trials, warmup=warmup, seed=seed,
                                    bandwidth=roofline.bytes_per_s)
                        for r in pipe.regions.values())
    return RegionBench(str(pipe.bundle.path), str(pipe.device), pipe.mode.value, trials, warmup,
                       seed, roofline, regions)


# -- decode --------------------------------------------------------------------------------------
def _seconds(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _trial(generate_n, generate_1, sync) -> tuple[float, float]:
    """(decode-only seconds, time to first token): a generation of n tokens minus one of 1
    (prefill + first argmax), and that one."""
    first = _seconds(generate_1, sync)
    return _seconds(generate_n, sync) - first, first


def _tokens_per_s(new_tokens: int, median: float) -> float | None:
    return (new_tokens - 1) / median if median > 0 else None


def _prompt(pipe, tokens: int, seed: int) -> list[int]:
    import torch
    vocab = int(pipe.bundle.config["vocab_size"])
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (tokens,), generator=gen).tolist()


# transformers' generate in each configuration timed beside the engine, by the name reports give
# it: its default dynamic cache (eager), and a static cache, whose forward transformers compiles
# on a GPU (its auto-compile; on a CPU it runs eager)
TRANSFORMERS_CONFIGURATIONS: dict[str, dict] = {
    "dynamic cache": {},
    "static cache": {"cache_implementation": "static"},
}


def _transformers_baseline(pipe, checkpoint, prompt: list[int], new_tokens: int,
                           trials: int) -> dict:
    """transformers' greedy generate of the same prompt on the bundle's checkpoint, timed the
    same way in each of TRANSFORMERS_CONFIGURATIONS (`compiled`: whether transformers compiled
    its forward for it), and the name of the fastest; {"skipped": why} when it cannot load that
    checkpoint."""
    folder = checkpoint or pipe.bundle.manifest.get("checkpoint")
    if folder is None:
        return {"skipped": "the bundle embeds its weights and names no checkpoint folder "
                           "(give --checkpoint DIR)"}
    try:
        import torch
        import transformers
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype="auto").to(pipe.device).eval()
    except Exception as e:  # not installed, an unknown architecture, a folder it cannot read
        said = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return {"skipped": f"transformers cannot load {folder}: {said}"}
    ids = torch.tensor([prompt], device=pipe.device)
    sync = _sync(pipe.device)

    def timed(options: dict) -> dict:
        def gen(n):
            return lambda: model.generate(ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                          pad_token_id=0, **options)
        compiled_before = hasattr(model, "_compiled_call")
        # warm-up: both lengths, since a static cache is sized (and compiled) per length
        first_call = _seconds(gen(new_tokens), sync) + _seconds(gen(1), sync)
        seconds, first = zip(*(_trial(gen(new_tokens), gen(1), sync) for _ in range(trials)))
        median = statistics.median(seconds)
        # transformers keeps the forward it compiled for a static cache as `_compiled_call`
        return {"compiled": not compiled_before and hasattr(model, "_compiled_call"),
                "first_call_s": first_call, "decode_seconds": list(seconds),
                "median_decode_s": median, "tokens_per_s": _tokens_per_s(new_tokens, median),
                "first_token_seconds": list(first),
                "median_first_token_s": statistics.median(first)}
    with torch.inference_mode():
        measured = {name: timed(options) for name, options in TRANSFORMERS_CONFIGURATIONS.items()}
    fastest = min(measured, key=lambda name: measured[name]["median_decode_s"])
    return {"transformers": transformers.__version__, "checkpoint": str(folder),
            "configurations": measured, "fastest": fastest}


@dataclass(frozen=True)
class DecodeBench:
    """A decoder pipeline's decode figures: each trial's decode-only seconds, tokens/s at their
    median, each trial's time to first token (the prompt's prefill and the first argmax) and
    its median, the resident weight bytes, the bytes a decode step reads (`step_bytes`: the
    weights it uses, not the rows of a table it only indexes, and the KV cache at the mean
    context of the timed steps) and, on a GPU, the copy roofline and the tokens/s it allows at
    those bytes; `transformers`: the same measurement of transformers (or why it was skipped), None
    when not asked for. `first_call_s`: the untimed warm-up's seconds (in the optimized mode the
    compile and the CUDA graph's capture), `compile_cache`: the Inductor cache folder it used
    and whether it held anything before (a cold or a warm start), None in the eager mode."""
    bundle: str
    device: str
    mode: str
    kernels: tuple
    prompt_tokens: int
    new_tokens: int
    trials: int
    seed: int
    decode_seconds: tuple
    median_decode_s: float
    tokens_per_s: float | None
    weight_bytes: int
    step_bytes: int
    first_token_seconds: tuple
    median_first_token_s: float
    first_call_s: float
    compile_cache: Mapping | None = None
    roofline: Roofline | None = None
    roofline_tokens_per_s: float | None = None
    transformers: Mapping | None = None

    def to_json(self) -> dict:
        doc = {"bundle": self.bundle, "device": self.device, "mode": self.mode,
               "kernels": list(self.kernels), "prompt_tokens": self.prompt_tokens,
               "new_tokens": self.new_tokens, "trials": self.trials, "seed": self.seed,
               "decode_seconds": list(self.decode_seconds),
               "median_decode_s": self.median_decode_s, "tokens_per_s": self.tokens_per_s,
               "first_token_seconds": list(self.first_token_seconds),
               "median_first_token_s": self.median_first_token_s,
               "first_call_s": self.first_call_s, "compile_cache": self.compile_cache,
               "weight_bytes": self.weight_bytes, "step_bytes": self.step_bytes,
               "roofline": None if self.roofline is None else self.roofline.to_json(),
               "roofline_tokens_per_s": self.roofline_tokens_per_s}
        if self.transformers is not None:
            doc["transformers"] = self.transformers
        return doc

    def lines(self) -> list[str]:
        """tokens/s, the roofline (or why none), and transformers' tokens/s when measured."""
        rate = self.tokens_per_s
        lines = [f"trtmc  {'n/a' if rate is None else f'{rate:.1f}'} tokens/s  (median decode "
                 f"{self.median_decode_s * 1e3:.2f} ms for {self.new_tokens - 1} tokens, "
                 f"{self.trials} trials, prompt {self.prompt_tokens} tokens, {self.device}, "
                 f"{self.mode})",
                 f"first token  {self.median_first_token_s * 1e3:.2f} ms  (median of "
                 f"{self.trials}: the prompt's {self.prompt_tokens} tokens and one argmax)"]
        cache = self.compile_cache
        lines.append(f"first call  {self.first_call_s:.2f} s  (" + (
            f"compile, CUDA graph and a generation; Inductor cache {cache['dir']}: "
            f"{'warm' if cache['warm'] else 'empty'})" if cache else "a generation, eager)"))
        if self.roofline is None:
            lines.append(f"roofline  none on a CPU (weights {_size(self.weight_bytes)})")
        else:
            tokens_per_s = self.roofline_tokens_per_s
            share = f", {rate / tokens_per_s:.1%} of it" if rate and tokens_per_s else ""
            lines.append(f"roofline  {self.roofline_tokens_per_s:.1f} tokens/s  (a step reads "
                         f"{_size(self.step_bytes)}: weights and the cache in use, at "
                         f"{self.roofline.bytes_per_s / 1e9:.1f} GB/s copy{share})")
        hf = self.transformers
        if hf is not None and "skipped" in hf:
            lines.append(f"transformers  skipped: {hf['skipped']}")
        elif hf is not None:
            lines += [f"transformers  {c['tokens_per_s']:.1f} tokens/s  ({name}"
                      f"{', compiled' if c['compiled'] else ''}: median decode "
                      f"{c['median_decode_s'] * 1e3:.2f} ms, first token "
                      f"{c['median_first_token_s'] * 1e3:.2f} ms, transformers "
                      f"{hf['transformers']}{', the fastest' if name == hf['fastest'] else ''})"
                      for name, c in hf["configurations"].items()]
        return lines


def bench_decode(pipe, *, prompt_tokens: int, new_tokens: int, trials: int, seed: int = 0,
                 transformers: bool = False, checkpoint=None) -> DecodeBench:
    """Decode tokens/s of a decoder pipeline: greedy, no EOS, on a seeded random prompt; per
    trial the decode-only time is generate(n) minus generate(1), each synchronized, and
    tokens/s is (n - 1) / the median. On a GPU, beside it the memory roofline: the copy
    roofline's bandwidth over the bytes a decode step reads (`DecodeBench.step_bytes`).
    `transformers`: the same measurement with transformers on the bundle's checkpoint
    (`checkpoint`, else the one the bundle names)."""
    import torch

    from pipeline.runtime.generate import _programs, generate
    from pipeline.runtime.program import read_bytes, resident_bytes
    pipe.family.workload.check_generates(f"{pipe.bundle.path}: bench decode needs a decoder "
                                         f"bundle, this is a {pipe.bundle.family} {pipe.kind} "
                                         f"(use bench region)")
    if new_tokens < 2:
        raise UserError(f"new_tokens {new_tokens}: expected at least 2 (decode time is "
                        f"generate(n) - generate(1))", param="new_tokens")
    prefill, decode = _programs(pipe)
    prompt = _prompt(pipe, prompt_tokens, seed)
    cache, sync = pipe.kv_cache, _sync(pipe.device)
    compiled = pipe.mode.optimized

    def gen(n):
        return lambda: generate(prefill, decode, prompt, n, eos_token_ids=(), cache=cache,
                                compile=compiled)
    compile_cache = None
    if compiled:
        from pipeline.runtime.compiled import use_compile_cache
        folder = Path(use_compile_cache(pipe.device))
        compile_cache = {"dir": str(folder), "warm": folder.is_dir() and any(folder.iterdir())}
    with torch.inference_mode():
        # warm-up: captures the CUDA graph, compiles in the optimized mode
        first_call = _seconds(gen(new_tokens), sync)
        seconds, first = zip(*(_trial(gen(new_tokens), gen(1), sync) for _ in range(trials)))
    median = statistics.median(seconds)
    weight_bytes = resident_bytes(decode or prefill)
    # the cache's keys and values of one position, read by each step for every position in use
    per_position = sum(b.nbytes for b in cache.buffers.values()) // cache.capacity
    step_bytes = read_bytes(decode or prefill) + per_position * (prompt_tokens + new_tokens // 2)
    roofline = None
    if pipe.device.type == "cuda":
        roofline = measure_roofline(pipe.device)
    return DecodeBench(
        str(pipe.bundle.path), str(pipe.device), pipe.mode.value, tuple(sorted(pipe.kernels)),
        prompt_tokens, new_tokens, trials, seed, seconds, median,
        _tokens_per_s(new_tokens, median), weight_bytes, step_bytes, first,
        statistics.median(first),
        first_call, compile_cache,
        roofline,
        None if roofline is None else roofline.bytes_per_s / step_bytes,
        _transformers_baseline(pipe, checkpoint, prompt, new_tokens, trials) if transformers
        else None)
