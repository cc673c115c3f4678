"""`trtmc bind check`: the region probe of every slot against its bound kernel."""
from __future__ import annotations

import orjson

from pipeline.cli.args import add_pipeline_options


def run_check(args) -> int:
    from pipeline.gates.probe import region_probe
    from pipeline.runtime.pipeline import open_pipeline
    report = region_probe(open_pipeline(args.bundle, args.kernel_bindings, args.device,
                                        args.checkpoint), args.seed)
    for r in report["slots"]:
        verdict = "PASS" if r["passed"] else "FAIL"
        extra = f", {r['unwritten_elements']} elements never written" if r["unwritten_elements"] else ""
        print(f"{verdict}  {r['binding_id']}  {r['dtype']} {r['shape']}  max|diff| {r['max_abs_diff']:.3g}"
              f"  tolerance {r['tolerance']:.3g}{extra}")
    if args.report:
        from pipeline.files import atomic_write_bytes
        atomic_write_bytes(args.report, orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0 if report["passed"] else 1


def run_manifest(args) -> int:
    from pipeline.kernels.manifest import write_manifest
    from pipeline.graph.select import load_receipt
    receipts = [load_receipt(sel) for sel in args.selection]
    path = write_manifest(args.output, receipts, args.library, args.function)
    print(f"wrote {path}: {', '.join(r['binding_id'] for r in receipts)} -> {args.library}:{args.function}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("bind", help="check kernel bindings of a slot-ready bundle")
    s = p.add_subparsers(dest="bind_command", required=True, metavar="SUBCOMMAND")
    c = s.add_parser("check", help="region probe: native region vs bound kernel on random inputs")
    add_pipeline_options(c)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--report", help="also write the probe report as JSON here")
    c.set_defaults(func=run_check)
    m = s.add_parser("manifest", help="write a binding manifest for selection receipts")
    m.add_argument("selection", nargs="+", metavar="SEL", help="selection receipt(s) to bind")
    m.add_argument("--library", required=True, metavar="X.so",
                   help="the DSO; must lie in the manifest's folder")
    m.add_argument("--function", default="run", help="exported function name (default: run)")
    m.add_argument("-o", "--output", required=True, metavar="M.json")
    m.set_defaults(func=run_manifest)
