"""Apply a selection to a network export: the region's layers become one SLOT layer.

The removed layers are kept inside the slot (`attrs.native_layers`) so the region probe can run the
native region against the kernel. Layers are re-sorted topologically (graph.model), because the slot
must come after every producer of its inputs and before every consumer of its output.
"""
from __future__ import annotations

from pipeline.errors import UserError
from pipeline.graph.model import Graph
from pipeline.graph.receipt import SelectionReceipt


def slot_key(binding_id: str, instance_id: str | None) -> str:
    """What names one slot: its binding id, or `ID:INSTANCE` when one id binds many instances
    (the runtime's call table, the gates' regions and reports use this name; it keeps to the
    binding ids' characters, so the reports' schemas hold it)."""
    return binding_id if instance_id is None else f"{binding_id}:{instance_id}"


def slot_layer(receipt: SelectionReceipt, native_layers: list[dict], instance_id: str | None = None) -> dict:
    key = slot_key(receipt.binding_id, instance_id)
    attrs = {"binding_id": receipt.binding_id, "abi_sha256": receipt.abi_sha256,
             "workspace_bytes": receipt.workspace_bytes,
             "extra_args": [a.to_json() for a in receipt.extra_args],
             "output_shape_like_input": receipt.output_shape_like_input,
             "native_layers": native_layers}
    if instance_id is not None:
        attrs["instance_id"] = instance_id
    return {"id": f"slot:{key}", "type": "SLOT", "name": key,
            "inputs": list(receipt.input_tensor_ids),
            "outputs": list(receipt.output_tensor_ids), "attrs": attrs}


def layer_key(layer: dict) -> str:
    """The slot key of a SLOT layer."""
    return slot_key(layer["attrs"]["binding_id"], layer["attrs"].get("instance_id"))


def apply_selection(export: dict, receipt: SelectionReceipt, instance_id: str | None = None) -> dict:
    """A new export with the receipt's region replaced by its SLOT layer (`instance_id`: one of
    many instances bound under the receipt's binding id)."""
    if export["engine_role"] != receipt.engine_role:
        raise UserError(f"selection {receipt.binding_id} is for engine role "
                        f"{receipt.engine_role}, not {export['engine_role']}")
    region = set(receipt.nodes)
    by_id = {layer["id"]: layer for layer in export["layers"]}
    missing = region - by_id.keys()
    if missing:
        raise UserError(f"selection {receipt.binding_id}: {sorted(missing)[0]} is not in the network")
    native = [layer for layer in export["layers"] if layer["id"] in region]
    kept = [layer for layer in export["layers"] if layer["id"] not in region]
    layers = kept + [slot_layer(receipt, native, instance_id)]
    try:
        ordered = Graph.of_export(export, layers).toposort(export["inputs"])
    except UserError as e:  # a boundary that does not fit the network: say which selection
        raise UserError(f"selection {receipt.binding_id}: the patched {export['engine_role']} "
                        f"network does not order: {e}") from None
    return {**export, "layers": ordered}


def slots_of(export: dict) -> list[dict]:
    return [layer for layer in export["layers"] if layer["type"] == "SLOT"]
