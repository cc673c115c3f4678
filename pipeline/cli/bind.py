"""`trtmc bind check | manifest`: probe bound kernels against their regions; write a manifest."""
from __future__ import annotations

from pipeline import jsonio
from pipeline.cli.args import (SEED, add_json, add_pipeline_options, example, pipeline_inputs,
                               print_json)
from pipeline.files import refuse_overwriting
from pipeline.graph.select import load_selection, receipts_of
from pipeline.host import open_pipeline
from pipeline.kernels.manifest import write_manifest


def run_check(args) -> int:
    from pipeline.gates.probe import region_probe
    if args.report:
        refuse_overwriting(args.report, pipeline_inputs(args), "--report")
    with open_pipeline(args.bundle, args.kernel_bindings, args.device, args.checkpoint,
                       what="trtmc bind") as pipe:
        report = region_probe(pipe, args.seed)
    if args.json:
        print_json(report.to_json())
    else:
        for r in report.slots:
            verdict = "PASS" if r.passed else "FAIL"
            extra = f", {r.unwritten_elements} elements never written" if r.unwritten_elements else ""
            print(f"{verdict}  {r.binding_id}  {r.dtype} {r.shape}  max|diff| "
                  f"{r.max_abs_diff:.3g}  tolerance {r.tolerance:.3g}{extra}")
    if args.report:
        jsonio.write_json(args.report, report.to_json(), None)
    return 0 if report.passed else 1


def run_manifest(args) -> int:
    refuse_overwriting(args.output, [args.library, *args.selection], "output")
    receipts = [receipts_of(load_selection(sel))[0] for sel in args.selection]  # an id once
    path = write_manifest(args.output, receipts, args.library, args.function)
    print(f"wrote {path}: {', '.join(r.binding_id for r in receipts)} -> {args.library}:{args.function}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("bind", help="binding manifests and kernel checks of a slot-ready bundle")
    s = p.add_subparsers(dest="bind_command", required=True, metavar="SUBCOMMAND")
    c = s.add_parser("check", help="region probe: native region vs bound kernel on random inputs",
                     epilog=example("trtmc bind check slot.bundle --kernel-bindings "
                                    "kernel/bindings.json --device cpu"))
    add_pipeline_options(c)
    c.add_argument("--seed", type=SEED, default=0, help="seed of the random probe inputs")
    c.add_argument("--report", metavar="probe.json", help="also write the probe report as JSON here")
    add_json(c, "the probe report")
    c.set_defaults(func=run_check)
    m = s.add_parser("manifest", help="write a binding manifest for selection receipts",
                     epilog=example("trtmc bind manifest l0.selection.json --library kernel/k.so "
                                    "-o kernel/bindings.json"))
    m.add_argument("selection", nargs="+", metavar="SEL", help="selection receipt(s) to bind")
    m.add_argument("--library", required=True, metavar="X.so",
                   help="the DSO; must lie in the manifest's folder")
    m.add_argument("--function", default="run", help="exported function name")
    m.add_argument("-o", "--output", required=True, metavar="M.json", help="the manifest to write")
    m.set_defaults(func=run_manifest)
