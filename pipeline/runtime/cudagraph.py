"""CUDA-graph replay of a fixed-shape program step (slots included).

The step has no data-dependent Python control flow and kernels launch on the TVM-FFI environment
stream, which the call path sets to torch's current stream: inside `torch.cuda.graph` that is the
capture stream, so bound kernels are captured with the rest of the step.
"""
from __future__ import annotations

import torch

from pipeline.errors import UserError


class GraphedProgram:
    """`graphed(**inputs)` copies inputs into static buffers and replays one CUDA graph.
    Outputs are the graph's static buffers: copy them to keep them across calls."""

    def __init__(self, program, example: dict[str, torch.Tensor], warmup: int = 3):
        if program.device.type != "cuda":
            raise UserError(f"CUDA-graph replay needs a CUDA program, this one runs on {program.device}")
        self.program = program
        self.static_inputs = [example[s.name].to(program.device).clone() for s in program.input_specs]
        side = torch.cuda.Stream(program.device)
        side.wait_stream(torch.cuda.current_stream(program.device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch's docs require
            for _ in range(warmup):
                program.step(self.static_inputs)
        torch.cuda.current_stream(program.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_outputs = program.step(self.static_inputs)

    def __call__(self, **tensors) -> dict[str, torch.Tensor]:
        for spec, buf in zip(self.program.input_specs, self.static_inputs):
            buf.copy_(tensors[spec.name], non_blocking=True)
        self.graph.replay()
        return {s.name: t for s, t in zip(self.program.output_specs, self.static_outputs)}
