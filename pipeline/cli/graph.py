"""`trtmc graph inspect | list | recipes | select`: thin wrappers over pipeline.graph."""
from __future__ import annotations

import argparse

import orjson

from pipeline.cli.args import add_build_options, build_options
from pipeline.errors import UserError
from pipeline.graph import listing
from pipeline.graph import select as selection

def _load_snapshot(path) -> dict:
    from pipeline.graph import snapshot
    return snapshot.load(path)


def _inspect(args) -> None:
    from pipeline.graph import snapshot
    from pipeline.families.capture import capture_role
    captured = capture_role(args.model, args.model_revision, args.engine_role, build_options(args))
    snap = captured.snapshot
    snapshot.save(snap, args.snapshot)
    print(f"wrote {args.snapshot}: engine role {snap['engine_role']}, {len(snap['nodes'])} nodes, "
          f"{len(snap['tensors'])} tensors, {len(snap['recipes'])} recipes, "
          f"fingerprint {snap['fingerprint'][:16]}")


def _list(args) -> None:
    rows = listing.list_nodes(_load_snapshot(args.snapshot), args.match)
    if not rows:
        raise UserError(f"{args.snapshot}: no node matches --match {args.match!r} "
                        f"(it is tested against the id, the OP and the name)")
    print("\n".join(rows))


def _recipes(args) -> None:
    print("\n".join(listing.list_recipes(_load_snapshot(args.snapshot))))


def _extra_arg(text: str):
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not JSON (e.g. '{{\"type\":\"int\",\"value\":32}}')") from None


def _select(args) -> None:
    snap = _load_snapshot(args.snapshot)
    nodes = [n for arg in args.nodes for n in arg.split(",") if n]  # as `graph recipes` prints them
    receipt = selection.select_region(
        snap, nodes, binding_id=args.binding_id, workspace_bytes=args.workspace_bytes,
        extra_args=args.extra_arg, output_shape_like_input=args.output_shape_like_input,
        source=str(args.snapshot))
    selection.save_receipt(receipt, args.output)
    print(f"wrote {args.output}: binding {receipt['binding_id']}, "
          f"abi sha256 {receipt['abi_sha256']}")
    print(selection.format_contract(receipt))


def register(subparsers) -> None:
    graph = subparsers.add_parser("graph", help="capture, list and select regions of a network")
    sub = graph.add_subparsers(dest="graph_command", required=True, metavar="SUBCOMMAND")

    p = sub.add_parser("inspect", help="capture one engine role's network as a graph snapshot")
    p.add_argument("model", metavar="MODEL", help="model directory or hub id ORG/NAME")
    p.add_argument("--snapshot", required=True, metavar="graph.json")
    p.add_argument("--engine-role", required=True, metavar="ROLE")
    add_build_options(p)
    p.set_defaults(func=_inspect)

    p = sub.add_parser("list", help="one row per node: id, op, tensors, name")
    p.add_argument("snapshot", metavar="graph.json")
    p.add_argument("--match", metavar="GLOB", help="fnmatch glob on the id, op or name")
    p.set_defaults(func=_list)

    p = sub.add_parser("recipes", help="the recipes the family recorded")
    p.add_argument("snapshot", metavar="graph.json")
    p.set_defaults(func=_recipes)

    p = sub.add_parser("select", help="validate a region and write its selection receipt")
    p.add_argument("snapshot", metavar="graph.json")
    p.add_argument("--nodes", nargs="+", required=True, metavar="node:N")
    p.add_argument("--binding-id", required=True, metavar="ID")
    p.add_argument("--workspace-bytes", type=int, required=True, metavar="N")
    p.add_argument("--output-shape-like-input", type=int, metavar="I")
    p.add_argument("--extra-arg", type=_extra_arg, action="append", default=[], metavar="JSON")
    p.add_argument("-o", "--output", required=True, metavar="sel.json")
    p.set_defaults(func=_select)
