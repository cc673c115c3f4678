"""`trtmc matrix SPEC... [--ray ADDRESS] [-o DIR]`: many specs' pipelines, one task each, here
or on a Ray cluster; the results in one folder."""
from __future__ import annotations

from pipeline.cli.args import add_ray_options, example, ray_init
from pipeline.errors import UserError
from pipeline.flow.matrix import SUMMARY, summary
from pipeline.flow.matrix import run_matrix as run


def run_matrix(args) -> int:
    if args.ray is None and args.ray_init:
        raise UserError("--ray-init: only with --ray local (a private cluster started here)")
    rc, entries = run(args.specs, args.output, ray_address=args.ray,
                      ray_init=ray_init(args.ray_init), gpu_models=args.gpu_model,
                      in_place=args.in_place)
    print(summary(entries), end="")
    print(f"results: {args.output}/ ({SUMMARY}, junit.xml, one folder per spec)")
    return rc


def register(sub) -> None:
    p = sub.add_parser(
        "matrix", help="run many specs' pipelines, one task each, here or on a Ray cluster",
        description="One task per spec, each running that spec's pipeline (`trtmc pipeline`): "
                    "with --ray on a Ray cluster (the code and each spec's inputs shipped with "
                    "the job; a GPU spec on a worker with a GPU of its own), without it here, one "
                    "after another. Under DIR: one folder per spec (its reports, promotion "
                    "receipt, ledger and pipeline.log), junit.xml (every gate's testcases, and "
                    "one per spec that did not finish) and summary.md (also printed). A spec "
                    "that does not load, fails a stage or whose worker dies is one line of the "
                    "summary; the others still run. Exit status: 0 every spec promoted, 1 "
                    "otherwise, 2 a mistake in the command line. See docs/matrix.md.",
        epilog=example("trtmc matrix a.json b.json -o results",
                       "trtmc matrix specs/*.json --ray local -o results",
                       "trtmc matrix specs/*.json --ray ray://head:10001 --gpu-model H200 -o results",
                       "trtmc matrix specs/*.json --ray local --in-place -o results"))
    p.add_argument("specs", nargs="+", metavar="SPEC", help="pipeline spec files (*.json)")
    p.add_argument("-o", "--output", metavar="DIR", default="matrix",
                   help="folder of the results (each spec's folder in it is replaced)")
    add_ray_options(p)
    p.add_argument("--in-place", action="store_true",
                   help="with --ray: run each spec where it is, on its own output folder and doit "
                        "database, instead of shipped copies: what a CPU job built there is "
                        "reused and only the machine's own stages run (one node, or a shared file "
                        "system; default: ship the code and each spec's inputs)")
    p.set_defaults(func=run_matrix)
