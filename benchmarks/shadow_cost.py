"""What shadow execution costs the correctness gate: the external arm's end-to-end run (a spec's
prompts or texts) with every slot call shadowed against the same run plain, in one process, after
a warm-up each, alternating; and the whole gate's time.

    python3 benchmarks/shadow_cost.py --spec SPEC.json [--repeats 5] --out cost.json

The spec's pipeline must be built (its bundles, DSO and binding manifest exist: `trtmc pipeline
SPEC build_native bind` first). The kernel's library loads into this process (`in_process=True`),
as it did when the figure in docs/performance.md was taken; the gate itself runs it in a kernel
host, whose cost this leaves out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pipeline.flow.spec import load_spec
from pipeline.gates.correctness import run_correctness_gate
from pipeline.runtime.pipeline import open_pipeline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = load_spec(args.spec)
    device, p = spec.gates.device, spec.paths
    native = open_pipeline(p.native_bundle, None, device)
    arms = {"plain": open_pipeline(p.slot_bundle, p.bindings, device, in_process=True),
            "shadowed": open_pipeline(p.slot_bundle, p.bindings, device, shadow=True, in_process=True)}
    decoder = native.kind == "decoder"
    workload = native.family.workload.of(spec.gates)
    items = workload.items

    def run(pipe) -> float:
        t0 = time.perf_counter()
        if decoder:
            pipe.generate(items, spec.gates.max_new_tokens)
        else:
            pipe.embed(items)
        if pipe.device.type == "cuda":
            torch.cuda.synchronize(pipe.device)
        if pipe.shadow is not None:
            pipe.shadow.collect()
        return time.perf_counter() - t0

    times = {name: [] for name in arms}
    for name, pipe in arms.items():  # warm-up: compile and capture
        run(pipe)
    for i in range(args.repeats):
        for name in (("plain", "shadowed") if i % 2 == 0 else ("shadowed", "plain")):
            times[name].append(run(arms[name]))
    t0 = time.perf_counter()
    report = run_correctness_gate(spec.name, native, arms["shadowed"], workload, spec.gates)
    gate_s = time.perf_counter() - t0
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    out = {"spec": spec.name, "device": str(native.device), "mode": native.mode,
           "items": len(items), "times_s": times, "median_s": medians,
           "shadowed_over_plain": medians["shadowed"] / medians["plain"],
           "gate_s": gate_s, "gate_passed": report.passed,
           "calls_checked": report.correctness.shadow.calls_checked, "message": report.message}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "times_s"}, indent=1))


if __name__ == "__main__":
    main()
