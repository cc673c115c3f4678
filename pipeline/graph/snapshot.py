"""Graph snapshots: the captured structure of one engine role's network, plus its fingerprint.

A snapshot needs no weights and builds no engine. The fingerprint covers the canonical structure,
the engine role and every graph-producing option, so any change to them makes old selections stale.
"""
from __future__ import annotations

import hashlib

from pipeline import jsonio

SCHEMA = "graph"
SCHEMA_VERSION = 1


def fingerprint(nodes: list[dict], tensors: list[dict], engine_role: str, build: dict) -> str:
    """The model id (a folder name) and TensorRT version are left out: the revision already
    identifies the checkpoint, and the structure captured is what a selection depends on."""
    graph_build = {k: build[k] for k in ("family", "revision", "options")}
    canonical = jsonio.dumps({"nodes": nodes, "tensors": tensors, "engine_role": engine_role,
                              "build": graph_build}, human=False)
    return hashlib.sha256(canonical).hexdigest()


def save(snapshot: dict, path) -> None:
    jsonio.write_json(path, snapshot, SCHEMA)


def load(path) -> dict:
    return jsonio.read_json(path, SCHEMA)
