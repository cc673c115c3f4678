"""Views of a snapshot for a kernel author: `graph list` and `graph recipes` (display only), as
aligned text or as JSON records."""
from __future__ import annotations

import fnmatch

from pipeline.dtypes import BY_NAME

NODE_HEADER = ["NODE", "OP", "NAME", "INPUTS -> OUTPUTS"]
RECIPE_HEADER = ["RECIPE", "INSTANCE", "NODES"]


def op_label(node: dict) -> str:
    """`LayerType.ELEMENTWISE/ElementWiseOperation.SUM`: the layer type, plus its op if any."""
    label = f"LayerType.{node['type']}"
    return f"{label}/{node['op']}" if node.get("op") else label


def matches(node: dict, glob: str) -> bool:
    """`--match` (and a `--nodes` glob): fnmatch against the id, the OP label and the name."""
    return any(fnmatch.fnmatchcase(s, glob) for s in (node["id"], op_label(node), node["name"]))


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip() for r in rows]


def _tensor(t: dict | None) -> str:
    """Polygraphy's `tensor:3 [dtype=float16, shape=(128, 384)]`; network inputs and outputs also
    show their name (`tensor:0 input_ids [...]`)."""
    if t is None:
        return "none"  # an absent optional input
    dtype = BY_NAME[t["dtype"]].torch if t["dtype"] in BY_NAME else None
    name = f" {t['name']}" if t["is_network_input"] or t["is_network_output"] else ""
    return f"{t['id']}{name} [dtype={dtype or t['dtype'].lower()}, shape={tuple(t['shape'])}]"


def node_records(snapshot: dict, match: str | None = None) -> list[dict]:
    """The nodes `match` selects (all when None), each with its input and output tensors."""
    tensors = {t["id"]: t for t in snapshot["tensors"]}
    return [{"id": n["id"], "op": op_label(n), "name": n["name"],
             "inputs": [tensors[t] if t is not None else None for t in n["inputs"]],
             "outputs": [tensors[t] for t in n["outputs"]]}
            for n in snapshot["nodes"] if match is None or matches(n, match)]


def list_nodes(records: list[dict]) -> list[str]:
    """A header, then one row per node: `node:N  OP  NAME  {inputs} -> {outputs}`."""
    rows = [[r["id"], r["op"], r["name"], "{" + ", ".join(map(_tensor, r["inputs"])) + "} -> {"
             + ", ".join(map(_tensor, r["outputs"])) + "}"] for r in records]
    return _columns([NODE_HEADER] + rows)


def list_recipes(snapshot: dict) -> list[str]:
    """`RECIPE  INSTANCE  NODES`, nodes comma-separated (`--nodes` takes them as printed)."""
    if not snapshot["recipes"]:
        return [f"no recipes recorded for engine role '{snapshot['engine_role']}' of family "
                f"'{snapshot['build']['family']}' (select nodes with `trtmc graph select --nodes`)"]
    rows = [[r["recipe_id"], r["instance_id"], ",".join(r["nodes"])] for r in snapshot["recipes"]]
    return _columns([RECIPE_HEADER] + rows)
