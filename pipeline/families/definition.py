"""A selection's region as a FlashInfer-Bench Definition: the same kernel task, handed to
FlashInfer-Bench (flashinfer-ai/flashinfer-bench) instead of trtmc's gates.

A Definition names its axes (a fixed dimension of the ABI is a `const` axis with its value, a
dynamic one, -1, a `var` axis), its inputs and outputs in call order with their dtypes, and a
`reference`: Python source whose `run(...)` computes the outputs from the inputs. Only a family
knows what a region computes, so a Definition is made only for a recorded instance of a recipe
whose family states its semantics (`Family.references`, a `RegionReference`); the reference and
every name in the document are that family's constant text, and the Definition's name is the
family's template filled with integers of the ABI and the dtype's name. Any other selection is
refused in one line.
"""
from __future__ import annotations

import ast
import os
import string
from typing import Any, Mapping

from pipeline import dtypes, jsonio
from pipeline.errors import UserError
from pipeline.families import RegionReference, registry
from pipeline.graph.receipt import Abi, AbiTensor, SelectionReceipt
from pipeline.graph.select import load_selection, receipts_of, recorded_instance

SCHEMA = "flashinfer_bench_definition"  # beyond it: check_definition
NAME_DTYPE = "dtype"  # the one name-template field that is no axis: the outputs' dtype


def references() -> dict[str, RegionReference]:
    """Recipe id -> what its region computes, over every family."""
    return {recipe: ref for family in registry() for recipe, ref in family.references.items()}


def _recipe_of(receipt: SelectionReceipt, snapshot: dict[str, Any] | None) -> str | None:
    """The recipe a selection is an instance of: the one its receipt names, or, for a selection
    made by node ids on `snapshot`, the recorded instance whose region it is."""
    if receipt.recipe is not None:
        return receipt.recipe.recipe_id
    found = recorded_instance(snapshot, receipt.nodes) if snapshot is not None else None
    return None if found is None else str(found["recipe_id"])


def definition_of(selection: SelectionReceipt | list[SelectionReceipt], source: str,
                  snapshot: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Definition document of a selection (a receipt, or a set's instances: one ABI, one
    Definition). `source` names the selection in every refusal; `snapshot`: the graph a node
    selection was made on, where its nodes may be a recorded recipe instance."""
    receipt = receipts_of(selection)[0]  # a set's instances share one recipe and one ABI
    recipe = _recipe_of(receipt, snapshot)
    known = references()
    if recipe is None or recipe not in known:
        what = (f"recipe {recipe}, whose family states no reference for it" if recipe else
                "a selection of nodes that is no recorded recipe instance" if snapshot is not None
                else "a selection of nodes that names no recipe (`trtmc graph select --definition` "
                     "looks its nodes up among the snapshot's recorded recipe instances)")
        raise UserError(f"{source}: {what}; a FlashInfer-Bench Definition needs the region's "
                        f"semantics, stated only for {', '.join(sorted(known)) or 'no recipe'}")
    doc = _definition(known[recipe], recipe, receipt.abi, source)
    check_definition(doc, source)
    return doc


def _axis_values(ref: RegionReference, recipe: str, abi: Abi, source: str) -> dict[str, int]:
    """Axis name -> its ABI dimension (-1: dynamic), the same wherever the axis appears."""
    values: dict[str, int] = {}
    for kind, declared, given in (("input", ref.inputs, abi.inputs),
                                  ("output", ref.outputs, abi.outputs)):
        if len(declared) != len(given):
            raise UserError(f"{source}: {len(given)} {kind}s, but recipe {recipe}'s region has "
                            f"{len(declared)}; the ABI is not the recipe's (select again)")
        for i, ((name, axes), tensor) in enumerate(zip(declared, given)):
            if len(axes) != len(tensor.shape):
                raise UserError(f"{source}: {kind}[{i}] has shape {list(tensor.shape)}, but recipe "
                                f"{recipe}'s {name} has rank {len(axes)}")
            for axis, dim in zip(axes, tensor.shape):
                if values.setdefault(axis, dim) != dim:
                    raise UserError(f"{source}: {kind}[{i}] has shape {list(tensor.shape)}: axis "
                                    f"{axis} of recipe {recipe} is {dim} there and {values[axis]} "
                                    f"elsewhere")
    return values


def _dtype(tensor: AbiTensor, where: str) -> str:
    name = dtypes.BY_NAME[tensor.dtype].flashinfer_bench if tensor.dtype in dtypes.BY_NAME else None
    if name is None:
        raise UserError(f"{where} is {tensor.dtype}, which FlashInfer-Bench has no dtype for")
    return name


def _name(ref: RegionReference, values: Mapping[str, int], dtype: str, recipe: str,
          source: str) -> str:
    """The family's template filled with the const axes' integers (and the dtype's name)."""
    filled: dict[str, str | int] = {}
    for _, field, _, _ in string.Formatter().parse(ref.name):
        if field is None or field == NAME_DTYPE:
            continue
        if values.get(field, -1) < 0:
            raise UserError(f"{source}: axis {field} of recipe {recipe} is dynamic in the ABI; "
                            f"the Definition's name needs its value")
        filled[field] = int(values[field])
    return ref.name.format(**filled, **{NAME_DTYPE: dtype})


def _definition(ref: RegionReference, recipe: str, abi: Abi, source: str) -> dict[str, Any]:
    values = _axis_values(ref, recipe, abi, source)
    axes: dict[str, dict[str, Any]] = {}
    for axis, dim in values.items():
        axes[axis] = ({"type": "const", "value": dim} if dim >= 0 else {"type": "var"}) | \
            {"description": ref.axes[axis]}

    def tensors(kind: str, declared: tuple[tuple[str, tuple[str, ...]], ...],
                given: tuple[AbiTensor, ...]) -> dict[str, dict[str, Any]]:
        return {name: {"shape": list(names), "dtype": _dtype(t, f"{source}: {kind}[{i}]"),
                       "description": ref.tensors[name]}
                for i, ((name, names), t) in enumerate(zip(declared, given))}
    inputs = tensors("input", ref.inputs, abi.inputs)
    outputs = tensors("output", ref.outputs, abi.outputs)
    doc: dict[str, Any] = {
        "name": _name(ref, values, next(iter(outputs.values()))["dtype"], recipe, source),
        "type": ref.op_type, "description": ref.description, "axes": axes,
        "inputs": inputs, "outputs": outputs, "reference": ref.reference}
    if ref.tags:
        doc["tags"] = list(ref.tags)
    if ref.constraints:
        doc["constraints"] = list(ref.constraints)
    return doc


def check_definition(doc: Mapping[str, Any], where: str | os.PathLike[str]) -> None:
    """FlashInfer-Bench's rules for a Definition that its schema cannot state: every shape entry
    names an axis, the reference parses and defines a top-level `run`, each constraint is a
    Python expression. The schema (`SCHEMA`) first."""
    jsonio.validate(doc, SCHEMA, where)
    for kind in ("inputs", "outputs"):
        for name, spec in doc[kind].items():
            for axis in spec["shape"]:
                if axis not in doc["axes"]:
                    raise UserError(f"{where}: $.{kind}.{name}.shape: names axis {axis!r}, which "
                                    f"$.axes does not declare")
    try:
        module = ast.parse(doc["reference"])
        for constraint in doc.get("constraints", ()):
            ast.parse(constraint, mode="eval")
    except SyntaxError as e:
        raise UserError(f"{where}: a reference or constraint that is not Python: {e.msg} "
                        f"(line {e.lineno})") from None
    if not any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in module.body):
        raise UserError(f"{where}: $.reference defines no top-level function run")


def save_definition(doc: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Checked (`check_definition`), then written whole or not at all, its keys in their order
    (the inputs in call order: FlashInfer-Bench calls `run` with them so)."""
    check_definition(doc, path)
    jsonio.write_json(path, doc, SCHEMA, sort_keys=False)


def write_definition(selection: str | os.PathLike[str], output: str | os.PathLike[str]
                     ) -> dict[str, Any]:
    """The Definition of a selection file (a receipt or a selection set), written to `output`."""
    doc = definition_of(load_selection(selection), str(selection))
    save_definition(doc, output)
    return doc
