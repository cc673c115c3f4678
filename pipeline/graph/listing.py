"""Views of a snapshot for a kernel author: `graph list` and `graph recipes` (display only), as
aligned text or as JSON records."""
from __future__ import annotations

import difflib
import fnmatch
import itertools
from typing import Any, Iterator

from pipeline.dtypes import BY_NAME
from pipeline.errors import UserError, as_typed

NODE_HEADER = ["NODE", "OP", "NAME", "INPUTS -> OUTPUTS"]
RECIPE_HEADER = ["RECIPE", "INSTANCE", "NODES"]
# a column is padded to its longest cell up to this width; a longer cell overflows its column
# (rows are streamed: one long name no longer pads every row, nor holds every row in memory)
MAX_COLUMN_WIDTH = 64


def op_label(node: dict) -> str:
    """`LayerType.ELEMENTWISE/ElementWiseOperation.SUM`: the layer type, plus its op if any."""
    label = f"LayerType.{node['type']}"
    return f"{label}/{node['op']}" if node.get("op") else label


def matches(node: dict, glob: str) -> bool:
    """`--match` (and a `--nodes` glob): fnmatch against the id, the OP label and the name."""
    return any(fnmatch.fnmatchcase(s, glob) for s in (node["id"], op_label(node), node["name"]))


def printable(text: str) -> str:
    """`text` for one terminal line: unprintable characters (a line break, a terminal escape)
    escaped as repr writes them."""
    return text if text.isprintable() else repr(text)[1:-1]


def _columns(header: list[str], rows: list[list[Any]]) -> Iterator[str]:
    """The header, then each row, one line at a time: every cell escaped by `printable`, each
    column but the last padded to its longest cell up to MAX_COLUMN_WIDTH. `rows` holds the
    cells of the padded columns; the last one may be made as its line is (lazily)."""
    widths = [min(max([len(printable(r[i])) for r in rows], default=0), MAX_COLUMN_WIDTH)
              for i in range(len(header) - 1)]
    widths = [max(w, len(h)) for w, h in zip(widths, header)]
    for row in itertools.chain([header], rows):
        cells = [printable(c if isinstance(c, str) else c()) for c in row]
        yield "  ".join([c.ljust(w) for c, w in zip(cells, widths)] + [cells[-1]]).rstrip()


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


def _tensors(record: dict) -> str:
    return ("{" + ", ".join(map(_tensor, record["inputs"])) + "} -> {"
            + ", ".join(map(_tensor, record["outputs"])) + "}")


def list_nodes(records: list[dict]) -> Iterator[str]:
    """A header, then one row per node: `node:N  OP  NAME  {inputs} -> {outputs}`, made as it
    is printed."""
    return _columns(NODE_HEADER, [[r["id"], r["op"], r["name"], lambda r=r: _tensors(r)]
                                  for r in records])


def list_recipes(snapshot: dict) -> Iterator[str]:
    """`RECIPE  INSTANCE  NODES`, nodes comma-separated (`--nodes` takes them as printed)."""
    if not snapshot["recipes"]:
        return iter([f"no recipes recorded for engine role "
                     f"'{printable(snapshot['engine_role'])}' of family "
                     f"'{printable(snapshot['build']['family'])}' (select nodes with "
                     f"`trtmc graph select --nodes`)"])
    return _columns(RECIPE_HEADER, [[r["recipe_id"], r["instance_id"], ",".join(r["nodes"])]
                                    for r in snapshot["recipes"]])


def resolve_nodes(snap: dict, typed: list[str]) -> list[str]:
    """Node references as a user types them (ids, names, fnmatch globs like `matches`, and the
    comma-joined lists `graph recipes` prints) -> node ids, each once. A name or glob stands for every node it
    matches; a token that matches nothing is an error naming it (and the closest id or name)."""
    nodes = snap["nodes"]
    by_key: dict[str, list[str]] = {}
    for n in nodes:
        by_key.setdefault(n["id"], []).append(n["id"])
        by_key.setdefault(n["name"], []).append(n["id"])
    ids: list[str] = []
    for token in (t for arg in typed for t in arg.split(",") if t):
        found = by_key.get(token)
        if found is None and any(c in token for c in "*?["):
            found = [n["id"] for n in nodes if matches(n, token)]
            if not found:
                raise UserError(f"nodes {token!r}: no node matches (the glob is tested against "
                                f"the id, the OP and the name; see `trtmc graph list --match`)",
                                param="nodes")
        if found is None:
            close = difflib.get_close_matches(token, by_key, n=1)
            raise UserError(f"nodes: {as_typed(token)} does not exist; "
                            + (f"did you mean {close[0]}?" if close else "see `trtmc graph list`"),
                            param="nodes")
        ids += [i for i in found if i not in ids]
    return ids
