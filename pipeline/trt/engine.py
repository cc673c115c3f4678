"""The TensorRT runtime: deserialize a plan, with its slot plugins bound, and run it.

It needs a GPU that the installed TensorRT module can execute on (`trt.capabilities().can_execute`); a plan
with slot plugins also needs full TensorRT, since only full TensorRT builds plugin layers. Neither
exists on the machines of this project, so this path has never run: `load` refuses here with a
clear error, and every execution goes through the reference runtime (docs/runtimes.md).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch

from pipeline.kernels.bind import BoundKernel
from pipeline import dtypes
from pipeline.errors import UserError
from pipeline.trt.slot_plugin import SlotPluginCreator, register_slot_plugins
from pipeline.trt import capabilities, LOGGER, MODULE, dtype_name, trt


class TensorRTEngine:
    """A deserialized plan and one execution context; `run` binds torch CUDA buffers by tensor
    name and enqueues with `execute_async_v3` on torch's current stream (no synchronization)."""

    def __init__(self, engine, context, creator: SlotPluginCreator | None):
        self.engine, self.context, self.creator = engine, context, creator
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.input_names = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if n not in self.input_names]

    @classmethod
    def load(cls, plan: bytes | str | os.PathLike, kernels: Mapping[str, BoundKernel]
             ) -> "TensorRTEngine":
        """Slot plugins are registered before deserialization, which recreates each plugin
        through the creator (so an unknown binding id or ABI hash fails here)."""
        capabilities().require("can_execute", "the TensorRT runtime (deserializing and running a plan)")
        creator = register_slot_plugins(kernels) if kernels else None
        data = plan if isinstance(plan, bytes) else Path(plan).read_bytes()
        engine = trt.Runtime(LOGGER).deserialize_cuda_engine(data)
        if engine is None:
            raise UserError(f"{MODULE} could not deserialize the plan ({len(data)} bytes): built "
                            f"by another TensorRT version or for another GPU, or a slot plugin "
                            f"was refused")
        context = engine.create_execution_context()
        if context is None:
            raise UserError(f"{MODULE}: creating an execution context failed")
        return cls(engine, context, creator)

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Outputs are allocated per call with the shapes the context infers from the inputs;
        they are ready once torch's current stream reaches them."""
        if set(inputs) != set(self.input_names):
            raise UserError(f"TensorRT engine inputs: got {sorted(inputs)}, expected "
                            f"{sorted(self.input_names)}")
        ctx, device = self.context, torch.device("cuda", torch.cuda.current_device())
        bound = []  # alive until enqueued, so no output is allocated over a converted input;
        # freed after in stream order, so later work on this stream cannot overtake the plan
        for name in self.input_names:
            want = dtypes.torch_dtype(dtype_name(self.engine.get_tensor_dtype(name)))
            t = inputs[name].to(device=device, dtype=want).contiguous()
            bound.append(t)
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        outputs = {}
        for name in self.output_names:
            dtype = dtypes.torch_dtype(dtype_name(self.engine.get_tensor_dtype(name)))
            outputs[name] = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=dtype, device=device)
            ctx.set_tensor_address(name, outputs[name].data_ptr())
        stream = torch.cuda.current_stream(device)
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise UserError(f"{MODULE}: execute_async_v3 failed (see the TensorRT log)")
        return outputs
