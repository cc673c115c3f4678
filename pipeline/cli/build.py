"""`trtmc build`: a native or slot-ready bundle from MODEL + build options."""
from __future__ import annotations

from pathlib import Path

from pipeline.bundle import layout
from pipeline.cli.args import add_build_options, build_options, example
from pipeline.errors import UserError
from pipeline.files import refuse_overwriting
from pipeline.graph import select


def run(args) -> int:
    from pipeline.bundle.writer import build_bundle
    out = Path(args.output)
    if not out.name.endswith(".bundle") or out.name == ".bundle":
        raise UserError(f"-o {out}: a bundle path must be a name ending in .bundle")
    refuse_overwriting(out, [args.model if Path(args.model).exists() else None, args.graph_patch],
                       "output")
    options = build_options(args)
    receipt = None
    if args.graph_patch:
        receipt = select.load_selection(args.graph_patch)
    elif args.recipe:
        receipt = _recipe_selection(args, options)
    build_bundle(args.model, args.model_revision, options, out, selection=receipt,
                 weights=args.weights)
    if receipt is not None:
        sel_path = layout.selection_path(out)
        select.save_selection(receipt, sel_path)
        receipts = select.receipts_of(receipt)
        many = "" if isinstance(receipt, select.SelectionReceipt) else \
            f" ({len(receipts)} instances: {', '.join(r.instance for r in receipts)})"
        print(f"slot-ready bundle {out}; selection {sel_path}{many}")
        print(select.format_contract(receipts[0]))
    else:
        print(f"native bundle {out}")
    return 0


def _recipe_selection(args, options: dict):
    """`--recipe ID INSTANCE` one receipt, as ever; `--recipe ID I1 I2 ...` or `--recipe ID
    --all-instances` the receipts of many instances under one binding id."""
    from pipeline.families.capture import recipe_receipt
    recipe_id, *instances = args.recipe
    if args.all_instances == bool(instances):
        raise UserError(f"--recipe {' '.join(args.recipe)}: give INSTANCE_ID... or "
                        f"--all-instances (one of them)", param="recipe")
    if args.expect_count is not None and not args.all_instances and len(instances) < 2:
        raise UserError("--expect-count: needs --all-instances or several instances",
                        param="expect_count")
    if len(instances) == 1:
        return recipe_receipt(args.model, args.model_revision, options, recipe_id, instances[0],
                              binding_id=args.binding_id)
    return recipe_receipt(args.model, args.model_revision, options, recipe_id,
                          binding_id=args.binding_id, expect_count=args.expect_count,
                          instances="all" if args.all_instances else instances)


def register(sub) -> None:
    p = sub.add_parser("build", help="build a native or slot-ready bundle",
                       description="Build a bundle: native, or slot-ready with one region replaced "
                                   "by a kernel slot (--graph-patch or --recipe), or every "
                                   "instance of a recipe by one slot each; a slot-ready "
                                   "build also writes X.selection.json next to the bundle.",
                       epilog=example("trtmc build builtin:all-MiniLM-L6-v2 --sequence-length 128 "
                                      "-o minilm.bundle",
                                      "trtmc build Qwen/Qwen3-8B --model-revision REV --recipe "
                                      "qwen.decode_logits_copy@1 decoder.logits_zero_bias "
                                      "-o qwen3-slot-ready.bundle"))
    p.add_argument("model", metavar="MODEL",
                   help="local HF directory, builtin:all-MiniLM-L6-v2, or hub id ORG/NAME "
                        "(offline cache)")
    add_build_options(p)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--graph-patch", metavar="SEL",
                       help="selection receipt to patch in (default: a native bundle)")
    group.add_argument("--recipe", nargs="+", metavar=("RECIPE_ID", "INSTANCE_ID"),
                       help="select a recorded recipe instance (see `trtmc graph recipes`); "
                            "several instance ids, or --all-instances, put one slot in each "
                            "under one binding id")
    p.add_argument("--all-instances", action="store_true",
                   help="with --recipe RECIPE_ID: every recorded instance of the recipe")
    p.add_argument("--expect-count", type=int, metavar="N",
                   help="refuse, writing nothing, unless the instances number N")
    p.add_argument("--binding-id", metavar="ID", help="binding id for --recipe (default: the recipe id)")
    p.add_argument("--weights", choices=("embed", "reference"), default=None, type=str.lower,
                   help="embed weights, or reference checkpoint tensors by name + digest "
                        "(default: embed up to 2 GiB of checkpoint, reference above)")
    p.add_argument("-o", "--output", required=True, metavar="X.bundle",
                   help="the bundle directory to write (its name ends in .bundle)")
    p.set_defaults(func=run)
