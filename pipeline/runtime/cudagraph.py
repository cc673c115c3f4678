"""CUDA-graph replay of fixed-shape program steps (slots included).

The step has no data-dependent Python control flow and kernels launch on the TVM-FFI environment
stream, which the call path sets to torch's current stream: inside `torch.cuda.graph` that is the
capture stream, so bound kernels are captured with the rest of the step.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Callable

import torch

from pipeline import progress
from pipeline.errors import UserError


def require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise UserError(f"CUDA-graph replay needs a CUDA program, this one runs on {device}")


class Captured:
    """A CUDA graph with the function it was captured from. A replay reads the memory of every
    tensor that function held when captured (a closure's inputs made outside the capture), and
    nothing else keeps them alive: freed, the allocator would hand their memory to other tensors
    and a replay would read those (positions past a KV cache's end, seen in a perf gate). So the
    function lives as long as the graph."""

    def __init__(self, graph: torch.cuda.CUDAGraph, fn: Callable[[], object]):
        self.graph, self.fn = graph, fn

    def replay(self) -> None:
        self.graph.replay()


def capture(fn: Callable[[], object], device: torch.device, warmup: int = 3):
    """(Captured graph, fn's result as static buffers): `fn` warmed up `warmup` times on a side
    stream (as torch's docs require; the warm-up calls really run, side effects included), then
    captured."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with _no_collection(), torch.cuda.graph(graph):
        result = fn()
    return Captured(graph, fn), result


@contextlib.contextmanager
def _no_collection():
    """Python's cyclic garbage collector held off for a capture. A dropped graph that sits in a
    reference cycle (a Captured holds the function, which may refer back to the graph's owner) is
    destroyed when the collector next runs; run inside a capture, that destruction is an
    operation CUDA refuses there, and the capture fails."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class GraphedProgram:
    """`graphed(**inputs)` copies inputs into static buffers and replays one CUDA graph.
    Outputs are the graph's static buffers: copy them to keep them across calls."""

    def __init__(self, program, example: dict[str, torch.Tensor], warmup: int = 3):
        require_cuda(program.device)
        self.program = program
        self.static_inputs = [example[s.name].to(program.device).clone() for s in program.input_specs]
        self.graph, self.static_outputs = capture(lambda: program.step(self.static_inputs),
                                                  program.device, warmup)

    def __call__(self, **tensors) -> dict[str, torch.Tensor]:
        for spec, buf in zip(self.program.input_specs, self.static_inputs):
            buf.copy_(tensors[spec.name], non_blocking=True)
        self.graph.replay()
        return {s.name: t for s, t in zip(self.program.output_specs, self.static_outputs)}


class LazyGraphedProgram:
    """A GraphedProgram captured on the first call, from that call's inputs (their shapes are the
    program's static shapes); later calls replay it. Outputs are copied out of the graph's static
    buffers, so a result outlives the next call."""

    def __init__(self, program, warmup: int = 3):
        require_cuda(program.device)
        self.program, self.warmup = program, warmup
        self.graphed: GraphedProgram | None = None

    def __call__(self, **tensors) -> dict[str, torch.Tensor]:
        if self.graphed is None:
            with progress.spinner("capturing the step (compiling it first when compiled)"):
                self.graphed = GraphedProgram(self.program, tensors, self.warmup)
        return {k: v.clone() for k, v in self.graphed(**tensors).items()}
