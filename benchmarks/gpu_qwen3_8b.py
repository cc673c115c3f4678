"""Qwen3-8B-size greedy decode on the reference runtime: eager, CUDA graph, compiled + graph, tokens/s.

Two steps:
  capture (here, needs TensorRT-RTX): `python benchmarks/gpu_qwen3_8b.py capture [-o artifacts/qwen3_8b]`
      synthesizes the Qwen3-8B config (no weights), captures the split-layout prefill and decode
      networks (bf16, max cache length 4096) and writes their network exports and the computed
      constants (safetensors) to the folder.
  run (the GPU machine, no TensorRT): `python benchmarks/gpu_qwen3_8b.py run --out result.json`
      random weights made on the GPU for every checkpoint-sourced weight of the export (seeded
      normal(0, 0.02), dtype and shape from the weights table), both programs lowered on cuda,
      one 128-token random prompt, 256 new greedy tokens, no EOS.

Method: decode-only time = median over trials of (wall time of generate(prompt, 256) - wall time
of generate(prompt, 1)), each call bracketed by torch.cuda.synchronize(); generate(prompt, 1)
is prefill plus the first argmax, so the difference is the 255 decode steps and tokens/s = 255 /
difference. Modes (--modes): eager, cuda_graph, compiled_graph (the decode step torch.compile'd
whole by Inductor, slots as an opaque custom op, then captured in our CUDA graph). The modes'
runs alternate after one warm-up each (the warm-up compiles and captures; the compiled mode's is
cut off after --compile-timeout s and the mode skipped). Every mode's tokens must equal the first
mode's. Roofline: the copy roofline measured in the run, not a datasheet bandwidth (the gates' own
pipeline.gates.roofline.measure_roofline: device-to-device copies of 1, 2 and 4 GiB as free memory
allows, read + written, the best per-size median; its method is in the result), over all
checkpoint weight bytes, and over those bytes without the embedding table, of which a step reads
one row.
Optional baseline: transformers' Qwen3ForCausalLM with the same tensors (assigned, not copied),
greedy generate with a static cache (transformers' own auto-compile applies), same method.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROLES = ("prefill", "decode")
OPTIONS = {"max_cache_length": 4096, "decoder_engine_layout": "split", "precision": "bf16"}
MODES = {"eager": {"cuda_graph": False}, "cuda_graph": {"cuda_graph": True},
         "compiled_graph": {"cuda_graph": True, "compile": True},
         # the optimized mode: lowering passes (merged GEMMs, the Triton GEMV for one row), then
         # compiled + graphed
         "optimized": {"cuda_graph": True, "compile": True}}
OPTIMIZED_MODES = ("optimized",)
DTYPES = {"BF16": torch.bfloat16, "FP16": torch.float16, "FP32": torch.float32}


def capture(out: Path) -> None:
    """Network exports of both roles + computed constants + config, from the config alone."""
    import tempfile

    from safetensors.torch import save_file

    from pipeline.families.capture import capture_role
    from pipeline.models.synth import synthesize
    from pipeline.trt.export import export_network
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = synthesize("Qwen3-8B", Path(tmp) / "qwen3-8b", weights=False)
        computed = {}
        for role in ROLES:
            cap = capture_role(str(model), None, role, OPTIONS)
            (out / f"{role}.export.json").write_text(json.dumps(export_network(cap.nb, role)))
            computed |= cap.nb.computed
        save_file({k: v.contiguous() for k, v in computed.items()}, str(out / "computed.safetensors"))
        (out / "config.json").write_text((model / "config.json").read_text())
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({total / 1e6:.1f} MB)")


def random_weights(export: dict, device: str, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return {k: torch.empty(v["shape"], dtype=DTYPES[v["dtype"]], device=device).normal_(
                0.0, 0.02, generator=gen)
            for k, v in sorted(export["weights"].items()) if v["source"] == "checkpoint"}


def _seconds(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@contextlib.contextmanager
def _deadline(seconds: int | None):
    """Raise TimeoutError in the main thread after `seconds` (SIGALRM); None: no limit."""
    def expire(*_):
        raise TimeoutError
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds or 0)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def decode_seconds(gen_n, gen_1) -> float:
    """Decode-only seconds: a generation of n tokens minus one of 1 token (prefill + argmax)."""
    return _seconds(gen_n) - _seconds(gen_1)


def attention_check(device: str) -> dict:
    """Which attention products the rule uses here, and their max |diff| to FP32 copies at the
    decode shapes (8 KV heads x 4 queries, 4096 keys, head dim 128)."""
    from pipeline.runtime import decoder_ops as ops
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(8, n, 128, generator=g, device=device).bfloat16()
               for n in (4, 4096, 4096))
    if not ops._has_fp32_bmm(torch.device(device)):
        return {"bf16_tensor_core_path": False}
    ref = ops._upcast_products.scores(q, k)
    p = torch.softmax(ref / 11.3, -1)
    return {"bf16_tensor_core_path": True,
            "scores_max_abs_diff": (ops._bf16_products.scores(q, k) - ref).abs().max().item(),
            "pv_max_abs_diff": (ops._bf16_products.weighted(p, v)
                                - ops._upcast_products.weighted(p, v)).abs().max().item()}


def setup(args) -> tuple:
    """Both programs lowered on cuda over random weights, a KV cache, the prompt, and the result
    dict begun (GPU, versions, weight bytes, roofline)."""
    from safetensors.torch import load_file

    from pipeline.runtime.generate import KVCache
    from pipeline.modes import Mode
    from pipeline.runtime.program import Program, resident_bytes
    assert "pipeline.trt" not in sys.modules and "tensorrt_rtx" not in sys.modules
    art, device = Path(args.artifacts), "cuda"
    exports = {r: json.loads((art / f"{r}.export.json").read_text()) for r in ROLES}
    computed = {k: v.to(device) for k, v in load_file(str(art / "computed.safetensors")).items()}
    capacity = next(t["shape"][2] for t in exports["decode"]["tensors"]
                    if t["name"].startswith("past_key."))
    from pipeline.runtime import triton_gemv
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "options": {**OPTIONS, "max_cache_length": capacity},
              "gemv_config": triton_gemv.CONFIG, "prompt_tokens": args.prompt,
              "seed": args.seed, "method": __doc__}
    t0 = time.perf_counter()
    weights = random_weights(exports["decode"], device, args.seed)
    torch.cuda.synchronize()
    nbytes = sum(w.numel() * w.element_size() for w in weights.values())
    embed = weights["model.embed_tokens.weight"]
    from pipeline.gates.roofline import measure_roofline  # the gates' own copy roofline
    roofline = measure_roofline(torch.device(device))
    result["copy_bytes_per_s"] = roofline.bytes_per_s
    result["copy_roofline"] = roofline.to_json()
    step_bytes = nbytes - embed.numel() * embed.element_size()
    result["weight_bytes"] = nbytes
    result["roofline_tokens_per_s"] = roofline.bytes_per_s / nbytes
    result["roofline_tokens_per_s_without_embedding"] = roofline.bytes_per_s / step_bytes
    programs = {False: tuple(Program.lower(exports[r], weights | computed, device=device)
                             for r in ROLES)}
    if any(m in OPTIMIZED_MODES for m in args.modes):
        shared: dict = {}
        programs[True] = tuple(Program.lower(exports[r], weights | computed, device=device,
                                             mode=Mode.OPTIMIZED, shared=shared) for r in ROLES)
    result["setup_seconds"] = time.perf_counter() - t0
    result["attention"] = attention_check(device)
    prompt = torch.randint(0, embed.shape[0], (args.prompt,),
                           generator=torch.Generator().manual_seed(args.seed)).tolist()
    cache = KVCache(programs[False][0])
    # what each set of programs (both roles) keeps resident, each storage once, and the cache
    result["resident_bytes"] = {("optimized" if optimized else "plain"): resident_bytes(*roles)
                                for optimized, roles in programs.items()}
    result["kv_cache_bytes"] = sum(b.numel() * b.element_size() for b in cache.buffers.values())
    return result, weights, programs, cache, prompt


def run(args) -> int:
    from pipeline.runtime.generate import generate
    result, weights, programs, cache, prompt = setup(args)
    result |= {"new_tokens": args.new_tokens, "trials": args.trials}

    def roles(mode):
        return programs[mode in OPTIMIZED_MODES]
    out = Path(args.out)

    def save():
        out.write_text(json.dumps(result, indent=1))

    def ours(n, mode):
        return lambda: generate(*roles(mode), prompt, n, cache=cache, **MODES[mode])
    tokens = {}
    for mode in args.modes:  # warm-up (captures the graph, compiles); the first mode is the reference
        t = time.perf_counter()
        try:
            with _deadline(args.compile_timeout if MODES[mode].get("compile") else None):
                tokens[mode] = generate(*roles(mode), prompt, args.new_tokens, cache=cache,
                                        **MODES[mode]).token_ids
        except Exception as e:  # a compile that fails or runs over is reported, not fatal
            if not MODES[mode].get("compile"):
                raise
            traceback.print_exc()
            result[f"{mode}_skipped"] = (f"first call (compile + capture) over "
                                         f"{args.compile_timeout} s" if isinstance(e, TimeoutError)
                                         else f"{type(e).__name__}: {str(e)[:2000]}")
            save()
            continue
        result[f"{mode}_first_call_seconds"] = time.perf_counter() - t
        print(f"{mode}: first call {result[f'{mode}_first_call_seconds']:.1f} s", flush=True)
        save()
    ref = args.modes[0]
    result["reference_mode"] = ref
    result["tokens_equal_reference"] = {m: tokens[m] == tokens[ref] for m in tokens}
    result["first_token_differing_from_reference"] = {
        m: next((i for i, (a, b) in enumerate(zip(tokens[m], tokens[ref])) if a != b), None)
        for m in tokens}
    result["tokens_head"] = tokens[ref][:16]
    result["margin_at_first_difference"] = {
        m: margin_at(programs[False], prompt, cache, tokens[ref], tokens[m], i)
        for m, i in result["first_token_differing_from_reference"].items() if i is not None}
    save()
    runs = {m: [] for m in tokens}
    for _ in range(args.trials):  # alternate
        for mode in runs:
            runs[mode].append(decode_seconds(ours(args.new_tokens, mode), ours(1, mode)))
    result["tokens_equal_run_to_run"] = {
        m: generate(*roles(m), prompt, args.new_tokens, cache=cache, **MODES[m]).token_ids == tokens[m]
        for m in runs}
    for mode, secs in runs.items():
        result[mode] = {"decode_seconds": secs,
                        "tokens_per_s": (args.new_tokens - 1) / statistics.median(secs),
                        "time_to_first_token_s": statistics.median(
                            _seconds(ours(1, mode)) for _ in range(3))}
    result["speedup_over_reference"] = {m: result[m]["tokens_per_s"] / result[ref]["tokens_per_s"]
                                        for m in runs}
    if args.long_prompt:
        result["long_context"] = long_context(args, programs, cache, runs, roles)
        save()
    if args.profile_steps:
        result["profile"] = {m: profile_mode(m, programs, cache, prompt, args.profile_steps, 25, out,
                                             args.new_tokens - 1)
                             for m in runs if MODES[m]["cuda_graph"]}
        save()
    result["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    result["memory_allocated_bytes"] = torch.cuda.memory_allocated()
    print(json.dumps({k: v for k, v in result.items() if k != "method"}, indent=1), flush=True)
    save()
    if args.hf:
        result["transformers"] = hf_baseline(Path(args.artifacts), weights, prompt, args, tokens[ref])
        print(json.dumps(result["transformers"], indent=1), flush=True)
        save()
    return 0 if all(result["tokens_equal_reference"].values()) else 1


def margin_at(plain, prompt, cache, ref_tokens, tokens, step: int) -> dict:
    """At the first step where a mode's greedy token differs from the reference's: the reference
    (eager rule) logits' top-2 margin and how far below its top the mode's token was."""
    from pipeline.runtime.generate import generate
    logits = generate(*plain, prompt, step + 1, cache=cache, keep_logits=True,
                      cuda_graph=False).logits[step]
    top2 = torch.topk(logits, 2).values
    return {"step": step, "reference_token": ref_tokens[step], "mode_token": tokens[step],
            "reference_top2_margin": (top2[0] - top2[1]).item(),
            "mode_token_below_reference_top": (top2[0] - logits[tokens[step]]).item()}


def long_context(args, programs, cache, modes, roles) -> dict:
    """Decode tokens/s after a `--long-prompt`-token prompt, per mode already warmed up (the
    compiled decode step is shape-static, so it is reused), same method as the main run."""
    from pipeline.runtime.generate import generate
    n = args.long_new_tokens
    prompt = torch.randint(0, 1000, (args.long_prompt,),
                           generator=torch.Generator().manual_seed(args.seed + 1)).tolist()
    out = {"prompt_tokens": args.long_prompt, "new_tokens": n}
    for mode in modes:
        def gen(k, mode=mode):
            return lambda: generate(*roles(mode), prompt, k, cache=cache, **MODES[mode])
        secs = [decode_seconds(gen(n), gen(1)) for _ in range(args.trials)]
        out[mode] = {"decode_seconds": secs, "tokens_per_s": (n - 1) / statistics.median(secs),
                     "time_to_first_token_s": _seconds(gen(1))}
    print(json.dumps(out, indent=1), flush=True)
    return out


KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel name), first match wins
    ("matmul (cuBLAS/cuBLASLt)", ("gemv", "gemm", "nvjet", "cutlass", "xmma", "splitk", "cublas")),
    ("Inductor fused (Triton)", ("triton",)),
    ("copy / index / cat", ("copy", "index", "cat", "scatter", "gather", "fill")),
    ("reduction / softmax", ("reduce", "softmax", "argmax", "max")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def kernel_table(prof, steps: int, top: int) -> dict:
    """The CUDA kernels of a profiled run of `steps` replays: per kernel name the total, per-step
    and per-launch time and launches per step (top `top` by total), per kind the same, and the
    kernels' busy time per step (the union of their intervals) against the wall span."""
    from torch.autograd import DeviceType
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    by_name, by_kind = {}, {}
    for e in kernels:
        for table, key in ((by_name, e.name), (by_kind, kernel_kind(e.name))):
            t = table.setdefault(key, [0.0, 0])
            t[0] += e.time_range.end - e.time_range.start
            t[1] += 1

    def rows(table, n=None):
        ranked = sorted(table.items(), key=lambda kv: -kv[1][0])[:n]
        return [{"name": k, "kind": kernel_kind(k), "total_us": us, "us_per_step": us / steps,
                 "launches_per_step": c / steps, "us_per_launch": us / c} for k, (us, c) in ranked]
    return {"steps": steps, "kernels_per_step": len(kernels) / steps,
            "kernel_busy_us_per_step": busy / steps,
            "span_us_per_step": (spans[-1][1] - spans[0][0]) / steps if spans else 0.0,
            "by_kind": rows(by_kind), "top_kernels": rows(by_name, top)}


def replay_windows(step, position: int, steps: int, window: int = 32) -> dict:
    """`steps` replays back to back from `position` (what a generation's decode runs, without
    its host work): ms per step over all of them (synchronized wall time) and per window of
    `window` steps (CUDA events), to tell a context-length trend from a fixed cost."""
    step.start(torch.zeros(1, dtype=torch.int64, device="cuda"), position)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps // window + 1)]

    def replays():
        events[0].record()
        for i in range(1, steps + 1):
            step.replay()
            if i % window == 0:
                events[i // window].record()
    total = _seconds(replays)
    return {"steps": steps, "from_position": position, "ms_per_step": 1e3 * total / steps,
            "window": window, "window_ms_per_step": [a.elapsed_time(b) / window
                                                     for a, b in zip(events, events[1:])]}


def profile_mode(mode: str, programs, cache, prompt, steps: int, top: int, out: Path,
                 long_steps: int = 255) -> dict:
    """The mode's decode-step CUDA graph replayed back to back (ms per step, synchronized wall
    time), then `steps` replays under torch.profiler: the CUDA kernels by kind and the top ones."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from pipeline.runtime.generate import generate
    if not MODES[mode]["cuda_graph"]:
        raise SystemExit(f"profile: mode {mode} replays no CUDA graph")
    t = time.perf_counter()
    prefill, decode = programs[mode in OPTIMIZED_MODES]
    generate(prefill, decode, prompt, 2, cache=cache, **MODES[mode])  # compiles, captures
    if MODES[mode].get("compile"):
        decode = cache.compiled[decode, "inductor"]
    step = cache.graphs[decode]  # the graph that call captured (or found)
    r = {"first_call_seconds": time.perf_counter() - t}
    step.start(torch.zeros(1, dtype=torch.int64, device="cuda"), len(prompt))
    r["ms_per_step"] = 1e3 * _seconds(lambda: [step.replay() for _ in range(steps)]) / steps
    r["replay_windows"] = replay_windows(step, len(prompt), long_steps)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step.replay()
        torch.cuda.synchronize()
    r["profile"] = kernel_table(prof, steps, top)
    prof.export_chrome_trace(str(out.with_name(f"{out.stem}.{mode}.trace.json")))
    lines = [f"{mode}: {r['ms_per_step']:.3f} ms/step; kernels busy "
             f"{r['profile']['kernel_busy_us_per_step']:.0f} us/step of a "
             f"{r['profile']['span_us_per_step']:.0f} us span, "
             f"{r['profile']['kernels_per_step']:.0f} kernels/step; {r['replay_windows']['steps']} "
             f"replays {r['replay_windows']['ms_per_step']:.3f} ms/step, by window "
             + " ".join(f"{w:.3f}" for w in r["replay_windows"]["window_ms_per_step"])]
    lines += [f"  {k['us_per_step']:8.1f} us/step {k['launches_per_step']:6.1f}x  {k['name'][:100]}"
              for k in r["profile"]["by_kind"] + r["profile"]["top_kernels"]]
    print("\n".join(lines), flush=True)
    return r


def profile(args) -> int:
    """Per mode: `profile_mode`, results into --out."""
    result, _, programs, cache, prompt = setup(args)
    out = Path(args.out)
    for mode in args.modes:
        result[mode] = profile_mode(mode, programs, cache, prompt, args.steps, args.top, out)
        out.write_text(json.dumps(result, indent=1))
    return 0


def hf_baseline(art: Path, weights: dict, prompt: list[int], args, ours: list[int]) -> dict:
    """transformers on the same tensors, static-cache greedy generate."""
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(**json.loads((art / "config.json").read_text()))
    with torch.device("cuda"):
        model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    ids = torch.tensor([prompt], device="cuda")

    def gen(n):
        return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      cache_implementation="static", pad_token_id=0)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        t = time.perf_counter()
        hf_tokens = gen(args.new_tokens)()[0, len(prompt):].tolist()  # warm-up (compiles)
        first = time.perf_counter() - t
        gen(1)()
        secs = [decode_seconds(gen(args.new_tokens), gen(1)) for _ in range(args.trials)]
    same = next((i for i, (a, b) in enumerate(zip(hf_tokens, ours)) if a != b), None)
    return {"transformers": transformers.__version__, "missing_keys": missing,
            "unexpected_keys": unexpected, "first_call_seconds": first, "decode_seconds": secs,
            "tokens_per_s": (args.new_tokens - 1) / statistics.median(secs),
            "first_token_differing_from_ours": same,
            "peak_bytes_over_shared_weights": torch.cuda.max_memory_allocated() - before}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("-o", "--out", default="artifacts/qwen3_8b")
    c.add_argument("--max-cache-length", type=int, default=OPTIONS["max_cache_length"])
    r = sub.add_parser("run")
    r.add_argument("--new-tokens", type=int, default=256)
    r.add_argument("--trials", type=int, default=3)
    r.add_argument("--modes", type=lambda v: v.split(","), default=list(MODES),
                   help=f"comma-separated, the first is the token reference (of {','.join(MODES)})")
    r.add_argument("--compile-timeout", type=int, default=300,
                   help="seconds the compiled mode's first call (compile + capture) may take")
    r.add_argument("--hf", action="store_true", help="also time transformers (static cache)")
    r.add_argument("--long-prompt", type=int, default=0,
                   help="also time decode after a prompt of this many tokens (0: skip)")
    r.add_argument("--long-new-tokens", type=int, default=64)
    r.add_argument("--profile-steps", type=int, default=0,
                   help="also profile this many replays of each graphed mode's step (0: skip)")
    p = sub.add_parser("profile")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--modes", type=lambda v: v.split(","), default=["compiled_graph"],
                   help="comma-separated, of the graphed modes cuda_graph,compiled_graph,optimized")
    for q in (r, p):
        q.add_argument("--artifacts", default="artifacts/qwen3_8b")
        q.add_argument("--out", required=True)
        q.add_argument("--prompt", type=int, default=128)
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--inductor", action="append", default=[], metavar="KEY=PYTHON_VALUE",
                       help="set torch._inductor.config.KEY before compiling (repeatable)")
        q.add_argument("--gemv-config", type=lambda v: tuple(int(x) for x in v.split(",")),
                       default=None, metavar="BLOCK_N,BLOCK_K,WARPS,STAGES",
                       help="the optimized mode's Triton GEMV blocks (pipeline/runtime/triton_gemv.py)")
    args = ap.parse_args()
    if args.cmd == "capture":
        OPTIONS["max_cache_length"] = args.max_cache_length
        capture(Path(args.out))
        return 0
    from _gpu import require_cuda
    require_cuda(__file__)
    import ast

    import torch._inductor.config as inductor_config
    for item in args.inductor:
        key, value = item.split("=", 1)
        setattr(inductor_config, key, ast.literal_eval(value))
    if args.gemv_config:
        from pipeline.runtime import triton_gemv
        triton_gemv.CONFIG = args.gemv_config
    return run(args) if args.cmd == "run" else profile(args)


if __name__ == "__main__":
    sys.exit(main())
