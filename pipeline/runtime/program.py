"""The reference runtime's program: a network export lowered once into one flat step function.

Lowering resolves every layer to a step (pipeline/runtime/ops.py), keeps only the layers the
outputs need (dead-code elimination stopping at the given inputs, which is how a region runs on its
own), runs constant-only subgraphs at load (weights are cast and re-laid out once), places
constants on the device once, and generates straight-line Python over integer tensor slots:
`t12 = f3(t7, c2)`, each tensor released after its last use. The step has no dictionary lookups
and no data-dependent control flow, so torch.compile and CUDA-graph capture can take it whole.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from pipeline import dtypes
from pipeline.errors import UserError
from pipeline.graph.model import Graph
from pipeline.modes import Mode
from pipeline.runtime import decoder_ops  # noqa: F401 - registers the decoder layer rules
from pipeline.runtime import passes
from pipeline.runtime.codegen import PROGRAM_FILE, run_make
from pipeline.runtime.ops import LOWERINGS, UNFOLDABLE



@dataclass(frozen=True)
class TensorSpec:
    id: str
    name: str
    dtype: str                # export dtype name: "FP32", "FP16", "INT32", ...
    shape: tuple[int, ...]    # -1 = dynamic

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtypes.torch_dtype(self.dtype)


class Lowering:
    """What a lowering rule may ask while the program is built (see ops.py for the interface)."""

    def __init__(self, export: dict, weights: Mapping[str, torch.Tensor], device: torch.device,
                 slots: Mapping[str, Callable], mode: Mode = Mode.EAGER):
        self.device = device
        self.mode = mode  # the pipeline's, decided when it opened
        self.specs = {t["id"]: TensorSpec(t["id"], t["name"], t["dtype"], tuple(t["shape"]))
                      for t in export["tensors"]}
        self.constants: dict[str, torch.Tensor] = {}
        # how each constant was made from the bundle's weights: equal origins, equal values, in
        # any program of the pipeline (a device address is no identity: freed memory is reused)
        self.origins: dict[str, tuple] = {}
        self._weights, self._slots = weights, slots

    def spec(self, tensor_id: str) -> TensorSpec:
        return self.specs[tensor_id]

    def inp(self, layer: dict, i: int = 0) -> TensorSpec:
        return self.specs[layer["inputs"][i]]

    def out(self, layer: dict, i: int = 0) -> TensorSpec:
        return self.specs[layer["outputs"][i]]

    def constant(self, tensor_id: str) -> torch.Tensor | None:
        return self.constants.get(tensor_id)

    def weight(self, key: str) -> torch.Tensor:
        if key not in self._weights:
            raise UserError(f"weights: no tensor for export weight '{key}'")
        return self._weights[key].detach().to(self.device)

    def slot(self, key: str) -> Callable:
        if key not in self._slots:
            raise UserError(f"slot:{key}: no kernel bound to slot '{key}'")
        return self._slots[key]

    def accumulate(self, dtype: torch.dtype) -> torch.dtype:
        """FP32 for 16-bit floats on CPU (TensorRT accumulates in FP32; CPU half kernels do not
        reliably); CUDA kernels already accumulate 16-bit inputs in FP32."""
        if dtype in (torch.float16, torch.bfloat16) and self.device.type == "cpu":
            return torch.float32
        return dtype

    @property
    def optimized(self) -> bool:
        """The lowering passes run (the optimized mode)."""
        return self.mode.optimized

    @property
    def triton(self) -> bool:
        """A step may take the runtime's Triton kernels: where the mode compiles and graphs its
        steps, the optimized mode on CUDA (the eager mode keeps every rule's own torch ops)."""
        return self.mode.graphed(self.device)

    def error(self, layer: dict, what: str) -> UserError:
        return UserError(f"{layer['id']} ({layer['type']} '{layer['name']}'): {what}")


def _check_input(spec: TensorSpec, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != spec.torch_dtype or \
            value.dim() != len(spec.shape) or any(
                d not in (-1, n) for d, n in zip(spec.shape, value.shape)):
        got = (f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise UserError(f"input '{spec.name}' ({spec.id}): expected {spec.dtype} "
                        f"{list(spec.shape)}, got {got}")
    return value


@dataclass(frozen=True)
class Plan:
    """What a step was generated from: its per-call (step, layer) code, the constants that code
    reads, its input and output tensor ids and its role (blocks.py cuts it into blocks)."""
    code: list
    constants: dict[str, torch.Tensor]
    inputs: list[str]
    outputs: list[str]
    role: str


class Program:
    """A lowered network: `program(**inputs_by_name) -> {output name: tensor}`, or the flat
    `program.step([inputs in input_specs order]) -> [outputs in output_specs order]`."""

    def __init__(self, step: Callable, input_specs: list[TensorSpec],
                 output_specs: list[TensorSpec], device: torch.device, source: str, plan: Plan):
        self.step = step
        self.input_specs, self.output_specs = input_specs, output_specs
        self.device, self.source, self.plan = device, source, plan

    def __call__(self, **tensors) -> dict[str, torch.Tensor]:
        names = [s.name for s in self.input_specs]
        unknown = sorted(set(tensors) - set(names))
        missing = [n for n in names if n not in tensors]
        if unknown or missing:
            raise UserError(f"program inputs: expected {names}, "
                            + (f"missing {missing}" if missing else f"unknown {unknown}"))
        args = [_check_input(s, tensors[s.name]).to(self.device) for s in self.input_specs]
        try:
            outputs = self.step(args)
        except UserError:
            raise
        except Exception as e:  # a layer the export describes wrongly (an axis out of range...)
            said = _first_words(e)
            raise UserError(f"{_failing_layer(e, self.source)}: {type(e).__name__}: {said}") from e
        return {s.name: t for s, t in zip(self.output_specs, outputs)}

    @classmethod
    def lower(cls, export: dict, weights: Mapping[str, torch.Tensor], *,
              device: str | torch.device = "cpu", slots: Mapping[str, Callable] | None = None,
              inputs: list[str] | None = None, outputs: list[str] | None = None,
              mode: Mode = Mode.EAGER, shared: dict | None = None) -> Program:
        """`mode` optimized: run the lowering passes (pipeline/runtime/passes.py) on the steps,
        and let the rules take the mode's Triton kernels (`Lowering.triton`);
        `shared`: the passes' results shared between the programs of one pipeline (one weights
        mapping)."""
        ctx = Lowering(export, weights, torch.device(device), slots or {}, mode)
        inputs = list(export["inputs"] if inputs is None else inputs)
        outputs = list(export["outputs"] if outputs is None else outputs)
        for t in inputs + outputs:
            if t not in ctx.specs:
                raise UserError(f"{t}: no such tensor in the {export['engine_role']} network "
                                f"export")
        layers = Graph.of_export(export).live(inputs, outputs)
        for layer in layers:
            if layer["type"] not in LOWERINGS:
                raise UserError(f"{layer['id']}: layer type {layer['type']} ('{layer['name']}') is "
                                f"not supported by the reference runtime")
        uses: dict[str, int] = {t: 1 for t in outputs}
        for layer in layers:
            for t in layer["inputs"]:
                if t is not None:
                    uses[t] = uses.get(t, 0) + 1
        available = set(inputs)
        code = []  # (step, layer) of layers that run per call
        for layer in layers:
            missing = [t for t in layer["inputs"] if t is not None and t not in available]
            if missing:
                raise UserError(f"{layer['id']}: input {missing[0]} is used before it is produced "
                                f"(layers are not in topological order)")
            available.update(layer["outputs"])
            with _naming(ctx, layer):
                step = LOWERINGS[layer["type"]](layer, ctx)
                _check_arity(step, layer)
                if layer["type"] in UNFOLDABLE or not all(
                        t is None or t in ctx.constants for t in layer["inputs"]):
                    code.append((step, layer))
                    continue
                _fold(ctx, step, layer, uses)
        if ctx.optimized:
            code = passes.lower_weight_gemms(ctx, code, uses, shared)
        if ctx.triton:
            code = passes.fuse_row_chains(ctx, code, outputs)
            code = passes.fuse_traced_chains(ctx, code, outputs)
        return cls(*_generate(ctx, code, inputs, outputs, export["engine_role"]))


def _first_words(error: Exception) -> str:
    """What an error says first, on one line: its first line, and the line after where the first
    only introduces it (a compiler's "backend='inductor' raised:")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = lines[:2] if len(lines) > 1 and lines[0].endswith(":") else lines[:1]
    return " ".join(said)


def _failing_layer(error: Exception, source: str) -> str:
    """The layer whose line of the generated step raised `error` (its `# node:N TYPE` comment),
    as torch.fx names the node that failed; "the step" when no such line is on the traceback."""
    lines, tb, found = source.splitlines(), error.__traceback__, "the step"
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(PROGRAM_FILE) and \
                0 < tb.tb_lineno <= len(lines) and "  # " in lines[tb.tb_lineno - 1]:
            found = lines[tb.tb_lineno - 1].rsplit("  # ", 1)[1]
        tb = tb.tb_next
    return found


def _storages(*roots) -> dict[int, int]:
    """{storage address: bytes} of every tensor reachable from `roots` through tuples, lists
    and function closures."""
    storages: dict[int, int] = {}
    seen: set[int] = set()
    todo: list = list(roots)
    while todo:
        v = todo.pop()
        if isinstance(v, torch.Tensor):
            storages[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        elif isinstance(v, (tuple, list)):
            todo.extend(v)
        elif callable(v) and id(v) not in seen:
            seen.add(id(v))
            todo.extend(c.cell_contents for c in getattr(v, "__closure__", None) or ())
    return storages


def resident_bytes(*programs: Program) -> int:
    """Bytes of the distinct tensor storages the programs' steps hold (weights in their final
    form, folded constants, merged weights), each storage counted once across the programs:
    what they keep resident, and how a test sees that no weight is held twice."""
    return sum(_storages(*(p.step for p in programs)).values())


def _indexes(layer: dict, k: int) -> bool:
    """Input k of `layer` is a table the layer reads a row of per index: a GATHER's data (a token
    embedding), a rotary embedding's cos and sin by position (the fused chain's inputs 2 and 3,
    the fused attention inputs' 4 and 5, passes.py, always by position)."""
    by_position = len(layer["inputs"]) > 3 and layer["inputs"][3] is not None
    return ((layer["type"], k) in {("GATHER", 0), ("ROTARY", 2), ("ROTARY", 3),
                                   ("NORM_ROTARY_CACHE", 4), ("NORM_ROTARY_CACHE", 5)}
            or layer["type"] == "ROTARY_EMBEDDING" and k in (1, 2) and by_position)


def read_bytes(program: Program) -> int:
    """Bytes of the constants one call of `program` reads: what it holds (`resident_bytes`)
    less the tables it only indexes (`_indexes`: a call reads a row of them per index or
    position), unless something else reads the same memory whole."""
    plan = program.plan
    indexed: dict = {}
    whole: dict = {}
    for step, layer in plan.code:
        whole.update(_storages(step))  # tensors a step holds are read whole
        for k, t in enumerate(layer["inputs"]):
            if t in plan.constants:
                into = indexed if _indexes(layer, k) else whole
                into.update(_storages(plan.constants[t]))
    return resident_bytes(program) - sum(n for at, n in indexed.items() if at not in whole)


# what a lowering rule or a folded step raises on a layer whose attrs or tensors are malformed
_MALFORMED = (KeyError, TypeError, IndexError, ValueError, AttributeError, RuntimeError)


@contextlib.contextmanager
def _naming(ctx: Lowering, layer: dict):
    """An error lowering or folding `layer` as one line naming the layer (a hand-edited export:
    a missing attr, a wrong type, an index out of range), chained to the original."""
    try:
        yield
    except UserError as e:
        if str(e).startswith(f"{layer['id']} "):
            raise
        raise ctx.error(layer, str(e)) from e
    except _MALFORMED as e:
        raise ctx.error(layer, f"malformed layer, cannot be lowered ({type(e).__name__}: "
                               f"{_first_line(e)})") from e


def _check_arity(step: Callable, layer: dict) -> None:
    """The step takes as many tensors as the layer lists inputs (else the first call fails)."""
    try:
        signature = inspect.signature(step)
    except (TypeError, ValueError):  # a builtin (torch.div) has none to check
        return
    signature.bind(*layer["inputs"])


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else repr(e)


def _fold(ctx: Lowering, step: Callable, layer: dict, uses: dict[str, int]) -> None:
    """Run a constant-only layer now; drop constants nothing else needs (e.g. FP32 weights once
    cast), so the program holds each weight once, in its final form."""
    result = step(*[None if t is None else ctx.constants[t] for t in layer["inputs"]])
    results = result if len(layer["outputs"]) > 1 else (result,)
    ctx.constants.update(zip(layer["outputs"], results))
    made = (layer["type"], json.dumps(layer["attrs"], sort_keys=True),
            tuple(None if t is None else ctx.origins[t] for t in layer["inputs"]))
    for i, t in enumerate(layer["outputs"]):
        ctx.origins[t] = (made, i, ctx.spec(t).dtype, ctx.spec(t).shape)
    for t in layer["inputs"]:
        if t is not None:
            uses[t] -= 1
            if uses[t] == 0:
                del ctx.constants[t]


def _generate(ctx: Lowering, code: list, inputs: list[str], outputs: list[str], role: str):
    """Straight-line Python for the per-call layers; names are t<N> for tensor:N, c<i> for
    constants and f<i> for steps, all bound once as closure cells."""
    const_names: dict[str, str] = {}
    last_use: dict[str, int] = {}
    for i, (_, layer) in enumerate(code):
        for t in layer["inputs"]:
            if t is not None:
                if t in ctx.constants:
                    const_names.setdefault(t, f"c{len(const_names)}")
                else:
                    last_use[t] = i
    for t in outputs:
        if t in ctx.constants:
            const_names.setdefault(t, f"c{len(const_names)}")

    def name(t):
        return "None" if t is None else const_names.get(t) or f"t{int(t.split(':')[1])}"

    keep = set(outputs)
    body = [f"    {', '.join(name(t) for t in inputs)}{',' if len(inputs) == 1 else ''} = args"
            if inputs else "    del args"]
    for i, (_, layer) in enumerate(code):
        outs = ", ".join(name(t) for t in layer["outputs"])
        call = f"f{i}({', '.join(name(t) for t in layer['inputs'])})"
        note = ascii(f"{layer['id']} {layer['type']}")[1:-1]  # escaped: no id ends the comment
        body.append(f"    {outs} = {call}  # {note}" if outs else f"    {call}  # {note}")
        dead = [t for t in layer["inputs"] + layer["outputs"]
                if t is not None and t not in keep and t not in const_names
                and last_use.get(t, i) == i]
        if dead:
            body.append(f"    del {', '.join(dict.fromkeys(name(t) for t in dead))}")
    body.append(f"    return [{', '.join(name(t) for t in outputs)}]")
    params = [f"f{i}" for i in range(len(code))] + list(const_names.values())
    source = (f"def make({', '.join(params)}):\n  def step(args):\n"
              + "\n".join("  " + line for line in body) + "\n  return step\n")
    # named by its source, not by an address: the same program has the same name in every process
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    step = run_make(source, f"{PROGRAM_FILE} {role} {digest}>",
                    [*[s for s, _ in code], *[ctx.constants[t] for t in const_names]])
    plan = Plan(code, {t: ctx.constants[t] for t in const_names}, inputs, outputs, role)
    return (step, [ctx.spec(t) for t in inputs], [ctx.spec(t) for t in outputs], ctx.device,
            source, plan)
