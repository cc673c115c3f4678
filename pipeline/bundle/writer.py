"""Build a bundle: per role the network export (patched where a selection applies) and, where the
TensorRT module can build it, the serialized plan; weights embedded or referenced by name + digest.

The directory is assembled under a temporary name and renamed into place, manifest last, so an
interrupted build never leaves a bundle that looks complete.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline import jsonio, trt
from pipeline.bundle import layout
from pipeline.errors import UserError
from pipeline.graph import select  # the one validator module
from pipeline.log import get as log_topic
from pipeline.files import atomic_write_bytes, sha256_file, staged_dir, user_os_errors
from pipeline.families.capture import capture_role
from pipeline.graph.patch import apply_selection
from pipeline.graph.receipt import SelectionReceipt
from pipeline.models.checkpoint import safetensors_errors
from pipeline.models.tokenizer import TOKENIZER_FILES
from pipeline.trt.export import export_network
from pipeline.trt.plans import build_plan

log = log_topic("build")

WEIGHT_MODES = ("embed", "reference")
EMBED_LIMIT_BYTES = 2 << 30  # default mode: embed checkpoints up to 2 GiB, reference larger ones


def _checkpoint_bytes(model: str, revision: str | None) -> int:
    from pipeline.models.checkpoint import resolve
    path, _, _ = resolve(model, revision)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _check_output(out: Path) -> None:
    """Refuse, before any work, an `out` that replacing would lose: a file, a symlink, a folder
    that is not a bundle, or a folder inside a bundle (which lists every file it holds, so any
    new one breaks it)."""
    with user_os_errors(out):
        inside = next((p for p in Path(os.path.abspath(out)).parents
                       if (p / layout.MANIFEST).is_file() and p.name.endswith(".bundle")), None)
        if inside is not None:
            raise UserError(f"output {out}: lies inside the bundle {inside}, which lists every "
                            f"file it holds; choose a path outside it", param="output")
        if not os.path.lexists(out):
            return
        if out.is_symlink() or not out.is_dir():
            reason = "exists and is not a folder"
        elif (out / layout.MANIFEST).is_file() or not any(out.iterdir()):
            return
        else:
            reason = f"a folder that is not a bundle (no {layout.MANIFEST})"
    raise UserError(f"output {out}: {reason}; refusing to replace it", param="output")


def build_bundle(model: str, revision: str | None, options: dict, out, *,
                 selection: SelectionReceipt | list[SelectionReceipt] | None = None, weights: str | None = None,
                 build_plans: bool = True) -> Path:
    """Capture every role, apply `selection` (a receipt, or a list of receipts: many instances of
    one recipe, one slot each) to its role, write `out`. Each receipt is re-derived on the
    recapture by the region validator: a stale or edited one is refused. This is a build's one
    verification of a receipt, against the graph actually built (the build_slot stage adds only
    that the receipt is the one its spec asks for). An existing `out` is replaced only when it is
    a bundle."""
    if weights is None:
        weights = "embed" if _checkpoint_bytes(model, revision) <= EMBED_LIMIT_BYTES else "reference"
    if weights not in WEIGHT_MODES:
        raise UserError(f"weights {weights}: expected one of {', '.join(WEIGHT_MODES)}", param="weights")
    out = Path(out)
    _check_output(out)
    first = capture_role(model, revision, None, options)
    ck, family = first.checkpoint, first.family
    captures = {first.role: first}
    for role in first.all_roles:
        if role not in captures:
            log.info("capturing role %s", role)
            captures[role] = capture_role(model, revision, role, options, checkpoint=ck)
    receipts, many = [], False
    if selection is not None:
        receipts, many = select.receipts_of(selection), not isinstance(selection, SelectionReceipt)
        role = receipts[0].engine_role
        if role not in captures:
            raise UserError(f"selection {receipts[0].binding_id}: engine role {role!r} is not "
                            f"a role of this build (roles: {', '.join(captures)}); recapture "
                            f"after changing the revision or graph-producing options")
        for r in receipts:
            select.rederive(r, captures[role].snapshot,
                            f"selection {r.instance}" if many else "selection")
        if many:
            select.check_instances(receipts, "selection")

    with staged_dir(out, replace=True) as tmp, _final_names(tmp, out):
        weight_table: dict[str, dict] = {}
        embedded: dict[str, torch.Tensor] = {}
        role_entries = []
        slots = []
        for role, cap in captures.items():
            export = export_network(cap.nb, role)
            for key, rec in export["weights"].items():
                if key in weight_table:
                    continue
                if rec["source"] == "computed":
                    embedded[key] = cap.nb.computed[key]
                    weight_table[key] = {**rec, "storage": "embedded"}
                elif not ck.has_weights:
                    raise UserError(f"{ck.path}: checkpoint has no weights; a bundle needs them "
                                    f"(graph inspect works from config alone)")
                elif weights == "embed":
                    embedded[key] = ck.tensor(rec["tensor"])
                    weight_table[key] = {**rec, "storage": "embedded"}
                else:
                    weight_table[key] = {**rec, "storage": "referenced",
                                         "sha256": ck.digest(rec["tensor"])}
            slot_ready = bool(receipts) and receipts[0].engine_role == role
            for r in receipts if slot_ready else ():
                instance = r.instance if many else None  # each a recipe's instance
                export = apply_selection(export, r, instance)
                slots.append({"binding_id": r.binding_id, "abi_sha256": r.abi_sha256,
                              "engine_role": role, "abi": r.abi.to_json(),
                              **({"instance_id": instance, "nodes": list(r.nodes)} if many else {})})
            jsonio.write_json(tmp / layout.network_path(role), export, "network", human=False)
            plan, plan_note = (None, "plan builds disabled")
            if build_plans:
                plan, plan_note = build_plan(cap.nb.builder, cap.nb.network, role, cap.profile,
                                             weights_mode=weights, slot_ready=slot_ready)
            if plan is not None:
                atomic_write_bytes(tmp / layout.plan_path(role), plan)
            role_entries.append({"role": role, "graph_fingerprint": cap.snapshot["fingerprint"],
                                 "network": layout.network_path(role),
                                 "plan": layout.plan_path(role) if plan is not None else None,
                                 "plan_note": plan_note, "slot_ready": slot_ready})
        log.info("writing %d embedded weight tensors", len(embedded))
        with safetensors_errors(out / layout.WEIGHTS, "cannot be written"):  # a full disk
            save_file({k: v.contiguous() for k, v in embedded.items()}, str(tmp / layout.WEIGHTS))
        _copy_model_files(ck.path, tmp)
        if slots:
            jsonio.write_json(tmp / layout.SLOTS, {"schema_version": 1, "slots": slots},
                              "kernel_slots")
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "format_version": layout.FORMAT_VERSION, "family": family, "model": ck.model_id,
            "revision": ck.revision, "build_options": first.options, "roles": role_entries,
            "trt_module": trt.MODULE, "trt_version": trt.VERSION, "weights_mode": weights,
            "checkpoint": str(ck.path) if weights == "reference" else None,
            "weights": weight_table, "slot_ready": bool(slots),
            "content_digests": {f: sha256_file(tmp / f) for f in files},
        }
        jsonio.write_json(tmp / layout.MANIFEST, manifest, "bundle_manifest")
    log.info("wrote %s", out)
    return out


@contextlib.contextmanager
def _final_names(stage: Path, out: Path):
    """A refusal naming a file in the stage folder (a full disk) names it at its place in `out`:
    the stage, a hidden folder, is removed on the way out."""
    try:
        yield
    except UserError as e:
        if str(stage) not in str(e):
            raise
        raise UserError(str(e).replace(str(stage), str(out)), param=e.param,
                        mentions=e.mentions) from None


def _copy_model_files(src: Path, dst: Path) -> None:
    """Config and tokenizer travel with the bundle, so embed/run need no checkpoint (embed mode)."""
    shutil.copy2(src / "config.json", dst / layout.CONFIG)
    (dst / layout.TOKENIZER).mkdir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / layout.TOKENIZER / name)
