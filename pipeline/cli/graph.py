"""`trtmc graph inspect | list | recipes | select | definition`: thin wrappers over pipeline.graph
(and pipeline.families.definition, for a region's FlashInfer-Bench Definition)."""
from __future__ import annotations

import argparse
import os

from pipeline.cli.args import (add_build_options, add_json, build_options, count, example,
                               print_json, roles_help)
from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.families import definition
from pipeline.files import refuse_overwriting, replaced
from pipeline.graph import listing, snapshot
from pipeline.graph import select as selection

GRAPH = "artifacts/minilm.graph.json"


def _load_snapshot(path) -> dict:
    return snapshot.load(path)


def _inspect(args) -> None:
    from pipeline.families.capture import capture_role
    model = [args.model] if os.path.exists(args.model) else []  # a hub id names no path here
    refuse_overwriting(args.snapshot, model, "--snapshot")
    captured = capture_role(args.model, args.model_revision, args.engine_role, build_options(args))
    snap = captured.snapshot
    snapshot.save(snap, args.snapshot)
    print(f"wrote {args.snapshot}: engine role {snap['engine_role']}, {len(snap['nodes'])} nodes, "
          f"{len(snap['tensors'])} tensors, {len(snap['recipes'])} recipes, "
          f"fingerprint {snap['fingerprint'][:16]}")


def _print_lines(lines) -> None:
    """One line at a time: a listing is never held whole."""
    for line in lines:
        print(line)


def _list(args) -> None:
    records = listing.node_records(_load_snapshot(args.snapshot), args.match)
    if not records:
        raise UserError(f"{args.snapshot}: no node matches --match {args.match!r} "
                        f"(it is tested against the id, the OP and the name)"
                        if args.match is not None else f"{args.snapshot}: the snapshot has no nodes")
    if args.json:
        print_json(records)
    else:
        _print_lines(listing.list_nodes(records))


def _recipes(args) -> None:
    snap = _load_snapshot(args.snapshot)
    if args.json:
        print_json(snap["recipes"])
    else:
        _print_lines(listing.list_recipes(snap))


def _extra_arg(text: str):
    try:  # strict, as every JSON read: a repeated key is refused, not resolved to its last value
        return jsonio.parse_json(text.encode(), None, "JSON")
    except UserError as e:  # argparse names the flag: drop the "JSON: " the message starts with
        raise argparse.ArgumentTypeError(
            f"{jsonio.excerpt(repr(text), 80)}: {str(e).removeprefix('JSON: ')} "
            f"(e.g. '{{\"type\":\"int\",\"value\":32}}')") from None


def _select(args) -> None:
    refuse_overwriting(args.output, [args.snapshot], "output")
    if args.definition is not None:
        refuse_overwriting(args.definition, [args.snapshot], "--definition")
        if replaced(args.definition) == replaced(args.output):
            raise UserError(f"--definition {args.definition}: is the receipt's path (-o); "
                            f"expected a path of its own")
    snap = _load_snapshot(args.snapshot)
    receipt = selection.select_region(
        snap, listing.resolve_nodes(snap, args.nodes), binding_id=args.binding_id,
        workspace_bytes=args.workspace_bytes, extra_args=args.extra_arg,
        output_shape_like_input=args.output_shape_like_input, source=str(args.snapshot))
    # made before anything is written: a region without a reference leaves no receipt behind
    doc = None if args.definition is None else \
        definition.definition_of(receipt, str(args.output), snapshot=snap)
    selection.save_receipt(receipt, args.output)
    if doc is not None:
        definition.save_definition(doc, args.definition)
    if args.json:
        print_json(receipt.to_json())
        return
    print(f"wrote {args.output}: binding {receipt.binding_id}, "
          f"abi sha256 {receipt.abi_sha256}")
    if doc is not None:
        print(_definition_line(args.definition, doc))
    print(selection.format_contract(receipt))


def _definition_line(path, doc: dict) -> str:
    axes = ", ".join(f"{name}={axis['value']}" if axis["type"] == "const" else f"{name} var"
                     for name, axis in doc["axes"].items())
    return f"wrote {path}: FlashInfer-Bench Definition {doc['name']} (type {doc['type']}; {axes})"


def _definition(args) -> None:
    refuse_overwriting(args.output, [args.selection], "output")
    print(_definition_line(args.output, definition.write_definition(args.selection, args.output)))


def register(subparsers) -> None:
    graph = subparsers.add_parser("graph", help="capture, list and select regions of a network")
    sub = graph.add_subparsers(dest="graph_command", required=True, metavar="SUBCOMMAND")

    p = sub.add_parser("inspect", help="capture one engine role's network as a graph snapshot",
                       description="Capture the network of one engine role as a graph snapshot "
                                   "(no weights needed, no engine built).",
                       epilog=example(f"trtmc graph inspect --snapshot {GRAPH} --engine-role decode "
                                      f"builtin:all-MiniLM-L6-v2 --sequence-length 128"))
    p.add_argument("model", metavar="MODEL",
                   help="local HF directory, builtin:all-MiniLM-L6-v2, or hub id ORG/NAME "
                        "(offline cache)")
    p.add_argument("--snapshot", required=True, metavar="graph.json", help="the snapshot to write")
    p.add_argument("--engine-role", required=True, metavar="ROLE", type=str.lower,
                   help=roles_help())
    add_build_options(p)
    p.set_defaults(func=_inspect)

    p = sub.add_parser("list", help="one row per node: id, op, name, tensors",
                       description="A header, then one row per node: NODE OP NAME and its input "
                                   "and output tensors with dtype and shape. Display only: "
                                   "--match never selects nodes.",
                       epilog=example(f"trtmc graph list {GRAPH} --match '*residual*'",
                                      f"trtmc graph list {GRAPH} --json | jq '.[0].outputs'"))
    p.add_argument("snapshot", metavar="graph.json", help="a snapshot from `graph inspect`")
    p.add_argument("--match", metavar="GLOB",
                   help="show only nodes whose id, OP or name matches this fnmatch glob "
                        "(default: all nodes)")
    add_json(p, "the nodes and their tensors")
    p.set_defaults(func=_list)

    p = sub.add_parser("recipes", help="the recipes the family recorded",
                       description="The recipes the family recorded: RECIPE INSTANCE NODES "
                                   "(NODES as `graph select --nodes` takes them).",
                       epilog=example("trtmc graph recipes decode.graph.json"))
    p.add_argument("snapshot", metavar="graph.json", help="a snapshot from `graph inspect`")
    add_json(p, "the recipes")
    p.set_defaults(func=_recipes)

    p = sub.add_parser("select", help="validate a region and write its selection receipt",
                       description="Validate a region (connected, convex, one output) and write "
                                   "its selection receipt; print the kernel's ABI call order.",
                       epilog=example(f"trtmc graph select {GRAPH} --nodes node:62 --binding-id "
                                      f"l0_residual --workspace-bytes 0 -o l0.selection.json",
                                      f"trtmc graph select {GRAPH} --nodes "
                                      f"'encoder.layers.0.attention_residual_add' --binding-id "
                                      f"l0_residual --workspace-bytes 0 -o l0.selection.json"))
    p.add_argument("snapshot", metavar="graph.json", help="a snapshot from `graph inspect`")
    p.add_argument("--nodes", nargs="+", required=True, metavar="NODE",
                   help="node ids (node:N), node names or fnmatch globs (on id, OP or name), "
                        "space- or comma-separated as `graph recipes` prints them")
    p.add_argument("--binding-id", required=True, metavar="ID",
                   help="the slot's id that a binding manifest names (letters, digits, _ . : @ -)")
    p.add_argument("--workspace-bytes", type=count(0, selection.MAX_WORKSPACE_BYTES),
                   required=True, metavar="N",
                   help="bytes of the uint8 device workspace passed after the inputs (0: none; "
                        "at most 256 MiB)")
    p.add_argument("--output-shape-like-input", type=count(0, 255), metavar="I",
                   help="for a dynamic output: the index of the input whose dtype and shape it "
                        "has (default: none; required when the output shape has a -1)")
    p.add_argument("--extra-arg", type=_extra_arg, action="append", default=[], metavar="JSON",
                   help='a fixed scalar argument after the outputs, e.g. \'{"type":"int",'
                        '"value":32}\'; types: int, float, none, ptr (null); repeat in call order '
                        '(default: none)')
    p.add_argument("-o", "--output", required=True, metavar="sel.json",
                   help="the selection receipt to write")
    p.add_argument("--definition", metavar="def.json",
                   help="also write the region's FlashInfer-Bench Definition (only for a recorded "
                        "instance of a recipe whose semantics its family states; otherwise "
                        "nothing is written; default: none)")
    add_json(p, "the receipt")
    p.set_defaults(func=_select)

    p = sub.add_parser("definition", help="write a selection's region as a FlashInfer-Bench Definition",
                       description="Write the region of a selection (a receipt, or a selection set: "
                                   "one Definition for its instances) as a FlashInfer-Bench "
                                   "Definition: axes from the ABI (a fixed dim a const axis, a "
                                   "dynamic one a var axis), the inputs and outputs in call order, "
                                   "and the family's reference. Only a recorded instance of a "
                                   "recipe whose semantics its family states has one.",
                       epilog=example("trtmc graph definition work/selection.json -o "
                                      "work/decode_attention.definition.json"))
    p.add_argument("selection", metavar="SELECTION.json",
                   help="a selection receipt or selection set (`graph select`, a spec's select stage)")
    p.add_argument("-o", "--output", required=True, metavar="def.json",
                   help="the Definition to write")
    p.set_defaults(func=_definition)
