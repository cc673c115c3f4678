"""`trtmc bench region | decode`: a slot-ready bundle's regions timed alone, and a decoder
bundle's decode tokens/s, with the gates' and the runtime's own primitives."""
from __future__ import annotations

import statistics
import time

from pipeline.cli.args import (LENGTH, RUNS, SEED, add_json, add_pipeline_options, count,
                               example, print_json)
from pipeline.errors import UserError
from pipeline.gates.settings import PerfSettings

TRIALS = count(1, 100_000)


def _sync(device):
    """Waits for the device's queued work (nothing on a CPU)."""
    if device.type == "cuda":
        import torch
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _size(nbytes: int) -> str:
    from pipeline.gates.roofline import size_text
    return size_text(nbytes)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


# -- region --------------------------------------------------------------------------------------
def _no_slots(bundle):
    raise UserError(f"{bundle.path}: has no kernel slots (a native bundle); bench region times a "
                    f"slot-ready bundle's regions")


def bench_regions(pipe, *, trials: int, warmup: int, seed: int) -> dict:
    """Every slot's region at its typical shapes: the native region against the bound kernel
    (`performance.time_region`, as the perf gate times them), and the time a copy of the same
    bytes takes at the device's copy roofline (`roofline.measure_roofline`)."""
    import torch

    from pipeline.gates.performance import time_region
    from pipeline.gates.roofline import measure_roofline
    if not pipe.regions:
        _no_slots(pipe.bundle)
    with torch.inference_mode():
        roofline = measure_roofline(pipe.device)
        regions = [time_region(pipe, r, trials=trials, warmup=warmup, seed=seed,
                               bandwidth=roofline.bytes_per_s) for r in pipe.regions.values()]
    return {"bundle": str(pipe.bundle.path), "device": str(pipe.device), "mode": pipe.mode.value,
            "trials": trials, "warmup": warmup, "seed": seed, "roofline": roofline.as_dict(),
            "regions": regions}


def region_line(r: dict) -> str:
    from pipeline.gates.reports import roofline_share
    return (f"{r['binding_id']}  native {_us(r['native_median_s'])}  kernel "
            f"{_us(r['kernel_median_s'])}  speedup {r['kernel_speedup']:.2f}x  bytes "
            f"{_size(r['bytes'])} (copy {_us(r['floor_s'])})  {roofline_share(r)}")


def run_region(args) -> int:
    from pipeline.bundle.reader import Bundle
    from pipeline.runtime.pipeline import open_pipeline
    bundle = Bundle.open(args.bundle)
    if not bundle.slots:  # said before any weight is loaded
        _no_slots(bundle)
    pipe = open_pipeline(bundle, args.kernel_bindings, args.device, args.checkpoint,
                         mode=args.mode)
    result = bench_regions(pipe, trials=args.trials, warmup=args.warmup, seed=args.seed)
    if args.json:
        print_json(result)
    else:
        for r in result["regions"]:
            print(region_line(r))
    return 0


# -- decode --------------------------------------------------------------------------------------
def _seconds(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _decode_seconds(generate_n, generate_1, sync) -> float:
    """Decode-only seconds: a generation of n tokens minus one of 1 (prefill + first argmax)."""
    return _seconds(generate_n, sync) - _seconds(generate_1, sync)


def _prompt(pipe, tokens: int, seed: int) -> list[int]:
    import torch
    vocab = int(pipe.bundle.config["vocab_size"])
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (tokens,), generator=gen).tolist()


def _transformers_baseline(pipe, checkpoint, prompt: list[int], new_tokens: int,
                           trials: int) -> dict:
    """transformers' greedy generate of the same prompt on the bundle's checkpoint, timed the
    same way; {"skipped": why} when it cannot load that checkpoint."""
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

    def gen(n):
        return lambda: model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      pad_token_id=0)
    with torch.inference_mode():
        gen(new_tokens)()  # warm-up
        seconds = [_decode_seconds(gen(new_tokens), gen(1), sync) for _ in range(trials)]
    median = statistics.median(seconds)
    return {"transformers": transformers.__version__, "checkpoint": str(folder),
            "decode_seconds": seconds, "median_decode_s": median,
            "tokens_per_s": (new_tokens - 1) / median if median > 0 else None}


def bench_decode(pipe, *, prompt_tokens: int, new_tokens: int, trials: int, seed: int = 0,
                 transformers: bool = False, checkpoint=None) -> dict:
    """Decode tokens/s of a decoder pipeline: greedy, no EOS, on a seeded random prompt; per
    trial the decode-only time is generate(n) minus generate(1), each synchronized, and
    tokens/s is (n - 1) / the median. On a GPU, beside it the memory roofline: the copy
    roofline's bandwidth over the bytes the decode step holds resident (its weights, read once a
    step). `transformers`: the same measurement with transformers on the bundle's checkpoint."""
    import torch

    from pipeline.runtime.generate import _programs, generate
    from pipeline.runtime.program import resident_bytes
    if pipe.kind != "decoder":
        raise UserError(f"{pipe.bundle.path}: bench decode needs a decoder bundle, this is a "
                        f"{pipe.bundle.family} {pipe.kind} (use bench region)")
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
    with torch.inference_mode():
        gen(new_tokens)()  # warm-up: captures the CUDA graph, compiles in the optimized mode
        seconds = [_decode_seconds(gen(new_tokens), gen(1), sync) for _ in range(trials)]
    median = statistics.median(seconds)
    result = {"bundle": str(pipe.bundle.path), "device": str(pipe.device),
              "mode": pipe.mode.value, "kernels": sorted(pipe.kernels),
              "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "trials": trials,
              "seed": seed, "decode_seconds": seconds, "median_decode_s": median,
              "tokens_per_s": (new_tokens - 1) / median if median > 0 else None,
              "weight_bytes": resident_bytes(decode or prefill), "roofline": None,
              "roofline_tokens_per_s": None}
    if pipe.device.type == "cuda":
        from pipeline.gates.roofline import measure_roofline
        roofline = measure_roofline(pipe.device)
        result["roofline"] = roofline.as_dict()
        result["roofline_tokens_per_s"] = roofline.bytes_per_s / result["weight_bytes"]
    if transformers:
        result["transformers"] = _transformers_baseline(pipe, checkpoint, prompt, new_tokens,
                                                        trials)
    return result


def decode_lines(r: dict) -> list[str]:
    rate = r["tokens_per_s"]
    lines = [f"trtmc  {'n/a' if rate is None else f'{rate:.1f}'} tokens/s  (median decode "
             f"{r['median_decode_s'] * 1e3:.2f} ms for {r['new_tokens'] - 1} tokens, "
             f"{r['trials']} trials, prompt {r['prompt_tokens']} tokens, {r['device']}, "
             f"{r['mode']})"]
    if r["roofline"] is None:
        lines.append(f"roofline  none on a CPU (weights {_size(r['weight_bytes'])})")
    else:
        share = f", {rate / r['roofline_tokens_per_s']:.1%} of it" if rate else ""
        lines.append(f"roofline  {r['roofline_tokens_per_s']:.1f} tokens/s  (weights "
                     f"{_size(r['weight_bytes'])} at {r['roofline']['bytes_per_s'] / 1e9:.1f} "
                     f"GB/s copy{share})")
    hf = r.get("transformers")
    if hf is not None:
        lines.append(f"transformers  skipped: {hf['skipped']}" if "skipped" in hf else
                     f"transformers  {hf['tokens_per_s']:.1f} tokens/s  (median decode "
                     f"{hf['median_decode_s'] * 1e3:.2f} ms, transformers {hf['transformers']})")
    return lines


def run_decode(args) -> int:
    from pipeline.runtime.pipeline import open_pipeline
    pipe = open_pipeline(args.bundle, args.kernel_bindings, args.device, args.checkpoint,
                         mode=args.mode)
    result = bench_decode(pipe, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                          trials=args.trials, seed=args.seed, transformers=args.transformers,
                          checkpoint=args.checkpoint)
    if args.json:
        print_json(result)
    else:
        print("\n".join(decode_lines(result)))
    return 0


def register(sub) -> None:
    p = sub.add_parser("bench", help="time a bundle's regions or its decode")
    s = p.add_subparsers(dest="bench_command", required=True, metavar="SUBCOMMAND")
    r = s.add_parser("region", help="each slot's region alone: native region vs bound kernel, "
                                    "and the copy roofline of the same bytes",
                     description="Times every slot's region at its typical shapes, as the perf "
                                 "gate does, and prints one line per slot: native median, kernel "
                                 "median, speedup, bytes (and a copy of them at the copy "
                                 "roofline), the kernel's roofline share (GPU only).",
                     epilog=example("trtmc bench region slot.bundle --kernel-bindings "
                                    "kernel/bindings.json --trials 50"))
    add_pipeline_options(r)
    r.add_argument("--trials", type=TRIALS, metavar="N", default=PerfSettings.trials,
                   help="timed calls of each side")
    r.add_argument("--warmup", type=RUNS, metavar="W", default=PerfSettings.warmup,
                   help="untimed calls of each side first")
    r.add_argument("--seed", type=SEED, default=PerfSettings.seed, help="seed of the inputs")
    add_json(r, "the timings (with the copy roofline)")
    r.set_defaults(func=run_region)
    d = s.add_parser("decode", help="decode tokens/s of a decoder bundle (greedy, no EOS)",
                     description="Decode tokens/s: per trial generate(n) - generate(1) on a "
                                 "seeded random prompt, greedy, no EOS; (n - 1) / the median. On "
                                 "a GPU also the memory roofline (resident weight bytes at the "
                                 "copy bandwidth).",
                     epilog=example("trtmc bench decode qwen3.bundle --prompt-tokens 128 "
                                    "--new-tokens 256 --trials 3",
                                    "trtmc bench decode qwen3-slot.bundle --kernel-bindings "
                                    "kernel/bindings.json --transformers"))
    add_pipeline_options(d)
    d.add_argument("--prompt-tokens", type=LENGTH, default=128, metavar="N",
                   help="random prompt length")
    d.add_argument("--new-tokens", type=count(2, 2 ** 20), default=256, metavar="N",
                   help="tokens generated per timed run (at least 2)")
    d.add_argument("--trials", type=TRIALS, metavar="N", default=3,
                   help="timed pairs of generations")
    d.add_argument("--seed", type=SEED, default=0, help="seed of the random prompt")
    d.add_argument("--transformers", action="store_true",
                   help="also time transformers' generate on the bundle's checkpoint (skipped, "
                        "with one line, when it cannot load it)")
    add_json(d, "the figures")
    d.set_defaults(func=run_decode)
