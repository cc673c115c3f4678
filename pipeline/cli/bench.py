"""`trtmc bench region | decode`: a slot-ready bundle's regions timed alone, and a decoder
bundle's decode tokens/s (pipeline/gates/bench.py)."""
from __future__ import annotations

from pipeline.cli.args import (LENGTH, RUNS, SEED, add_json, add_pipeline_options, count,
                               example, print_json)
from pipeline.gates.bench import bench_decode, bench_region, require_slots
from pipeline.gates.settings import PerfSettings

TRIALS = count(1, 100_000)


def _show(result, as_json: bool) -> int:
    if as_json:
        print_json(result.to_json())
    else:
        for line in result.lines():
            print(line)
    return 0


def run_region(args) -> int:
    from pipeline.bundle.reader import Bundle
    from pipeline.runtime.pipeline import open_pipeline  # the kernels in this process
    bundle = Bundle.open(args.bundle)
    require_slots(bundle)  # said before any weight is loaded
    pipe = open_pipeline(bundle, args.kernel_bindings, args.device, args.checkpoint,
                         mode=args.mode, in_process=True)  # timed in this process
    bench = bench_region(pipe, trials=args.trials, warmup=args.warmup, seed=args.seed)
    _show(bench, args.json)
    return 1 if bench.wrong else 0  # a wrong kernel's timing is no result


def run_decode(args) -> int:
    from pipeline.runtime.pipeline import open_pipeline  # the kernels in this process
    pipe = open_pipeline(args.bundle, args.kernel_bindings, args.device, args.checkpoint,
                         mode=args.mode, in_process=True)  # timed in this process
    return _show(bench_decode(pipe, prompt_tokens=args.prompt_tokens,
                              new_tokens=args.new_tokens, trials=args.trials, seed=args.seed,
                              transformers=args.transformers, checkpoint=args.checkpoint),
                 args.json)


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
                                 "a GPU also the memory roofline: the copy bandwidth over the "
                                 "bytes a step reads (the weights it uses, the KV cache at the "
                                 "mean context).",
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
                   help="also time transformers' generate on the bundle's checkpoint, with its "
                        "dynamic cache and with a static cache (compiled on a GPU); skipped, "
                        "with one line, when it cannot load it")
    add_json(d, "the figures")
    d.set_defaults(func=run_decode)
