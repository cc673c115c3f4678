"""MODEL + revision + build options + engine role -> live network and its snapshot.

The one place every path (graph inspect, build, the doit tasks) turns a model into a network, so a
recaptured graph is comparable with the snapshot a selection was made on.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.families import family_of
from pipeline import trt
from pipeline.graph import snapshot as snapshots
from pipeline.graph import select
from pipeline.graph.receipt import SelectionReceipt
from pipeline.models import checkpoint as checkpoints
from pipeline.trt.export import walk
from pipeline.trt.network import NetworkBuilder


@dataclass
class CapturedRole:
    checkpoint: checkpoints.Checkpoint
    family: str
    options: dict
    role: str
    nb: NetworkBuilder
    snapshot: dict
    all_roles: tuple[str, ...]
    profile: dict  # input name -> (min, opt, max) shapes for a plan build; empty for static shapes

    @property
    def build(self) -> dict:
        return self.snapshot["build"]


def build_info(ck: checkpoints.Checkpoint, family: str, options: dict) -> dict:
    return {"family": family, "model": ck.model_id, "revision": ck.revision, "options": options}


def snapshot_of(network, engine_role: str, build: dict, recipes: list[dict]) -> dict:
    """The graph snapshot of a live network (nodes, tensors, fingerprint, recipes)."""
    nodes, tensors = walk(network)
    nodes = [n for _, n in nodes]
    build = {**build, "trt_module": trt.MODULE, "trt_version": trt.VERSION}
    return {"schema_version": snapshots.SCHEMA_VERSION, "engine_role": engine_role, "build": build,
            "fingerprint": snapshots.fingerprint(nodes, tensors, engine_role, build, recipes),
            "nodes": nodes, "tensors": tensors, "recipes": recipes}


def capture_role(model: str, revision: str | None, role: str | None, options: dict,
                 checkpoint: checkpoints.Checkpoint | None = None) -> CapturedRole:
    """Build `role`'s network (the family's first role when None) and snapshot it."""
    ck = checkpoint or checkpoints.load(model, revision)
    family_name, family = family_of(ck)
    options = family.resolve_options(options)
    roles = family.roles(options)
    role = roles[0] if role is None else role  # "" is a wrong role, not the default
    family.check_role(role, options)
    nb = family.build_network(ck, role, options)
    snap = snapshot_of(nb.network, role, build_info(ck, family_name, options),
                             [r.as_json() for r in nb.recipes])
    return CapturedRole(ck, family_name, options, role, nb, snap, tuple(roles),
                        family.profile(role, options))


def recipe_receipt(model: str, revision: str | None, options: dict, recipe_id: str,
                   instance_id: str | None = None, binding_id: str | None = None, *,
                   instances=None, expect_count: int | None = None
                   ) -> SelectionReceipt | list[SelectionReceipt]:
    """The selection receipt of one recipe instance, or the receipts of many (`instances`: a
    list of ids or "all", select.from_recipe_instances), captured in the role whose network
    records it (the first role when none does, so the refusal names that role's recipes)."""

    def selected(snapshot: dict):
        if instances is None:
            return select.from_recipe(snapshot, recipe_id, instance_id, binding_id)
        return select.from_recipe_instances(snapshot, recipe_id, instances,
                                            expect_count=expect_count, binding_id=binding_id)

    first = capture_role(model, revision, None, options)
    for role in first.all_roles:
        cap = first if role == first.role else capture_role(
            model, revision, role, options, checkpoint=first.checkpoint)
        if any(r["recipe_id"] == recipe_id and (instances is not None or
                                                r["instance_id"] == instance_id)
               for r in cap.snapshot["recipes"]):
            return selected(cap.snapshot)
    return selected(first.snapshot)
