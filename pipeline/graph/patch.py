"""Apply a selection to a network export: the region's layers become one SLOT layer.

The removed layers are kept inside the slot (`attrs.native_layers`) so the region probe can run the
native region against the kernel. Layers are re-sorted topologically (graph.model), because the slot
must come after every producer of its inputs and before every consumer of its output.
"""
from __future__ import annotations

from pipeline.errors import UserError
from pipeline.graph.model import Graph


def slot_layer(receipt: dict, native_layers: list[dict]) -> dict:
    return {
        "id": f"slot:{receipt['binding_id']}", "type": "SLOT", "name": receipt["binding_id"],
        "inputs": list(receipt["input_tensor_ids"]), "outputs": list(receipt["output_tensor_ids"]),
        "attrs": {"binding_id": receipt["binding_id"], "abi_sha256": receipt["abi_sha256"],
                  "workspace_bytes": receipt["workspace_bytes"], "extra_args": receipt["extra_args"],
                  "output_shape_like_input": receipt["output_shape_like_input"],
                  "native_layers": native_layers},
    }


def apply_selection(export: dict, receipt: dict) -> dict:
    """A new export with the receipt's region replaced by its SLOT layer."""
    if export["engine_role"] != receipt["engine_role"]:
        raise UserError(f"selection {receipt['binding_id']} is for engine role "
                        f"{receipt['engine_role']}, not {export['engine_role']}")
    region = set(receipt["nodes"])
    by_id = {layer["id"]: layer for layer in export["layers"]}
    missing = region - by_id.keys()
    if missing:
        raise UserError(f"selection {receipt['binding_id']}: {sorted(missing)[0]} is not in the network")
    native = [layer for layer in export["layers"] if layer["id"] in region]
    kept = [layer for layer in export["layers"] if layer["id"] not in region]
    layers = kept + [slot_layer(receipt, native)]
    try:
        ordered = Graph.of_export(export, layers).toposort(export["inputs"])
    except UserError as e:  # a boundary that does not fit the network: say which selection
        raise UserError(f"selection {receipt['binding_id']}: the patched {export['engine_role']} "
                        f"network does not order: {e}") from None
    return {**export, "layers": ordered}


def slots_of(export: dict) -> list[dict]:
    return [layer for layer in export["layers"] if layer["type"] == "SLOT"]
