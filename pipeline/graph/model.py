"""One small graph model over a snapshot's `nodes` or a network export's `layers` (both are
dicts with `id`, `type`, `name`, `inputs`, `outputs`; an absent optional input is None).

After onnx-graphsurgeon's Graph: tensors know their producer and consumers, so selection,
patching and lowering share one set of graph algorithms instead of each walking raw dicts.
"""
from __future__ import annotations

import heapq
from typing import Iterable, Sequence

from pipeline.errors import UserError


class Graph:
    def __init__(self, nodes: list[dict], tensors: Sequence[dict] = ()):
        self.nodes = {n["id"]: n for n in nodes}
        self.order = {n["id"]: i for i, n in enumerate(nodes)}
        self.tensors = {t["id"]: t for t in tensors}
        self.producer: dict[str, str] = {}
        self.consumers: dict[str, list[str]] = {}
        for n in nodes:
            for t in n["outputs"]:
                self.producer[t] = n["id"]
            for t in n["inputs"]:
                if t is not None and n["id"] not in self.consumers.setdefault(t, []):
                    self.consumers[t].append(n["id"])

    @classmethod
    def of_snapshot(cls, snapshot: dict) -> "Graph":
        return cls(snapshot["nodes"], snapshot["tensors"])

    @classmethod
    def of_export(cls, export: dict, layers: list[dict] | None = None) -> "Graph":
        return cls(export["layers"] if layers is None else layers, export["tensors"])

    # -- neighbours -----------------------------------------------------------------------------
    def inputs_of(self, node_id: str) -> list[str]:
        return [t for t in self.nodes[node_id]["inputs"] if t is not None]

    def successors(self, node_id: str) -> list[str]:
        out = []
        for t in self.nodes[node_id]["outputs"]:
            out += [c for c in self.consumers.get(t, ()) if c not in out]
        return out

    def predecessors(self, node_id: str) -> list[str]:
        return [self.producer[t] for t in self.inputs_of(node_id) if t in self.producer]

    # -- algorithms -----------------------------------------------------------------------------
    def toposort(self, available: Iterable[str]) -> list[dict]:
        """Kahn's algorithm, stable: each node as early as its inputs allow, ties broken by the
        original order. `available`: tensors given from outside (network inputs)."""
        have = set(available)
        missing_inputs = {n: sum(1 for t in set(self.inputs_of(n)) if t not in have)
                          for n in self.nodes}
        ready = [(self.order[n], n) for n, k in missing_inputs.items() if k == 0]
        heapq.heapify(ready)
        out = []
        while ready:
            _, n = heapq.heappop(ready)
            out.append(self.nodes[n])
            for t in self.nodes[n]["outputs"]:
                if t in have:
                    continue
                have.add(t)
                for c in self.consumers.get(t, ()):
                    missing_inputs[c] -= 1
                    if missing_inputs[c] == 0:
                        heapq.heappush(ready, (self.order[c], c))
        if len(out) != len(self.nodes):
            stuck = min((n for n in self.nodes if missing_inputs[n] > 0), key=self.order.__getitem__)
            absent = [t for t in self.inputs_of(stuck) if t not in have]
            cause = ("missing producer" if any(t not in self.producer for t in absent)
                     else "cycle")
            raise UserError(f"{stuck} ({self.nodes[stuck]['type']} '{self.nodes[stuck]['name']}'): "
                            f"input {absent[0]} has a {cause} (no order computes it first)")
        return out

    def live(self, inputs: Iterable[str], outputs: Iterable[str]) -> list[dict]:
        """Nodes needed to compute `outputs` from `inputs`, in the original order."""
        stop, live, seen = set(inputs), set(), set()
        todo = list(outputs)
        while todo:
            t = todo.pop()
            if t in seen or t in stop:
                continue
            seen.add(t)
            if t not in self.producer:
                raise UserError(f"{t}: needed for the outputs but neither an input nor produced "
                                f"by a layer (missing producer; give it as an input)")
            n = self.producer[t]
            if n not in live:
                live.add(n)
                todo.extend(self.inputs_of(n))
        return sorted((self.nodes[n] for n in live), key=lambda node: self.order[node["id"]])

    # -- messages -------------------------------------------------------------------------------
    def describe(self, node_id: str) -> str:
        n = self.nodes[node_id]
        return f"{node_id} ({n['type']} '{n['name']}')"

    def tensor(self, tensor_id: str) -> str:
        return f"{tensor_id} '{self.tensors[tensor_id]['name']}'"
