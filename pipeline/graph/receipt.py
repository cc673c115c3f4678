"""The selection receipt as one typed value: what `selection.json` holds (schemas/selection and
schemas/selection_set), read and written only here.

The region validator (`select.py`) makes a `SelectionReceipt`; every reader (bundle building,
binding, the gates, promotion) takes its fields by name. `from_json` turns a schema-valid
document into one (its ABI hash recomputed, so an edited receipt cannot bind a kernel);
`to_json` gives the document back exactly as the file holds it (the file's digest is pinned
by promotion receipts: the same receipt writes the same bytes).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.graph.abi import Signature, abi_of, abi_sha256

SCHEMA = "selection"
SET_SCHEMA = "selection_set"  # many instances of one recipe under one binding id
SCHEMA_VERSION = 1

Json = dict[str, Any]
Option = str | int | float | bool | None


@dataclass(frozen=True)
class Boundary:
    """One boundary tensor of the region: its graph id and name, dtype and declared shape."""
    tensor_id: str
    name: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Boundary:
        return cls(doc["tensor_id"], doc["name"], doc["dtype"], tuple(doc["shape"]))

    def to_json(self) -> Json:
        return {"tensor_id": self.tensor_id, "name": self.name, "dtype": self.dtype,
                "shape": list(self.shape)}


@dataclass(frozen=True)
class ExtraArg:
    """One fixed extra arg in its canonical form (abi.check_extra_arg): `type` none, int, float
    or ptr; `value` the int or float (None for ptr and none)."""
    type: str
    value: int | float | None = None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ExtraArg:
        return cls(doc["type"], doc.get("value"))

    def to_json(self) -> Json:
        return {"type": "none"} if self.type == "none" else {"type": self.type, "value": self.value}


@dataclass(frozen=True)
class AbiTensor:
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> AbiTensor:
        return cls(doc["dtype"], tuple(doc["shape"]))

    def to_json(self) -> Json:
        return {"dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class Abi:
    """The kernel ABI (abi.abi_of's object): boundary dtypes and shapes in call order, the
    workspace, the extra args and the dynamic-output rule."""
    abi_version: int
    inputs: tuple[AbiTensor, ...]
    outputs: tuple[AbiTensor, ...]
    workspace_bytes: int
    extra_args: tuple[ExtraArg, ...]
    output_shape_like_input: int | None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Abi:
        return cls(doc["abi_version"], tuple(AbiTensor.from_json(t) for t in doc["inputs"]),
                   tuple(AbiTensor.from_json(t) for t in doc["outputs"]), doc["workspace_bytes"],
                   tuple(ExtraArg.from_json(a) for a in doc["extra_args"]),
                   doc["output_shape_like_input"])

    def to_json(self) -> Json:
        return {"abi_version": self.abi_version, "inputs": [t.to_json() for t in self.inputs],
                "outputs": [t.to_json() for t in self.outputs],
                "workspace_bytes": self.workspace_bytes,
                "extra_args": [a.to_json() for a in self.extra_args],
                "output_shape_like_input": self.output_shape_like_input}


@dataclass(frozen=True)
class RecipeInstance:
    """The recorded recipe instance a selection was made from."""
    recipe_id: str
    instance_id: str

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RecipeInstance:
        return cls(doc["recipe_id"], doc["instance_id"])

    def to_json(self) -> Json:
        return {"recipe_id": self.recipe_id, "instance_id": self.instance_id}


@dataclass(frozen=True)
class Build:
    """What the graph was built from (the snapshot's `build`): names, not structure."""
    family: str
    model: str
    revision: str
    options: Mapping[str, Option]
    trt_module: str
    trt_version: str

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Build:
        return cls(doc["family"], doc["model"], doc["revision"],
                   MappingProxyType(dict(doc["options"])), doc["trt_module"], doc["trt_version"])

    def to_json(self) -> Json:
        return {"family": self.family, "model": self.model, "revision": self.revision,
                "options": dict(self.options), "trt_module": self.trt_module,
                "trt_version": self.trt_version}


@dataclass(frozen=True)
class SelectionReceipt:
    """One validated region of a graph snapshot and the kernel ABI it defines (one
    `selection.json`, or one instance of a selection set)."""
    binding_id: str
    engine_role: str
    graph_fingerprint: str
    build: Build
    nodes: tuple[str, ...]
    input_tensor_ids: tuple[str, ...]
    output_tensor_ids: tuple[str, ...]
    inputs: tuple[Boundary, ...]
    outputs: tuple[Boundary, ...]
    workspace_bytes: int
    extra_args: tuple[ExtraArg, ...]
    output_shape_like_input: int | None
    recipe: RecipeInstance | None
    abi: Abi
    abi_sha256: str

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], where: str | os.PathLike[str]) -> SelectionReceipt:
        """The receipt a schema-valid document holds; its ABI and ABI hash are derived again
        from its boundary, workspace and extra args, and a difference (an edited file) is a
        UserError naming `where`."""
        receipt = cls(
            doc["binding_id"], doc["engine_role"], doc["graph_fingerprint"],
            Build.from_json(doc["build"]), tuple(doc["nodes"]), tuple(doc["input_tensor_ids"]),
            tuple(doc["output_tensor_ids"]), tuple(Boundary.from_json(t) for t in doc["inputs"]),
            tuple(Boundary.from_json(t) for t in doc["outputs"]), doc["workspace_bytes"],
            tuple(ExtraArg.from_json(a) for a in doc["extra_args"]), doc["output_shape_like_input"],
            None if doc["recipe"] is None else RecipeInstance.from_json(doc["recipe"]),
            Abi.from_json(doc["abi"]), doc["abi_sha256"])
        abi = receipt.derived_abi()
        if abi != receipt.abi.to_json() or abi_sha256(abi) != receipt.abi_sha256:
            raise UserError(f"{where}: abi/abi_sha256 do not match the receipt's boundary, "
                            f"workspace and extra args (the file was edited; select again)")
        return receipt

    def to_json(self) -> Json:
        """The document its file holds (schemas/selection)."""
        return {
            "schema_version": SCHEMA_VERSION, "binding_id": self.binding_id,
            "engine_role": self.engine_role, "graph_fingerprint": self.graph_fingerprint,
            "build": self.build.to_json(), "nodes": list(self.nodes),
            "input_tensor_ids": list(self.input_tensor_ids),
            "output_tensor_ids": list(self.output_tensor_ids),
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "workspace_bytes": self.workspace_bytes,
            "extra_args": [a.to_json() for a in self.extra_args],
            "output_shape_like_input": self.output_shape_like_input,
            "recipe": None if self.recipe is None else self.recipe.to_json(),
            "abi": self.abi.to_json(), "abi_sha256": self.abi_sha256,
        }

    def derived_abi(self) -> Json:
        """The ABI (abi.abi_of's object) the receipt's boundary, workspace, extra args and shape
        rule define, whatever its own `abi` says."""
        return abi_of([t.to_json() for t in self.inputs], [t.to_json() for t in self.outputs],
                      self.workspace_bytes, [a.to_json() for a in self.extra_args],
                      self.output_shape_like_input)

    @property
    def instance(self) -> str:
        """What names this receipt among many bound under one id: its recipe instance, or its
        binding id."""
        return self.recipe.instance_id if self.recipe else self.binding_id

    def signature(self) -> Signature:
        """The exported function's call signature (abi.Signature), its boundary tensors named."""
        return Signature.of(self.abi.to_json(), [t.name for t in (*self.inputs, *self.outputs)])


def check_instances(receipts: Sequence[SelectionReceipt], source: str) -> None:
    """Many receipts bound under one id: one binding id, disjoint regions, one ABI."""
    first, owner = receipts[0], dict[str, str]()
    for r in receipts:
        if r.binding_id != first.binding_id:
            raise UserError(f"{source}: instance {r.instance} has binding id "
                            f"{r.binding_id!r}, the others {first.binding_id!r}")
        for n in r.nodes:
            if n in owner:
                raise UserError(f"{source}: instances {owner[n]} and {r.instance} overlap at "
                                f"{n}; a node belongs to one slot")
            owner[n] = r.instance
        if r.abi_sha256 != first.abi_sha256:
            raise UserError(f"{source}: instance {r.instance} has another ABI than "
                            f"{first.instance} (boundary {_dtypes_and_shapes(r)} against "
                            f"{_dtypes_and_shapes(first)}); one binding id binds one ABI")


def _dtypes_and_shapes(r: SelectionReceipt) -> list[tuple[str, list[int]]]:
    return [(t.dtype, list(t.shape)) for t in (*r.inputs, *r.outputs)]


@dataclass(frozen=True)
class SelectionSet:
    """Many instances of one recipe bound under one binding id and one ABI (schemas/
    selection_set): each instance a receipt."""
    binding_id: str
    recipe_id: str
    abi_sha256: str
    instances: tuple[SelectionReceipt, ...]

    @classmethod
    def of(cls, receipts: Sequence[SelectionReceipt]) -> SelectionSet:
        """The set of `receipts` (made by the region validator: each from a recipe)."""
        first = receipts[0]
        if first.recipe is None:
            raise TypeError(f"selection {first.binding_id!r} names no recipe; a selection set "
                            f"holds a recipe's instances")
        return cls(first.binding_id, first.recipe.recipe_id, first.abi_sha256, tuple(receipts))

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], where: str | os.PathLike[str]) -> SelectionSet:
        """The set a document valid against the selection_set schema holds: each instance
        checked as a receipt file is (its schema, then `SelectionReceipt.from_json`), together as
        `check_instances` requires, and the set's own binding id and ABI hash against theirs."""
        receipts = []
        for i, r in enumerate(doc["instances"]):
            jsonio.validate(r, SCHEMA, f"{where}: $.instances[{i}]")
            receipts.append(SelectionReceipt.from_json(r, f"{where}: $.instances[{i}]"))
        check_instances(receipts, str(where))
        if (doc["binding_id"], doc["abi_sha256"]) != (receipts[0].binding_id,
                                                     receipts[0].abi_sha256):
            raise UserError(f"{where}: $.binding_id/$.abi_sha256 differ from its instances' (the "
                            f"file was edited; select again)")
        return cls(doc["binding_id"], doc["recipe_id"], doc["abi_sha256"], tuple(receipts))

    def to_json(self) -> Json:
        """The document its file holds (schemas/selection_set)."""
        return {"schema_version": SCHEMA_VERSION, "binding_id": self.binding_id,
                "recipe_id": self.recipe_id, "abi_sha256": self.abi_sha256,
                "instances": [r.to_json() for r in self.instances]}
