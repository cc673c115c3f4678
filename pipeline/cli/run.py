"""`trtmc run`: generate text with a decoder bundle (optionally with bound kernels), or benchmark it."""
from __future__ import annotations

import orjson

from pipeline import progress
from pipeline.cli.args import (LENGTH, RUNS, SEED, add_audit_option, add_pipeline_options,
                               audit_verdict, example, pipeline_inputs, real, text)
from pipeline.files import atomic_write_bytes, refuse_overwriting
from pipeline.host import open_pipeline
from pipeline.log import get as log_topic

log = log_topic("run")


def _sync(pipe):
    """The device synchronization a timing needs (None on a CPU)."""
    if pipe.device.type == "cuda":
        import torch
        return lambda: torch.cuda.synchronize(pipe.device)
    return None


def run(args) -> int:
    if args.output:
        refuse_overwriting(args.output, pipeline_inputs(args), "--output")
    with open_pipeline(args.bundle, args.kernel_bindings, args.device, args.checkpoint,
                       mode=args.mode, audit=args.audit,
                       what=f"trtmc {args.command}") as pipe:
        records = _generate(pipe, args)
    if args.output:  # in benchmark mode: the last run's records
        atomic_write_bytes(args.output, b"".join(orjson.dumps(r) + b"\n" for r in records))
        log.info("wrote %d record(s) to %s", len(records), args.output)
    audit_verdict(pipe)
    return 0


def _generate(pipe, args) -> list[dict]:
    """Generate once and print the texts, or time --benchmark runs and print one line; the
    records of the last run."""
    sampling = {"greedy": args.greedy, "temperature": args.temperature, "top_p": args.top_p,
                "seed": args.seed}
    prompts = args.prompt
    if args.benchmark:
        from pipeline.gates.performance import time_runs
        runs: list[list[dict]] = []
        with progress.bar(args.warmup + args.benchmark, "benchmark runs") as line:
            def one_run():  # a progress update costs microseconds: nothing next to a generation
                runs.append(pipe.generate(prompts, args.max_new_tokens, **sampling))
                line.update(1, note="warmup" if len(runs) <= args.warmup else "timed")
            seconds = time_runs(one_run, args.benchmark, args.warmup, sync=_sync(pipe))
        counts = [len(r["token_ids"]) for records in runs[args.warmup:] for r in records]
        records = runs[-1]
        print(f"generated_tokens_mean={sum(counts) / len(counts):.3f} runs={args.benchmark} "
              f"prompts={len(prompts)} seconds={seconds:.6f} "
              f"tokens_per_sec={sum(counts) / seconds:.3f}")
    else:
        records = pipe.generate(prompts, args.max_new_tokens, **sampling)
        for r in records:
            print(r["text"])
    return records


def register(sub) -> None:
    p = sub.add_parser("run", help="generate text with a decoder bundle",
                       description="Generate text with a decoder bundle and print it, or with "
                                   "--benchmark time B runs and print one line "
                                   "generated_tokens_mean=... tokens_per_sec=...",
                       epilog=example("trtmc run qwen3-slot-ready.bundle --kernel-bindings "
                                      "kernel-bindings.json --prompt 'Explain KV caching.' "
                                      "--max-new-tokens 32 --greedy",
                                      "trtmc run qwen3-native.bundle --prompt 'Explain KV caching.' "
                                      "--max-new-tokens 64 --greedy --warmup 3 --benchmark 10"))
    add_pipeline_options(p)
    add_audit_option(p)
    p.add_argument("--prompt", required=True, action="append", type=text, metavar="TEXT",
                   help="prompt text (repeat for several prompts)")
    p.add_argument("--max-new-tokens", type=LENGTH, required=True, metavar="N",
                   help="tokens to generate per prompt (at least 1)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (default: sampling)")
    p.add_argument("--temperature", type=real(0, 1e4), default=1.0,
                   help="sampling temperature, in (0, 10000]")
    p.add_argument("--top-p", type=real(0, 1), default=1.0,
                   help="nucleus sampling probability mass, in (0, 1]")
    p.add_argument("--seed", type=SEED, default=0, help="sampling seed")
    p.add_argument("--output", metavar="X.jsonl",
                   help="also write one JSON line per prompt (ids and text); with --benchmark, "
                        "the last run's")
    p.add_argument("--warmup", type=RUNS, default=0, metavar="W", help="untimed runs first")
    p.add_argument("--benchmark", type=RUNS, default=0, metavar="B",
                   help="timed runs; prints generated_tokens_mean=... tokens_per_sec=... "
                        "(default: 0, generate once and print the text)")
    p.set_defaults(func=run)
