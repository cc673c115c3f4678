"""The region validator and the selection receipt: the one gate every selection goes through.

Manual `--nodes`, `--recipe` and the doit tasks all end in `select_region`, which applies every
region rule (docs/pipeline.md, "Region rules") to a graph snapshot and returns the receipt a
kernel is built and bound against. Every rejection is a UserError naming the node, tensor or path at fault.
"""
from __future__ import annotations

import json
import re
from collections import deque
from typing import Any, Mapping, Sequence

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.graph.abi import BINDING_ID_PATTERN, abi_of, abi_sha256, check_extra_args
from pipeline.graph.bounds import ABI_LIMITS
from pipeline.graph.model import Graph
# the receipt's type and its file's schemas (graph/receipt.py), named here too: the one validator
from pipeline.graph.receipt import (SCHEMA, SCHEMA_VERSION, SET_SCHEMA, SelectionReceipt,  # noqa: F401
                                    SelectionSet, check_instances)

# the ABI's bounds, as the selection schema's $defs declare them (graph/bounds.py: ABI_LIMITS)
BOUNDARY_DTYPES = ABI_LIMITS.dtypes
MAX_RANK = ABI_LIMITS.max_rank
BINDING_ID = re.compile(BINDING_ID_PATTERN)  # whole string (fullmatch)
# real kernels use a few MB (decode attention at Qwen3-8B: 260 KiB); every gated call allocates it
MAX_WORKSPACE_BYTES = ABI_LIMITS.max_workspace_bytes
# Layer types a kernel slot cannot replace: control flow, collectives, plugins.
LOOP_TYPES = ("TRIP_LIMIT", "RECURRENCE", "ITERATOR", "LOOP_OUTPUT")
CONDITIONAL_TYPES = ("CONDITION", "CONDITIONAL_INPUT", "CONDITIONAL_OUTPUT")
FORBIDDEN_TYPES = {
    **{t: "a loop layer" for t in LOOP_TYPES},
    **{t: "a conditional layer" for t in CONDITIONAL_TYPES},
    "DIST_COLLECTIVE": "a collective layer",
    "PLUGIN": "a plugin layer", "PLUGIN_V2": "a plugin layer", "PLUGIN_V3": "a plugin layer",
}
# Control-flow layers whose outputs open a loop body or a conditional branch.
_BODY_OPENERS = {"RECURRENCE": "loop body", "ITERATOR": "loop body",
                 "CONDITIONAL_INPUT": "conditional branch"}


def _check_nodes(g: Graph, nodes, where: str) -> list[str]:
    if not isinstance(nodes, (list, tuple)) or not nodes:
        raise UserError(f"{where}: no nodes selected (expected one or more node ids like node:12)")
    seen = set()
    for n in nodes:
        if n not in g.nodes:
            raise UserError(f"{where}: node {n!r} does not exist in the graph (ids run node:0.."
                            f"node:{len(g.nodes) - 1}; see `trtmc graph list`)")
        if n in seen:
            raise UserError(f"{where}: node {n} is selected twice")
        seen.add(n)
    return sorted(nodes, key=g.order.__getitem__)


def _check_layer_types(g: Graph, region: list[str], where: str) -> None:
    for n in region:
        kind = FORBIDDEN_TYPES.get(g.nodes[n]["type"])
        if kind:
            raise UserError(f"{where}: {g.describe(n)} is {kind}; a kernel slot cannot contain it")
    # Ordinary layers inside a loop body or conditional branch run under that control flow.
    openers = [n for n in g.nodes if g.nodes[n]["type"] in _BODY_OPENERS]
    for opener in openers:
        seen, queue = set(), deque(g.successors(opener))
        while queue:
            n = queue.popleft()
            if n in seen or g.nodes[n]["type"] in FORBIDDEN_TYPES:
                continue
            seen.add(n)
            if n in region:
                raise UserError(f"{where}: {g.describe(n)} is inside a "
                                f"{_BODY_OPENERS[g.nodes[opener]['type']]} (opened by "
                                f"{g.describe(opener)}); a kernel slot cannot contain control flow")
            queue.extend(g.successors(n))


def _check_connected(g: Graph, region: list[str], where: str) -> None:
    inside = set(region)
    reached, stack = {region[0]}, [region[0]]
    while stack:
        n = stack.pop()
        node = g.nodes[n]
        neighbours = [g.producer.get(t) for t in node["inputs"] if t is not None]
        neighbours += [c for t in node["outputs"] for c in g.consumers.get(t, ())]
        for m in neighbours:
            if m in inside and m not in reached:
                reached.add(m)
                stack.append(m)
    apart = [n for n in region if n not in reached]
    if apart:
        raise UserError(f"{where}: the nodes are not connected: {apart[0]} shares no tensor with "
                        f"the region of {region[0]} (select a connected set of nodes)")


def _check_convex(g: Graph, region: list[str], where: str) -> None:
    """Breadth-first from the region's outside consumers; reaching the region again is a path
    that leaves and re-enters it, which no single kernel call can execute."""
    inside = set(region)
    parent: dict[str, str] = {}
    queue: deque[str] = deque()
    for r in region:
        for s in g.successors(r):
            if s not in inside and s not in parent:
                parent[s] = r
                queue.append(s)
    while queue:
        n = queue.popleft()
        for s in g.successors(n):
            if s in inside:
                path = [s, n]
                while path[-1] not in inside:
                    path.append(parent[path[-1]])
                raise UserError(f"{where}: the region is not convex: the path "
                                f"{' -> '.join(reversed(path))} leaves the region and re-enters it "
                                f"(add the nodes on it to the selection, or drop one end)")
            if s not in parent:
                parent[s] = n
                queue.append(s)


def _boundary(g: Graph, region: list[str]) -> tuple[list[str], list[str]]:
    """Inputs in order of first use (node order, then input index); outputs in production order."""
    inside = set(region)
    produced = {t for n in region for t in g.nodes[n]["outputs"]}
    inputs = []
    for n in region:
        for t in g.nodes[n]["inputs"]:
            if t is not None and t not in produced and t not in inputs:
                inputs.append(t)
    outputs = [t for n in region for t in g.nodes[n]["outputs"]
               if g.tensors[t]["is_network_output"]
               or any(c not in inside for c in g.consumers.get(t, ()))]
    return inputs, outputs


def _check_outputs(g: Graph, outputs: list[str], where: str) -> None:
    for t in outputs:
        if g.tensors[t]["is_network_output"]:
            raise UserError(f"{where}: the region produces network output {g.tensor(t)} (from "
                            f"{g.producer[t]}); a kernel slot must feed a layer of the network")
    if len(outputs) != 1:
        listed = (": " + ", ".join(f"{g.tensor(t)} from {g.producer[t]}" for t in outputs)
                  if outputs else " (nothing outside it uses what it produces)")
        raise UserError(f"{where}: the region has {len(outputs)} output tensors{listed}; "
                        f"a kernel slot has exactly one")


def _check_tensors(g: Graph, region: list[str], boundary: list[str], where: str) -> None:
    for n in region:
        node = g.nodes[n]
        for t in [t for t in node["inputs"] if t is not None] + node["outputs"]:
            info = g.tensors[t]
            if info["is_shape_tensor"]:
                raise UserError(f"{where}: {n} touches shape tensor {g.tensor(t)}; a kernel slot "
                                f"works on execution tensors only")
            if info["location"] != "DEVICE":
                raise UserError(f"{where}: {n} touches host tensor {g.tensor(t)} (location "
                                f"{info['location']}); a kernel slot works on device tensors only")
    for t in boundary:
        info = g.tensors[t]
        if info["format"] != "LINEAR":
            raise UserError(f"{where}: boundary tensor {g.tensor(t)} has format {info['format']}, "
                            f"expected LINEAR")
        if len(info["shape"]) > MAX_RANK:
            raise UserError(f"{where}: boundary tensor {g.tensor(t)} has rank "
                            f"{len(info['shape'])}, expected at most {MAX_RANK}")
        if info["dtype"] not in BOUNDARY_DTYPES:
            raise UserError(f"{where}: boundary tensor {g.tensor(t)} has dtype {info['dtype']}, "
                            f"expected one of {', '.join(BOUNDARY_DTYPES)}")


def _check_dynamic_output(g: Graph, inputs: list[str], output: str, like, where: str) -> None:
    out = g.tensors[output]
    if like is None:
        if -1 in out["shape"]:
            raise UserError(f"{where}: output {g.tensor(output)} has dynamic shape {out['shape']}; "
                            f"give output_shape_like_input (--output-shape-like-input I), the "
                            f"index of the input whose dtype and shape it has")
        return
    if not (isinstance(like, int) and not isinstance(like, bool) and 0 <= like < len(inputs)):
        raise UserError(f"{where}: output_shape_like_input {like!r} is not an input index "
                        f"(expected 0..{len(inputs) - 1})", mentions=("output_shape_like_input",))
    src = g.tensors[inputs[like]]
    if (src["dtype"], src["shape"]) != (out["dtype"], out["shape"]):
        raise UserError(f"{where}: output_shape_like_input {like} names input "
                        f"{g.tensor(inputs[like])} {src['dtype']} {src['shape']}, which differs "
                        f"from output {g.tensor(output)} {out['dtype']} {out['shape']}")


def _describe_boundary(g: Graph, tensor_ids: list[str]) -> list[dict]:
    return [{"tensor_id": t, "name": g.tensors[t]["name"], "dtype": g.tensors[t]["dtype"],
             "shape": list(g.tensors[t]["shape"])} for t in tensor_ids]


def select_region(snapshot: dict, nodes: list[str], *, binding_id: str, workspace_bytes: int = 0,
                  extra_args: Sequence = (), output_shape_like_input: int | None = None,
                  recipe: dict | None = None, source: str = "snapshot") -> SelectionReceipt:
    """Validate `nodes` of `snapshot` as one kernel slot and return its selection receipt.
    `source` names where the selection came from in every message (a file, a recipe)."""
    if not isinstance(binding_id, str) or not BINDING_ID.fullmatch(binding_id):
        raise UserError(f"{source}: binding_id {binding_id!r} must start with a letter or digit "
                        f"and use only letters, digits and _ . : @ -", mentions=("binding_id",))
    if isinstance(workspace_bytes, int) and workspace_bytes > MAX_WORKSPACE_BYTES:
        raise UserError(f"{source}: workspace_bytes {workspace_bytes} is more than the limit of "
                        f"{MAX_WORKSPACE_BYTES} (256 MiB, "
                        f"pipeline.graph.select.MAX_WORKSPACE_BYTES)",
                        mentions=("workspace_bytes",))
    g = Graph.of_snapshot(snapshot)
    region = _check_nodes(g, nodes, source)
    _check_layer_types(g, region, source)
    _check_connected(g, region, source)
    _check_convex(g, region, source)
    inputs, outputs = _boundary(g, region)
    _check_outputs(g, outputs, source)
    _check_tensors(g, region, inputs + outputs, source)
    _check_dynamic_output(g, inputs, outputs[0], output_shape_like_input, source)
    extra_args = check_extra_args(extra_args, f"{source}: extra args")
    in_desc, out_desc = _describe_boundary(g, inputs), _describe_boundary(g, outputs)
    try:
        abi = abi_of(in_desc, out_desc, workspace_bytes, extra_args, output_shape_like_input)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None
    return SelectionReceipt.from_json({
        "schema_version": SCHEMA_VERSION, "binding_id": binding_id,
        "engine_role": snapshot["engine_role"], "graph_fingerprint": snapshot["fingerprint"],
        "build": snapshot["build"], "nodes": region,
        "input_tensor_ids": inputs, "output_tensor_ids": outputs,
        "inputs": in_desc, "outputs": out_desc,
        "workspace_bytes": workspace_bytes, "extra_args": extra_args,
        "output_shape_like_input": output_shape_like_input,
        "recipe": None if recipe is None else {"recipe_id": recipe["recipe_id"],
                                                "instance_id": recipe["instance_id"]},
        "abi": abi, "abi_sha256": abi_sha256(abi),
    }, source)


def _recorded(snapshot: dict, recipe_id: str, source: str) -> list[dict]:
    """The recipe's recorded instances, in graph order; an unknown recipe is refused."""
    recipes = snapshot["recipes"]
    found = [r for r in recipes if r["recipe_id"] == recipe_id]
    if not found:
        known = sorted({r["recipe_id"] for r in recipes})
        raise UserError(f"{source}: no recipe '{recipe_id}' for engine role "
                        f"'{snapshot['engine_role']}' (recipes: "
                        f"{', '.join(known) if known else 'none recorded'})")
    return found


def recorded_instance(snapshot: dict, nodes: Sequence[str]) -> dict | None:
    """The recorded recipe instance whose region is exactly `nodes` (a selection made by node
    ids can be one), or None."""
    wanted = set(nodes)
    return next((r for r in snapshot["recipes"] if set(r["nodes"]) == wanted), None)


def from_recipe(snapshot: dict, recipe_id: str, instance_id: str | None, binding_id: str | None = None,
                source: str = "snapshot") -> SelectionReceipt:
    """The selection of exactly one recorded recipe instance (never "the first" or "all")."""
    recorded = _recorded(snapshot, recipe_id, source)
    match = [r for r in recorded if r["instance_id"] == instance_id]
    if not match:
        raise UserError(f"{source}: recipe '{recipe_id}' has no instance '{instance_id}' "
                        f"(instances: {', '.join(r['instance_id'] for r in recorded)})")
    r = match[0]
    return select_region(snapshot, r["nodes"], binding_id=binding_id or recipe_id,
                         workspace_bytes=r["workspace_bytes"], extra_args=r["extra_args"],
                         output_shape_like_input=r["output_shape_like_input"], recipe=r,
                         source=f"{source}: recipe {recipe_id} {instance_id}")


def from_recipe_instances(snapshot: dict, recipe_id: str, instances, *,
                          expect_count: int | None = None, binding_id: str | None = None,
                          source: str = "snapshot") -> list[SelectionReceipt]:
    """The receipts of many instances of one recipe under one binding id: `instances` is "all"
    (asked for explicitly, never implied) or a list of instance ids. Each goes through the region
    validator; together they must not overlap and must share one ABI, and their count must be
    `expect_count` when given."""
    recorded = _recorded(snapshot, recipe_id, source)
    chosen = [r["instance_id"] for r in recorded] if instances == "all" else list(instances)
    if len(set(chosen)) != len(chosen):
        twice = next(i for i in chosen if chosen.count(i) > 1)
        raise UserError(f"{source}: recipe '{recipe_id}': instance '{twice}' is named twice")
    if expect_count is not None and len(chosen) != expect_count:
        raise UserError(f"{source}: recipe '{recipe_id}' selects {len(chosen)} instances, but "
                        f"{expect_count} were expected (expect_count)", mentions=("expect_count",))
    receipts = [from_recipe(snapshot, recipe_id, i, binding_id, source) for i in chosen]
    check_instances(receipts, source)
    return receipts


def check_fresh(receipt: SelectionReceipt, snapshot: dict, where: str) -> None:
    """A receipt applies only to the graph it was made on."""
    hint = "recapture after changing the revision or graph-producing options, then select again"
    if receipt.engine_role != snapshot["engine_role"]:
        raise UserError(f"{where}: selection {receipt.binding_id!r} is for engine role "
                        f"{receipt.engine_role!r}, but the graph is engine role "
                        f"{snapshot['engine_role']!r} ({hint})")
    if receipt.graph_fingerprint != snapshot["fingerprint"]:
        raise UserError(f"{where}: selection {receipt.binding_id!r} was made on graph "
                        f"{receipt.graph_fingerprint[:12]}, but the recaptured graph is "
                        f"{snapshot['fingerprint'][:12]}: the selection is stale ({hint})")


def rederive(receipt: SelectionReceipt, snapshot: dict, where: str) -> SelectionReceipt:
    """The receipt as the region validator derives it again on `snapshot` from the receipt's
    nodes, binding id, workspace, extra args and shape rule; any difference (an edited boundary,
    ABI or option) is refused, so a receipt is never trusted as written."""
    check_fresh(receipt, snapshot, where)
    derived = select_region(snapshot, list(receipt.nodes), binding_id=receipt.binding_id,
                            workspace_bytes=receipt.workspace_bytes,
                            extra_args=[a.to_json() for a in receipt.extra_args],
                            output_shape_like_input=receipt.output_shape_like_input,
                            recipe=None if receipt.recipe is None else receipt.recipe.to_json(),
                            source=where)
    # compared field by field as the file holds them, so the message quotes the file's values
    given, again = receipt.to_json(), derived.to_json()
    for key in again:
        if key != "build" and again[key] != given.get(key):  # build: names, not structure
            raise UserError(f"{where}: {key} is {jsonio.excerpt(json.dumps(given.get(key)), 120)}"
                            f", but the region validator derives "
                            f"{jsonio.excerpt(json.dumps(again[key]), 120)} on the recaptured "
                            f"graph (the receipt of {receipt.binding_id!r} was edited; select "
                            f"again)")
    return derived


def _shape(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _extra_arg(arg: Mapping[str, Any]) -> str:
    return arg["type"] if arg["type"] == "none" else f"{arg['type']} {json.dumps(arg['value'])}"


def format_contract(receipt: SelectionReceipt) -> str:
    """The call contract of the exported kernel function, as a user reads it, from the
    receipt's call signature (abi.Signature: the parameters in call order)."""
    sig = receipt.signature()
    lines = [f"{p.kind}[{p.index}] {p.name} {p.dtype} device {_shape(p.shape)}"
             for p in sig.params if p.kind in ("input", "output")]
    like = sig.output_shape_like_input
    if like is not None:
        lines.append(f"output shape like input[{like}]")
    ws = sig.workspace
    lines.append(f"workspace {ws.shape[0]} bytes (uint8 device tensor after the inputs)"
                 if ws and ws.shape else "workspace none")
    args = sig.of_kind("extra")
    lines.append("extra args " + (", ".join(_extra_arg(p.arg or {}) for p in args) if args
                                  else "none"))
    return "\n".join(lines)


def save_receipt(receipt: SelectionReceipt, path) -> None:
    jsonio.write_json(path, receipt.to_json(), SCHEMA)


def save_selection(selection: SelectionReceipt | list[SelectionReceipt], path) -> None:
    """One receipt as a receipt file; many instances as a selection set of their receipts."""
    if isinstance(selection, SelectionReceipt):
        return save_receipt(selection, path)
    jsonio.write_json(path, SelectionSet.of(selection).to_json(), SET_SCHEMA)


def load_receipt(path) -> SelectionReceipt:
    """Schema-checked, and its ABI hash recomputed, so an edited receipt cannot bind a kernel."""
    return SelectionReceipt.from_json(jsonio.read_json(path, SCHEMA), path)


def load_selection(path) -> SelectionReceipt | list[SelectionReceipt]:
    """A receipt file, or a selection set (its receipts, each checked as a receipt file is, and
    together as check_instances requires)."""
    raw = jsonio.read_json(path, None)
    if not (isinstance(raw, dict) and "instances" in raw):
        jsonio.validate(raw, SCHEMA, path)
        return SelectionReceipt.from_json(raw, path)
    jsonio.validate(raw, SET_SCHEMA, path)
    return list(SelectionSet.from_json(raw, path).instances)


def receipts_of(selection: SelectionReceipt | list[SelectionReceipt]) -> list[SelectionReceipt]:
    return [selection] if isinstance(selection, SelectionReceipt) else list(selection)
