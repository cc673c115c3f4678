"""Graph snapshots: the captured structure of one engine role's network, plus its fingerprint.

A snapshot needs no weights and builds no engine. The fingerprint covers the canonical structure,
the recorded recipes, the engine role and every graph-producing option, so any change to them
makes old selections stale.
A loaded snapshot is trusted only after its references check out and its fingerprint is recomputed.
"""
from __future__ import annotations

import hashlib

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.graph.bounds import read_counted
from pipeline.graph.model import Graph

SCHEMA = "graph"
SCHEMA_VERSION = 2  # 2: the fingerprint covers the recipes


def fingerprint(nodes: list[dict], tensors: list[dict], engine_role: str, build: dict,
                recipes: list[dict]) -> str:
    """The model id (a folder name) and TensorRT version are left out: the revision already
    identifies the checkpoint, and the structure captured is what a selection depends on. The
    recipes are in: a selection made from a recipe depends on its nodes and options."""
    graph_build = {k: build[k] for k in ("family", "revision", "options")}
    canonical = jsonio.dumps({"nodes": nodes, "tensors": tensors, "engine_role": engine_role,
                              "build": graph_build, "recipes": recipes}, human=False)
    return hashlib.sha256(canonical).hexdigest()


def check_structure(doc: dict, nodes_key: str, where) -> None:
    """Ids unique, every tensor a node names exists, each tensor produced once, no cycle: what
    the graph algorithms assume of a snapshot's `nodes` or an export's `layers`."""
    tensors: dict[str, int] = {}
    for i, t in enumerate(doc["tensors"]):
        if t["id"] in tensors:
            raise UserError(f"{where}: $.tensors[{i}].id: {t['id']} repeats "
                            f"$.tensors[{tensors[t['id']]}]")
        tensors[t["id"]] = i
    ids: dict[str, int] = {}
    producer: dict[str, str] = {}
    for i, n in enumerate(doc[nodes_key]):
        at = f"$.{nodes_key}[{i}]"
        if n["id"] in ids:
            raise UserError(f"{where}: {at}.id: {n['id']} repeats $.{nodes_key}[{ids[n['id']]}]")
        ids[n["id"]] = i
        for field in ("inputs", "outputs"):
            for j, t in enumerate(n[field]):
                if t is not None and t not in tensors:
                    raise UserError(f"{where}: {at}.{field}[{j}]: {t} is not in $.tensors")
        for t in n["outputs"]:
            if t in producer:
                raise UserError(f"{where}: {at}.outputs: {t} is also produced by {producer[t]}")
            producer[t] = n["id"]
    try:  # some order computes every node after its inputs' producers: no cycle
        Graph(doc[nodes_key]).toposort(t for t in tensors if t not in producer)
    except UserError as e:
        raise UserError(f"{where}: $.{nodes_key}: {e}") from None


def save(snapshot: dict, path) -> None:
    jsonio.write_json(path, snapshot, SCHEMA)


def load(path) -> dict:
    """Counts and schema checked, references checked, fingerprint recomputed: an edited snapshot
    is refused."""
    snap = read_counted(path, SCHEMA)
    check_structure(snap, "nodes", path)
    actual = fingerprint(snap["nodes"], snap["tensors"], snap["engine_role"], snap["build"],
                         snap["recipes"])
    if actual != snap["fingerprint"]:
        raise UserError(f"{path}: $.fingerprint: {snap['fingerprint'][:12]} is not the fingerprint "
                        f"of the snapshot's nodes, tensors, recipes, engine role and build "
                        f"({actual[:12]}): the file was edited; capture it again")
    return snap
