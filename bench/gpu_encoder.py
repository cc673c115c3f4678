"""GPU run of the encoder flow (issue: bundles/runtime/slots), for the H200 device machine.

Inputs built on a CPU machine and carried over: weight-stripped MiniLM bundles (native and
slot-ready with the layer-0 attention residual add) and the selection receipt. Here it builds the
CUDA DSOs (C++ with nvcc, CuTe DSL exporter), binds them, runs the region probe, the embedding
gate figures against the native bundle, and times native vs external side by side (alternating,
CUDA events, after warm-up). Writes one JSON of raw figures to --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def _ms(fn, inputs) -> float:
    """Milliseconds of one forward, CUDA events around the call only."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(**inputs)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _side_by_side(native, external, inputs, warmup: int, trials: int) -> dict:
    """Alternate native and external each trial (same conditions for both), after warm-up."""
    for _ in range(warmup):
        native(**inputs), external(**inputs)
    torch.cuda.synchronize()
    t_native, t_ext = [], []
    for _ in range(trials):
        t_native.append(_ms(native, inputs))
        t_ext.append(_ms(external, inputs))
    ratios = [n / e for n, e in zip(t_native, t_ext)]
    return {"native_ms": t_native, "external_ms": t_ext,
            "native_ms_median": statistics.median(t_native),
            "external_ms_median": statistics.median(t_ext),
            "throughput_ratio_median": statistics.median(ratios)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--native", required=True)
    ap.add_argument("--slot", required=True)
    ap.add_argument("--snapshot", required=True)
    ap.add_argument("--selection", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()

    from pipeline.kernels.build import build_kernel
    from pipeline.kernels.manifest import write_manifest
    from pipeline.gates.probe import region_probe
    from pipeline.runtime.cudagraph import GraphedProgram
    from pipeline.runtime.pipeline import open_pipeline

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    receipt = json.loads(Path(args.selection).read_text())
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
              "trials": args.trials, "warmup": args.warmup, "kernels": {}}

    kernels = {}
    t0 = time.time()
    kernels["cuda_cpp"] = build_kernel(Path("examples/byok/residual_add.cu"),
                                       work / "residual_add_cuda.so", cuda=True, cuda_arch="90a")
    result["build_seconds_cuda_cpp"] = time.time() - t0
    t0 = time.time()
    cute_so = work / "residual_add_cute.so"
    cute_so.unlink(missing_ok=True)  # the exporter refuses to overwrite
    proc = subprocess.run([sys.executable, "examples/byok/export_cutedsl_residual_add.py",
                           "--snapshot", args.snapshot, "--selection", args.selection,
                           "--output", str(cute_so)], capture_output=True, text=True)
    result["cutedsl_export"] = {"rc": proc.returncode, "stderr_tail": proc.stderr[-3000:]}
    if proc.returncode == 0:
        kernels["cutedsl"] = cute_so
        result["build_seconds_cutedsl"] = time.time() - t0

    texts = ["TensorRT kernels are swapped in only after they pass the gates.",
             "A quick brown fox jumps over the lazy dog near the river bank.",
             "The H200 has 141 GB of HBM3e memory."]
    native = open_pipeline(args.native, None, "cuda", args.checkpoint)
    ref = native.embed(texts)
    tok = native.bundle.tokenizer()
    inputs = native.encode_text(tok, texts[0])

    for name, so in kernels.items():
        manifest = write_manifest(work / f"{Path(so).stem}.bindings.json", [receipt], so)
        ext = open_pipeline(args.slot, manifest, "cuda", args.checkpoint)
        probe = region_probe(ext, seed=0)
        outs = ext.embed(texts)
        diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(ref, outs)]
        cos = [float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))
               for a, b in zip(ref, outs)]
        eager = _side_by_side(native.encoder, ext.encoder, inputs,
                              args.warmup, args.trials)
        graphed = _side_by_side(GraphedProgram(native.encoder, inputs),
                                GraphedProgram(ext.encoder, inputs), inputs,
                                args.warmup, args.trials)
        g_out = GraphedProgram(ext.encoder, inputs)(**inputs)["last_hidden_state"]
        graph_diff = float((g_out.float() - outs[0].float()).abs().max())
        result["kernels"][name] = {"probe": probe, "max_abs_diff": max(diffs), "min_cosine": min(cos),
                                   "graphed_vs_eager_max_abs_diff": graph_diff,
                                   "eager": eager, "cuda_graph": graphed}
        for mode, r in (("eager", eager), ("cuda graph", graphed)):
            print(f"{name} [{mode}]: probe {'PASS' if probe['passed'] else 'FAIL'} "
                  f"max|diff| {max(diffs):.4g} cos {min(cos):.6f} native {r['native_ms_median']:.3f} ms "
                  f"external {r['external_ms_median']:.3f} ms ratio {r['throughput_ratio_median']:.3f}",
                  flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
