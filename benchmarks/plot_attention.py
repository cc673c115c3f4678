"""The Hopper decode-attention kernel's figures as one picture (docs/performance.md shows it):
left, the stream timing of benchmarks/gpu_attention.py (µs per call, log scale, each method at each
capacity and context; the kernel's share of the copy bandwidth above its bar); right, where a call's
time goes at one context, from benchmarks/gpu_attention_trace.py (per-CTA medians of each phase, the
merge of the slowest CTA, and the graph's gap between kernels: the call's time less the kernel's
span), beside a copy of the same bytes.

    python benchmarks/plot_attention.py --result attn.json --trace trace.json -o docs/img/decode_attention.png \
        [--capacity 4096 --context 4000]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METHODS = ["native", "kernel", "kernel (workspace)", "sdpa", "triton (runtime)", "copy (same bytes)"]
LABELS = {"kernel": "run", "kernel (workspace)": "run_workspace", "sdpa": "torch SDPA",
          "triton (runtime)": "runtime's Triton", "copy (same bytes)": "copy of the same bytes"}
# trace phases (benchmarks/gpu_attention_trace.py's marks) in call order; the merge's is the slowest CTA's
PHASES = [("0->1", "length read", "median_ns"), ("1->2", "first block", "median_ns"),
          ("2->3", "rest of the stream", "median_ns"), ("3->4", "warps' merge", "median_ns"),
          ("4->5", "ticket / barrier", "median_ns"), ("5->6", "merge over splits", "max_ns")]


def stream_panel(ax, rows: list[dict]) -> None:
    width = 0.8 / len(METHODS)
    for i, m in enumerate(METHODS):
        xs = [j + (i - (len(METHODS) - 1) / 2) * width for j in range(len(rows))]
        ys = [r[m]["us_per_call"] for r in rows]
        ax.bar(xs, ys, width, label=LABELS.get(m, m))
        if m.startswith("kernel"):
            for x, r in zip(xs, rows):
                ax.text(x, r[m]["us_per_call"] * 1.08, f"{r[m]['fraction_of_copy_bw']:.0%}",
                        ha="center", fontsize=6, rotation=90)
    ax.set_xticks(range(len(rows)), [f"C {r['capacity']:,}\n{r['context']:,} keys" for r in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (36 calls in a CUDA graph, one cache each)")
    ax.set_title("Stream timing (kernel bars: share of copy bandwidth)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)


def trace_panel(ax, traces: list[dict], copy_us: float, capacity: int, context: int) -> None:
    for y, t in enumerate(traces):
        left = 0.0
        segments = [("graph's gap", t["us_per_call"] - t["span_ns"] / 1e3)]
        segments += [(label, t[key][stat] / 1e3) for key, label, stat in PHASES if key in t]
        for k, (label, us) in enumerate(segments):
            ax.barh(y, us, left=left, color=f"C{k}", label=label if y == 0 else None)
            left += us
    ax.axvline(copy_us, color="k", ls="--", lw=1, label=f"copy of the same bytes ({copy_us:.2f} µs)")
    ax.set_yticks(range(len(traces)), [t["export"] for t in traces])
    ax.set_xlabel("µs")
    ax.set_title(f"Where a call's time goes (capacity {capacity:,}, {context:,} keys)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)


def save(fig, out: str, dpi: int) -> None:
    """The figure laid out and written to `out` (its folder made), announced."""
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    print(f"wrote {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--result", required=True, help="benchmarks/gpu_attention.py's JSON")
    ap.add_argument("--trace", required=True, help="benchmarks/gpu_attention_trace.py's JSON")
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    result = json.loads(Path(args.result).read_text())
    traces = [t for t in json.loads(Path(args.trace).read_text())["rows"]
              if t["capacity"] == args.capacity and t["context"] == args.context]
    row = next(r for r in result["stream_timing"]
               if r["capacity"] == args.capacity and r["context"] == args.context)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    stream_panel(left, result["stream_timing"])
    trace_panel(right, traces, row["copy (same bytes)"]["us_per_call"], args.capacity, args.context)
    fig.suptitle(f"Hopper decode attention, {result['gpu']}, {result['date']} (Qwen3-8B dims: 32 query "
                 f"heads, 8 KV heads, head dim 128, BF16)", fontsize=10)
    save(fig, args.out, dpi=130)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
