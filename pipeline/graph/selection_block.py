"""A pipeline spec's `selection` block, one type per form: a recipe's instances as the graph records
them (`RecipeSelection`), or nodes named by id or by name (`NodeSelection`). Each form owns what it
asks the region validator for on a graph snapshot (`receipt`), and what a receipt made from it
must hold (`requests`), so the stages never branch on the block's keys.

`to_json` gives the block as the spec holds it: the select stage's options, so that a cached
selection stays current across this typing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

from pipeline.graph import select as sel
from pipeline.graph.abi import check_extra_args
from pipeline.graph.receipt import SelectionReceipt

# names -> node ids on a snapshot; raises a UserError naming the spec field of a name not found
NodeIds = Callable[[list[str]], list[str]]
Request = dict[str, Any]


@dataclass(frozen=True)
class RecipeSelection:
    """One recorded instance of a recipe (`instance`), or many under one binding id
    (`instances`: "all", asked for explicitly, or a list of ids; `expect_count` when given)."""
    recipe: str
    instance: str | None
    instances: Literal["all"] | tuple[str, ...] | None
    expect_count: int | None
    binding_id: str | None
    raw: Mapping[str, Any]

    @property
    def is_set(self) -> bool:
        """A selection set: one receipt per instance."""
        return self.instances is not None

    @property
    def named(self) -> str:
        """The binding id its slots get: the block's own, else the recipe id."""
        return self.binding_id or self.recipe

    def receipt(self, snap: dict, where: str,
                node_ids: NodeIds) -> SelectionReceipt | list[SelectionReceipt]:
        if self.instances is not None:
            return sel.from_recipe_instances(
                snap, self.recipe, self.instances if self.instances == "all" else list(self.instances),
                expect_count=self.expect_count, binding_id=self.binding_id, source=where)
        return sel.from_recipe(snap, self.recipe, self.instance, self.binding_id, source=where)

    def requests(self, snap: dict, where: str, node_ids: NodeIds) -> list[Request] | None:
        """What each receipt must hold, from the instances `snap` records; None when it does not
        record one asked for, or records another count than `expect_count`."""
        recorded = {r["instance_id"]: r for r in snap["recipes"] if r["recipe_id"] == self.recipe}
        ids = [self.instance] if self.instance is not None else \
            list(recorded) if self.instances == "all" else list(self.instances or ())
        if any(i not in recorded for i in ids) or len(ids) != (self.expect_count or len(ids)):
            return None
        return [{"binding_id": self.named, "nodes": recorded[i]["nodes"],
                 "workspace_bytes": recorded[i]["workspace_bytes"],
                 "extra_args": check_extra_args(recorded[i]["extra_args"], f"{where}: extra args"),
                 "output_shape_like_input": recorded[i]["output_shape_like_input"],
                 "recipe": {"recipe_id": self.recipe, "instance_id": i}} for i in ids]

    def to_json(self) -> dict[str, Any]:
        return dict(self.raw)


@dataclass(frozen=True)
class NodeSelection:
    """Nodes of the graph, by id (`nodes`) or by name (`node_names`), as one slot with the
    kernel's extra arguments, workspace and output shape rule."""
    binding_id: str
    nodes: tuple[str, ...] | None
    node_names: tuple[str, ...] | None
    workspace_bytes: int
    extra_args: tuple[Mapping[str, Any], ...]
    output_shape_like_input: int | None
    raw: Mapping[str, Any]

    @property
    def is_set(self) -> bool:
        return False

    @property
    def named(self) -> str:
        return self.binding_id

    def _node_ids(self, node_ids: NodeIds) -> list[str]:
        return list(self.nodes) if self.nodes is not None else node_ids(list(self.node_names or ()))

    def receipt(self, snap: dict, where: str, node_ids: NodeIds) -> SelectionReceipt:
        return sel.select_region(snap, self._node_ids(node_ids), binding_id=self.binding_id,
                                 workspace_bytes=self.workspace_bytes,
                                 extra_args=list(self.extra_args),
                                 output_shape_like_input=self.output_shape_like_input,
                                 source=where)

    def requests(self, snap: dict, where: str, node_ids: NodeIds) -> list[Request]:
        return [{"binding_id": self.binding_id, "nodes": self._node_ids(node_ids),
                 "workspace_bytes": self.workspace_bytes,
                 "extra_args": check_extra_args(list(self.extra_args), f"{where}: extra args"),
                 "output_shape_like_input": self.output_shape_like_input, "recipe": None}]

    def to_json(self) -> dict[str, Any]:
        return dict(self.raw)


SelectionBlock = RecipeSelection | NodeSelection


def selection_block(doc: Mapping[str, Any]) -> SelectionBlock:
    """The block of a spec already checked against the pipeline_spec schema."""
    if "recipe" in doc:
        instances = doc.get("instances")
        return RecipeSelection(doc["recipe"], doc.get("instance"),
                               instances if instances in (None, "all") else tuple(instances),
                               doc.get("expect_count"), doc.get("binding_id"), dict(doc))
    return NodeSelection(doc["binding_id"], _strings(doc.get("nodes")),
                         _strings(doc.get("node_names")), doc.get("workspace_bytes", 0),
                         tuple(doc.get("extra_args", ())), doc.get("output_shape_like_input"),
                         dict(doc))


def _strings(items) -> tuple[str, ...] | None:
    return None if items is None else tuple(items)
