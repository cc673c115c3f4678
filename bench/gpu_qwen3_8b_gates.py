"""Both gates at Qwen3-8B dims in the optimized mode: the identity copy (examples/byok/
identity_copy.cu) bound to `qwen.decode_logits_copy@1` (instance decoder.logits_zero_bias), one
small copy of the logits per decode step.

The bundles reference a 16 GB checkpoint that is never carried: both machines write it bit for
bit from `pattern`, a function of each tensor's name and element index (integer hashing, one
exact float scaling, one rounding to the stored dtype: the same bits on any CPU or GPU).

Two steps:
  prepare (here, needs TensorRT-RTX; ~17 GB of disk, little memory: the networks map the weights
      from their files): `python bench/gpu_qwen3_8b_gates.py prepare --checkpoint /tmp/qwen3_8b_ck
      -o artifacts/qwen3_8b_gates` writes the Qwen3-8B config and tokenizer (trtmc model synth, no
      weights) and the pattern weights into --checkpoint, then into -o: the native and the
      slot-ready bundle (referenced weights, no TensorRT plans), the selection receipt, and the
      checkpoint's small files plus each weight file's safetensors header.
  run (the GPU machine): `python3 bench/gpu_qwen3_8b_gates.py run -o artifacts/qwen3_8b_gates
      --out gates.json` rewrites each weight file from its header and the pattern (so the
      checkpoint's revision and every digest match the bundles'), builds the kernel for sm_90a
      and runs both gates (gpu_gates.gate_modes) in the chosen modes.
  drift (the GPU machine): `python3 bench/gpu_qwen3_8b_gates.py drift --out drift.json`: the
      teacher-forced logits of the first prompt, native against itself and against the slot arm,
      per step (where the gate's two arms part, and whether one arm even repeats itself), the
      caches per step, and the first layer output that differs from one cache snapshot (how the
      roles' weight-sharing bug was found, docs/performance.md).
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
import zlib
from pathlib import Path

import torch

OPTIONS = {"max_cache_length": 4096, "decoder_engine_layout": "split", "precision": "bf16"}
RECIPE = ("qwen.decode_logits_copy@1", "decoder.logits_zero_bias")
KERNEL = Path(__file__).resolve().parent.parent / "examples" / "byok" / "identity_copy.cu"
SHARD_BYTES = 4 << 30
CHUNK = 1 << 26  # elements generated at a time
PROMPTS = ["Explain grouped-query attention in one sentence.", "A kernel author replaces one region.",
           "The quick brown fox jumps over the lazy dog."]
HEADER = ".header"  # suffix of a carried weight file's header (its first 8 + n bytes)


def pattern(name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Values in [-0.02, 0.02) from a 32-bit integer hash of (name, element index)."""
    seed = zlib.crc32(name.encode())
    n = math.prod(shape)
    out = torch.empty(n, dtype=dtype, device=device)
    for lo in range(0, n, CHUNK):
        i = torch.arange(lo, min(n, lo + CHUNK), dtype=torch.int64, device=device)
        h = (i * 2654435761 + seed) & 0xFFFFFFFF
        h = h ^ (h >> 15)
        h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
        h = h ^ (h >> 12)
        u = (h & 0xFFFF).to(torch.float32) - 32768.0  # exact
        out[lo:lo + len(i)] = (u * (0.02 / 32768.0)).to(dtype)
    return out.reshape(shape)


def _write_checkpoint(ck: Path) -> None:
    """Config + tokenizer of Qwen3-8B, then the pattern weights in shards of <= 4 GiB."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.models.synth import synthesize
    synthesize("Qwen3-8B", ck, weights=False)
    config = AutoConfig.from_pretrained(str(ck), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shards, size = [[]], 0
    for name, t in model.state_dict().items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, tuple(t.shape), t.dtype))
        size += nbytes
    for k, members in enumerate(shards):
        t0 = time.perf_counter()
        save_file({n: pattern(n, s, d, "cpu") for n, s, d in members},
                  str(ck / f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"))
        print(f"wrote shard {k + 1}/{len(shards)} ({time.perf_counter() - t0:.0f} s)", flush=True)


def prepare(args) -> int:
    from pipeline.bundle.writer import build_bundle
    from pipeline.families.capture import capture_role
    from pipeline.graph.select import from_recipe, save_receipt
    ck, out = Path(args.checkpoint), Path(args.output)
    if not ck.exists():
        _write_checkpoint(ck)
    out.mkdir(parents=True, exist_ok=True)
    receipt = from_recipe(capture_role(str(ck), None, "decode", OPTIONS).snapshot, *RECIPE)
    save_receipt(receipt, out / "slot.selection.json")
    for name, selection in (("native", None), ("slot", receipt)):
        t0 = time.perf_counter()
        build_bundle(str(ck), None, OPTIONS, out / f"{name}.bundle", selection=selection,
                     weights="reference", build_plans=False)
        print(f"built {name}.bundle ({time.perf_counter() - t0:.0f} s)", flush=True)
    small = out / "checkpoint"
    shutil.rmtree(small, ignore_errors=True)
    small.mkdir()
    for f in ck.iterdir():
        if f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                fh.seek(0)
                (small / (f.name + HEADER)).write_bytes(fh.read(8 + n))
        else:
            shutil.copy2(f, small / f.name)
    return 0


def rewrite_checkpoint(small: Path, ck: Path, device: str = "cuda") -> None:
    """`ck` = the carried small files + every weight file rebuilt from its header and `pattern`
    (tensors generated on `device`)."""
    import json

    from pipeline import dtypes
    ck.mkdir(parents=True, exist_ok=True)
    for f in small.iterdir():
        if not f.name.endswith(HEADER):
            shutil.copy2(f, ck / f.name)
            continue
        head = f.read_bytes()
        header = json.loads(head[8:])
        with open(ck / f.name[:-len(HEADER)], "wb") as fh:
            fh.write(head)
            for name, meta in sorted((k, v) for k, v in header.items() if k != "__metadata__"):
                dtype = dtypes.torch_dtype(dtypes.BY_SAFETENSORS[meta["dtype"]].name)
                t = pattern(name, meta["shape"], dtype, device).cpu()
                fh.seek(len(head) + meta["data_offsets"][0])
                fh.write(t.view(torch.uint8).numpy().tobytes())
        print(f"wrote {f.name[:-len(HEADER)]}", flush=True)


def run(args) -> int:
    from gpu_gates import bound_kernel, gate_modes  # bench/ is first on sys.path

    from pipeline import log
    log.configure()
    art, work = Path(args.output), Path(args.work)
    t = time.perf_counter()
    rewrite_checkpoint(art / "checkpoint", work / "checkpoint")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "prompts": PROMPTS, "options": OPTIONS,
              "recipe": RECIPE, "checkpoint_seconds": time.perf_counter() - t, "method": __doc__}
    manifest = bound_kernel(KERNEL, work, art / "slot.selection.json", cuda=True)
    gate_modes("qwen3_8b_logits_copy", art / "native.bundle", art / "slot.bundle", manifest, "cuda",
               work / "checkpoint", PROMPTS, args.modes.split(","), args.trials,
               args.max_new_tokens, Path(args.out), result)
    return 0


def drift(args) -> int:
    """Where the two arms' teacher-forced logits part: native against itself (run to run) and
    against the slot arm, per step, on the first prompt with native's greedy tokens; the caches
    per step (cache_divergence); then the first decode step from one cache snapshot with every
    layer output copied to the host, so the first tensor that differs is named."""
    import json

    from gpu_gates import bound_kernel  # bench/ is first on sys.path

    from pipeline import log
    from pipeline.runtime.generate import teacher_forced_logits
    from pipeline.runtime.pipeline import open_pipeline
    log.configure()
    art, work = Path(args.output), Path(args.work)
    ck = work / "checkpoint"
    if not ck.exists():
        rewrite_checkpoint(art / "checkpoint", ck)
    manifest = bound_kernel(KERNEL, work, art / "slot.selection.json", cuda=True)
    native = open_pipeline(art / "native.bundle", None, "cuda", ck, mode=args.modes)
    slot = open_pipeline(art / "slot.bundle", manifest, "cuda", ck, mode=args.modes)
    ids = native.bundle.tokenizer()(PROMPTS[0])["input_ids"]
    tokens = native.generate(PROMPTS[:1], args.max_new_tokens, compile=False,  # eager: no compile wait
                             cuda_graph=False)[0]["token_ids"][:-1]
    runs = {"native": teacher_forced_logits(native, ids, tokens),
            "native_again": teacher_forced_logits(native, ids, tokens),
            "slot": teacher_forced_logits(slot, ids, tokens),
            "slot_again": teacher_forced_logits(slot, ids, tokens)}
    per_step = lambda xs, ys: [_gap(a, b) for a, b in zip(xs, ys)]  # noqa: E731
    diff = {name: per_step(runs["native"], runs[name]) for name in ("native_again", "slot", "slot_again")}
    # a slot arm one step behind native would match native's previous step
    diff["slot_vs_native_previous_step"] = per_step(runs["native"], runs["slot"][1:])
    diff["native_step_to_step"] = per_step(runs["native"], runs["native"][1:])
    print(json.dumps(diff), flush=True)
    caches = cache_divergence(native, slot, ids, tokens[:8])
    print(json.dumps(caches), flush=True)
    del native, slot
    torch.cuda.empty_cache()
    first = first_differing_tensors({"native": (art / "native.bundle", None),
                                     "slot": (art / "slot.bundle", manifest)},
                                    ck, args.modes, ids, tokens[0])
    print(json.dumps(first, indent=1), flush=True)
    Path(args.out).write_text(json.dumps({"prompt": PROMPTS[0], "tokens": tokens, "mode": args.modes,
                                          "max_abs_logit_diff_per_step": diff,
                                          "cache_divergence": caches,
                                          "first_decode_step": first}, indent=1))
    return 0


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, computed in FP32, or in the inputs' dtype when wider."""
    wide = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return float((a.to(wide) - b.to(wide)).abs().max())


def _restore(cache, snapshot: dict) -> None:
    """The cache's buffers set back to a snapshot of them."""
    for k, v in snapshot.items():
        cache.buffers[k].copy_(v)


def cache_divergence(native, slot, prompt_ids: list[int], tokens: list[int]) -> dict:
    """Each arm's own prefill into its own zeroed cache, then the forced `tokens` with the normal
    (logits-only) programs: per step, max |Δ| of the logits and of the caches (native - slot); and
    the slot arm's first step again from native's prefill cache."""
    from pipeline.runtime.generate import KVCache, _programs, _Step
    device = native.device
    steps = {name: _programs(p) for name, p in (("native", native), ("slot", slot))}
    caches = {name: KVCache(prefill, native.family.io) for name, (prefill, _) in steps.items()}
    past = torch.zeros(1, dtype=torch.int32, device=device)
    prompt = torch.tensor([prompt_ids], dtype=torch.int32, device=device)

    def gap(a: dict, b: dict) -> float:
        return max(_gap(a[k], b[k]) for k in a)

    logits = {name: _Step(steps[name][0], caches[name])(prompt, past) for name in steps}
    out = {"prefill": {"logits": _gap(logits["native"], logits["slot"]),
                       "cache": gap(caches["native"].buffers, caches["slot"].buffers)}}
    snapshot = {k: v.clone() for k, v in caches["native"].buffers.items()}
    per_step = []
    for i, t in enumerate(tokens):
        ids, at = torch.tensor([[t]], dtype=torch.int32, device=device), past + len(prompt_ids) + i
        logits = {name: _Step(steps[name][1], caches[name])(ids, at) for name in steps}
        per_step.append({"logits": _gap(logits["native"], logits["slot"]),
                         "cache": gap(caches["native"].buffers, caches["slot"].buffers)})
    out["decode"] = per_step
    _restore(caches["slot"], snapshot)
    ids = torch.tensor([[tokens[0]]], dtype=torch.int32, device=device)
    again = _Step(steps["slot"][1], caches["slot"])(ids, past + len(prompt_ids))
    _restore(caches["native"], snapshot)
    first = _Step(steps["native"][1], caches["native"])(ids, past + len(prompt_ids))
    out["first_step_from_native_prefill"] = {
        "logits": _gap(first, again),
        "cache": gap(caches["native"].buffers, caches["slot"].buffers)}
    return out


def first_differing_tensors(bundles: dict, checkpoint: Path, mode: str, prompt_ids: list[int],
                            token: int, limit: int = 12, device: str = "cuda") -> dict:
    """The first decode step after native's prefill of `prompt_ids`, from one cache snapshot, by
    both arms' programs lowered as usual but with every layer's outputs copied to the host as
    they are made (host copies: the device allocations, and so the memory the step reuses, stay
    as in the plain program; each copy waits for the device): the first tensors, in native's
    layer order, that differ, with their producers and max |diff|."""
    from pipeline.runtime import program as program_module
    from pipeline.runtime.generate import KVCache, _programs, _Step
    from pipeline.runtime.pipeline import open_pipeline
    records: dict[str, dict] = {}
    plain = program_module._generate

    def recording(ctx, code, inputs, outputs, role):
        def wrap(step, layer):
            def recorded(*args):
                result = step(*args)
                values = result if len(layer["outputs"]) > 1 else (result,)
                for t, v in zip(layer["outputs"], values):
                    if isinstance(v, torch.Tensor) and v.numel() <= 1 << 20:
                        records[ctx.spec(t).name] = (f"{layer['id']} {layer['type']} '{layer['name']}'",
                                                     v.detach().to("cpu", torch.float64, copy=True))
                return result
            return recorded
        return plain(ctx, [(wrap(step, layer), layer) for step, layer in code], inputs, outputs, role)

    program_module._generate = recording
    try:
        arms = {name: open_pipeline(bundle, kb, device, checkpoint, mode=mode)
                for name, (bundle, kb) in bundles.items()}
    finally:
        program_module._generate = plain
    native = arms["native"]
    prefill = _programs(native)[0]
    cache = KVCache(prefill, native.family.io)
    past = torch.zeros(1, dtype=torch.int32, device=native.device)
    _Step(prefill, cache)(torch.tensor([prompt_ids], dtype=torch.int32, device=native.device), past)
    snapshot = {k: v.clone() for k, v in cache.buffers.items()}
    ids = torch.tensor([[token]], dtype=torch.int32, device=native.device)
    outs = {}
    for arm in ("native", "native_again", "slot"):
        _restore(cache, snapshot)
        records.clear()
        _Step(_programs(arms[arm.split("_")[0]])[1], cache)(ids, past + len(prompt_ids))
        outs[arm] = dict(records)
        outs[arm]["@cache"] = ("the KV cache after the step",
                               torch.cat([b.flatten().double().cpu() for b in cache.buffers.values()]))
    report = {}
    for arm in ("native_again", "slot"):
        found = []
        for name, (producer, a) in outs["native"].items():
            b = outs[arm].get(name, (None, None))[1]
            if b is None or a.shape != b.shape:
                continue
            d = _gap(a, b) if a.numel() else 0.0
            if d != 0.0:
                found.append({"tensor": name, "producer": producer, "max_abs_diff": d})
                if len(found) == limit:
                    break
        report[arm] = {"compared": sum(n in outs[arm] for n in outs["native"]), "first": found}
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--checkpoint", default="/tmp/qwen3_8b_ck")
    r = sub.add_parser("run")
    r.add_argument("--trials", type=int, default=60)
    d = sub.add_parser("drift", help="the arms' teacher-forced logits per step, and native's run to run")
    for q in (r, d):
        q.add_argument("--work", default="/tmp/qwen3_8b_gates")
        q.add_argument("--modes", default="optimized", help="run: comma-separated; drift: one mode")
        q.add_argument("--max-new-tokens", type=int, default=32)
        q.add_argument("--out", required=True)
    for q in (p, r, d):
        q.add_argument("-o", "--output", default="artifacts/qwen3_8b_gates")
    args = ap.parse_args()
    return {"prepare": prepare, "run": run, "drift": drift}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
