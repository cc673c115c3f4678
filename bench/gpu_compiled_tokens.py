"""A decoder's greedy tokens in the optimized mode: equal run to run, and against the step uncompiled.

`python3 bench/gpu_compiled_tokens.py BUNDLE --out t.json` opens the bundle in the optimized mode
(on `--device`, CUDA by default), takes the seeded random prompt `trtmc bench decode` takes
(`--prompt-tokens`, default 128), and generates `--new-tokens` (default 64) greedy tokens three
times over the pipeline's one KV cache: once with the decode step neither compiled nor captured,
then twice compiled (repeated layers once each, pipeline/runtime/blocks.py) and, on CUDA, replayed
as a CUDA graph. It writes how many distinct blocks were compiled, whether the two compiled runs
gave the same tokens, and the first step where they part from the uncompiled run (null when they
never do; Inductor may round otherwise than the layers' own operations at a near tie).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pipeline.gates.bench import _prompt
from pipeline.runtime.generate import _programs, generate
from pipeline.runtime.pipeline import open_pipeline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    pipe = open_pipeline(args.bundle, device=args.device, mode="optimized")
    prefill, decode = _programs(pipe)
    prompt, cache = _prompt(pipe, args.prompt_tokens, 0), pipe.kv_cache
    uncompiled = generate(prefill, decode, prompt, args.new_tokens, cuda_graph=False,
                          cache=cache).token_ids
    runs = [generate(prefill, decode, prompt, args.new_tokens, compile=True, cache=cache).token_ids
            for _ in range(2)]
    (twin,) = cache.compiled.values()
    parted = next((i for i, (a, b) in enumerate(zip(uncompiled, runs[0])) if a != b), None)
    result = {"bundle": str(args.bundle), "device": str(pipe.device), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if pipe.device.type == "cuda" else None,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "blocks": getattr(twin.step, "blocks", None), "run_to_run_equal": runs[0] == runs[1],
              "first_step_apart_from_uncompiled": parted}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
