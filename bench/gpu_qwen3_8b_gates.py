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
      per step (where the gate's two arms part, and whether one arm even repeats itself).
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
    against the slot arm, per step, on the first prompt with native's greedy tokens."""
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
    tokens = native.generate(PROMPTS[:1], args.max_new_tokens)[0]["token_ids"][:-1]
    runs = {"native": teacher_forced_logits(native, ids, tokens),
            "native_again": teacher_forced_logits(native, ids, tokens),
            "slot": teacher_forced_logits(slot, ids, tokens)}
    diff = {name: [float((a - b).abs().max()) for a, b in zip(runs["native"], runs[name])]
            for name in ("native_again", "slot")}
    Path(args.out).write_text(json.dumps({"prompt": PROMPTS[0], "tokens": tokens,
                                          "max_abs_logit_diff_per_step": diff}, indent=1))
    print(json.dumps(diff), flush=True)
    return 0


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
