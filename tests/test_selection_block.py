"""A spec's selection block, one type per form: each example spec's block reads as its form, says
what it binds under, and gives back the block the spec holds (the select stage's options)."""
from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from pipeline.graph.selection_block import NodeSelection, RecipeSelection, selection_block

EXAMPLES = sorted((Path(__file__).parent.parent / "examples" / "pipelines").glob("*.json"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_block_reads_as_its_form_and_gives_back_the_spec_bytes(path):
    raw = orjson.loads(path.read_bytes())["selection"]
    block = selection_block(raw)
    assert orjson.dumps(block.to_json()) == orjson.dumps(raw)
    if "recipe" in raw:
        assert isinstance(block, RecipeSelection)
        assert block.is_set == ("instances" in raw)
        assert block.named == raw.get("binding_id", raw["recipe"])
    else:
        assert isinstance(block, NodeSelection) and not block.is_set
        assert block.named == raw["binding_id"]
        assert block.workspace_bytes == raw.get("workspace_bytes", 0)


SNAP = {"recipes": [{"recipe_id": "r@1", "instance_id": f"layer{i}", "nodes": [f"node:{i}"],
                     "workspace_bytes": 0, "extra_args": [], "output_shape_like_input": 0}
                    for i in range(3)]}


def test_a_recipe_set_asks_for_every_recorded_instance_and_nothing_else():
    def no_names(names):
        raise AssertionError("a recipe names no nodes")
    every = selection_block({"recipe": "r@1", "instances": "all", "expect_count": 3})
    asked = every.requests(SNAP, "$.selection", no_names)
    assert [r["nodes"] for r in asked] == [["node:0"], ["node:1"], ["node:2"]]
    assert {r["binding_id"] for r in asked} == {"r@1"}
    # another count than expected, or an instance the graph does not record: nothing to hold to
    assert selection_block({"recipe": "r@1", "instances": "all", "expect_count": 2}).requests(
        SNAP, "$.selection", no_names) is None
    assert selection_block({"recipe": "r@1", "instances": ["layer7"]}).requests(
        SNAP, "$.selection", no_names) is None
    one = selection_block({"recipe": "r@1", "instance": "layer1", "binding_id": "mine"})
    (request,) = one.requests(SNAP, "$.selection", no_names)
    assert request["binding_id"] == "mine" and request["recipe"] == {"recipe_id": "r@1",
                                                                     "instance_id": "layer1"}


def test_nodes_by_name_are_resolved_by_the_caller():
    block = selection_block({"binding_id": "b", "node_names": ["a", "c"]})
    (request,) = block.requests({}, "$.selection", lambda names: [f"node:{n}" for n in names])
    assert request["nodes"] == ["node:a", "node:c"] and request["recipe"] is None
