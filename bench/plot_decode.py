"""Tokens/s by mode from gpu_qwen3_8b.py results, as a bar chart (docs/performance.md shows it).

    python bench/plot_decode.py RESULT.json [more result files] -o docs/img/qwen3_8b_tokens_per_s.png \
        [--labels NAME,...] [--copy-bytes-per-s 4.16e12]

One group of bars per result file (its label, capacity and prompt), one bar per mode (128-token prompt
and, when the run had one, the long prompt), transformers where it was timed; a dashed line is
the roofline: bytes a decode step reads (the weights without the embedding table, of which a
step reads one row) at the copy bandwidth given.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def bars(result: dict, name: str) -> list[tuple[str, float]]:
    capacity = result["options"]["max_cache_length"]
    rows = [(f"{mode}\n{result['prompt_tokens']}-token prompt", result[mode]["tokens_per_s"])
            for mode in result["tokens_equal_reference"]]
    long = result.get("long_context") or {}
    rows += [(f"{mode}\n{long['prompt_tokens']}-token prompt", long[mode]["tokens_per_s"])
             for mode in result["tokens_equal_reference"] if mode in long]
    if "transformers" in result:
        rows.append((f"transformers {result['transformers']['transformers']}\nstatic cache + compile",
                     result["transformers"]["tokens_per_s"]))
    return [(f"{name}\ncapacity {capacity:,}\n{label}", v) for label, v in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--labels", type=lambda v: v.split(","), default=None,
                    help="comma-separated, one per result file (default: the file names)")
    ap.add_argument("--copy-bytes-per-s", type=float, default=None,
                    help="copy bandwidth measured the same day (draws the roofline; default: the "
                         "first result's own copy_bytes_per_s, when it timed one)")
    args = ap.parse_args()
    results = [json.loads(Path(p).read_text()) for p in args.results]
    labels = args.labels or [Path(p).stem for p in args.results]
    rows = [row for r, name in zip(results, labels) for row in bars(r, name)]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.5))
    colors = ["#4477aa" if "\noptimized" in label else "#bbbbbb" if "transformers" in label
              else "#cc6677" for label, _ in rows]
    ax.bar(range(len(rows)), [v for _, v in rows], color=colors)
    for i, (_, v) in enumerate(rows):
        ax.text(i, v + 2, f"{v:.1f}", ha="center", fontsize=8)
    copy = args.copy_bytes_per_s or results[0].get("copy_bytes_per_s")
    if copy:
        # the result's roofline is at gpu_qwen3_8b.HBM_BYTES_PER_S (4.8e12): rescale it
        roof = results[0]["roofline_tokens_per_s_without_embedding"] * copy / 4.8e12
        ax.axhline(roof, ls="--", color="black", lw=1)
        ax.text(len(rows) - 0.5, roof + 2, f"roofline {roof:.0f}", ha="right", fontsize=8)
    ax.set_xticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(f"Qwen3-8B dims, bf16, {results[0]['gpu']}, {results[0]['date']}", fontsize=10)
    save(fig, args.out, dpi=120)
    return 0


def save(fig, out: str, dpi: int) -> None:
    """The figure laid out and written to `out` (its folder made), announced."""
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
