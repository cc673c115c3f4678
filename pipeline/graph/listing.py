"""Human-readable views of a snapshot: `graph list` and `graph recipes` (display only)."""
from __future__ import annotations

import fnmatch


def op_label(node: dict) -> str:
    """`LayerType.ELEMENTWISE/ElementWiseOperation.SUM`: the layer type, plus its op if any."""
    label = f"LayerType.{node['type']}"
    return f"{label}/{node['op']}" if node.get("op") else label


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip() for r in rows]


def list_nodes(snapshot: dict, match: str | None = None) -> list[str]:
    """One row per node, `node:N  OP  inputs -> outputs  NAME`; `match` is an fnmatch glob
    tested against the id, the OP label and the name."""
    rows = []
    for n in snapshot["nodes"]:
        op = op_label(n)
        if match and not any(fnmatch.fnmatchcase(s, match) for s in (n["id"], op, n["name"])):
            continue
        inputs = ",".join(t or "none" for t in n["inputs"]) or "-"
        outputs = ",".join(n["outputs"]) or "-"
        rows.append([n["id"], op, f"{inputs} -> {outputs}", n["name"]])
    return _columns(rows) if rows else []


def list_recipes(snapshot: dict) -> list[str]:
    """`RECIPE  INSTANCE  NODES`, nodes comma-separated (`--nodes` takes them as printed)."""
    if not snapshot["recipes"]:
        return [f"no recipes recorded for engine role '{snapshot['engine_role']}' of family "
                f"'{snapshot['build']['family']}' (select nodes with `trtmc graph select --nodes`)"]
    rows = [["RECIPE", "INSTANCE", "NODES"]]
    rows += [[r["recipe_id"], r["instance_id"], ",".join(r["nodes"])] for r in snapshot["recipes"]]
    return _columns(rows)
