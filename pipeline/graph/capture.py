"""MODEL + revision + build options + engine role -> live network and its snapshot.

The one place every path (graph inspect, build, the doit tasks) turns a model into a network, so a
recaptured graph is comparable with the snapshot a selection was made on.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.families import check_role, family_of, resolve_options
from pipeline.graph import snapshot as snapshots
from pipeline.models import checkpoint as checkpoints
from pipeline.network.builder import NetworkBuilder


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


def capture_role(model: str, revision: str | None, role: str | None, options: dict,
                 checkpoint: checkpoints.Checkpoint | None = None) -> CapturedRole:
    """Build `role`'s network (the family's first role when None) and snapshot it."""
    ck = checkpoint or checkpoints.load(model, revision)
    family_name, family = family_of(ck)
    options = resolve_options(family, options)
    roles = family.roles(options)
    role = role or roles[0]
    check_role(family, role, options)
    nb = family.build_network(ck, role, options)
    snap = snapshots.capture(nb.network, role, build_info(ck, family_name, options),
                             [r.as_json() for r in nb.recipes])
    return CapturedRole(ck, family_name, options, role, nb, snap, tuple(roles),
                        family.profile(role, options))
