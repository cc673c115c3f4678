"""Lowering rules of the reference runtime: one function per TensorRT layer type.

A rule is called once at load with the layer (from the network export) and the Lowering context,
and returns a step `f(*input_tensors) -> tuple(output_tensors)` with everything resolved (no dict
lookups or data-dependent Python branches at call time). Decoder layer types live in their own
module and register here through the same decorator.
"""
from __future__ import annotations

from typing import Callable

LOWERINGS: dict[str, Callable] = {}


def lowering(*layer_types: str):
    def register(fn):
        for t in layer_types:
            LOWERINGS[t] = fn
        return fn
    return register
