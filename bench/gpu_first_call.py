"""Where the optimized mode's first call goes: one generation under cProfile.

`python3 bench/gpu_first_call.py BUNDLE [--prompt-tokens 128] [--new-tokens 256] [--out p.json]`
opens the decoder bundle in the optimized mode (on CUDA unless --device says otherwise), as
`trtmc bench decode` does, then times its first generation (what `first_call_s` reports: the
compile or the compile cache's load, the CUDA graph captures, the generation) under cProfile and a
second one without, and prints and writes the functions that took the most of the first, by
cumulative and by own time. Run it twice with the same XDG_CACHE_HOME to see a warm first call.
cProfile slows Python code, not the GPU's: read its figures as shares, and the second call as the
floor a first call could reach.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time


def _rows(stats: pstats.Stats, key: str, top: int) -> list[dict]:
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:top]:
        calls, _, own, cumulative, _ = stats.stats[func]
        rows.append({"function": f"{func[0]}:{func[1]}({func[2]})", "calls": calls,
                     "own_s": own, "cumulative_s": cumulative})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out")
    args = ap.parse_args()

    from pipeline.files import keep_bytecode
    keep_bytecode()  # as the CLI does
    import torch

    from pipeline.gates.bench import _prompt
    from pipeline.runtime.compiled import use_compile_cache
    from pipeline.runtime.generate import _programs, generate
    from pipeline.runtime.pipeline import open_pipeline
    pipe = open_pipeline(args.bundle, device=args.device, mode="optimized")
    prefill, decode = _programs(pipe)
    prompt = _prompt(pipe, args.prompt_tokens, 0)
    folder = use_compile_cache(pipe.device)
    sync = torch.cuda.synchronize if pipe.device.type == "cuda" else (lambda: None)

    def once() -> float:
        start = time.perf_counter()
        generate(prefill, decode, prompt, args.new_tokens, eos_token_ids=(), cache=pipe.kv_cache,
                 compile=True)
        sync()
        return time.perf_counter() - start
    profile = cProfile.Profile()
    with torch.inference_mode():
        first = profile.runcall(once)
        second = once()
    stats = pstats.Stats(profile)
    result = {"bundle": args.bundle, "device": str(pipe.device), "compile_cache": folder,
              "first_call_profiled_s": first, "second_call_s": second,
              "by_cumulative": _rows(stats, "cumulative", args.top),
              "by_own_time": _rows(stats, "tottime", args.top)}
    print(f"first call {first:.3f} s under cProfile, second {second:.3f} s ({folder})")
    for row in result["by_cumulative"]:
        print(f"{row['cumulative_s']:8.3f} {row['own_s']:8.3f} {row['calls']:7d}  {row['function']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
