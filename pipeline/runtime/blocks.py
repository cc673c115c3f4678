"""A program's step cut into its repeated blocks, each distinct block compiled once.

A decoder's step is the same layer over and over (36 times in Qwen3-8B), each over its own
weights. torch.compile of the whole step traces and compiles every copy: most of a first call's
time, with or without a warm compile cache. Cut into blocks whose steps are the same objects and
whose tensors (weights included) are arguments, the copies are one function: Dynamo traces it
once and Inductor compiles it once, and the other layers call the same compiled code.

Where a block starts is read from the export's layer names (`decoder.layers.7.mlp.x` is in block
`decoder.layers.7`). A cut is placed after the block's last GEMM or slot call rather than at its
first layer: those are opaque kernels nothing fuses across anyway, while the residual add that
follows them fuses with the next block's normalization. Steps are the same when their code,
globals and closure values are: each rule builds a fresh closure per layer, so equal closures are
made one (`same_steps`). A slot's step holds its layer's buffers and kernel selector; its
`traced_as` form takes them as arguments, so a slot in every layer is one step too. Any other
step holding a tensor (a weight the eager mode prepared at load) is never merged, so a block
with one stays its own. When most segments are distinct (a region, a one-layer network), the
step compiles whole.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.runtime.codegen import PROGRAM_FILE, run_make

BARRIERS = {"MATRIX_MULTIPLY", "SLOT"}  # opaque kernels: a cut after one loses no fusion


def block_of(layer: dict) -> str | None:
    """The repeated block a layer belongs to: its name up to the first all-digit component
    (`decoder.layers.7`), from the first layer of a merged or fused one; None outside blocks."""
    parts = layer["name"].split(", ")[0].split(" ")[-1].split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit() and i > 0:
            return ".".join(parts[:i + 1])
    return None


def cuts(code: list) -> list[int]:
    """Indices of `code` where a segment starts: after the last barrier of each block (at the
    next block's first layer when a block has none)."""
    found, current, barrier = [], None, None
    for i, (_, layer) in enumerate(code):
        block = block_of(layer)
        if block is not None and block != current:
            if current is not None:
                found.append(barrier + 1 if barrier is not None else i)
            current, barrier = block, None
        if block == current and block is not None and layer["type"] in BARRIERS:
            barrier = i
    if barrier is not None:
        found.append(barrier + 1)
    return sorted({c for c in found if 0 < c < len(code)})


def _value_key(value, seen: set):
    """What a closure value contributes to a step's identity: plain values by value, functions
    by code, globals and closure, anything else (tensors, objects with state) by identity."""
    if value is None or isinstance(value, (bool, int, str, bytes, torch.dtype, torch.device)):
        return (type(value), value)
    if isinstance(value, float):
        return (float, value.hex())
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_value_key(v, seen) for v in value))
    if isinstance(value, types.FunctionType) and id(value) not in seen:
        seen = seen | {id(value)}
        cells = []
        for cell in value.__closure__ or ():
            try:
                cells.append(_value_key(cell.cell_contents, seen))
            except ValueError:  # an empty cell
                cells.append(("empty",))
        # code compares by value (not by file name): a generated step made twice is one; the
        # globals by module (generated code has none of its own)
        return ("function", value.__code__, value.__globals__.get("__name__"),
                _value_key(value.__defaults__, seen),
                _value_key(tuple(sorted((value.__kwdefaults__ or {}).items())), seen),
                tuple(cells))
    return ("object", id(value))


def same_steps(steps: list[Callable]) -> list[Callable]:
    """`steps` with each one replaced by the first equal one (`_value_key`)."""
    first: dict = {}
    return [first.setdefault(_value_key(step, set()), step) for step in steps]


@dataclass
class _Segment:
    """One segment's code, its arguments (tensor ids, in order of first use) and the tensors it
    hands on (in order of production)."""
    code: list
    ins: list[str]
    outs: list[str]

    def source(self) -> str:
        """The segment as a function of its arguments, every name canonical (a0.. arguments,
        v0.. results, f0.. steps), so two copies of a block read the same."""
        names = {t: f"a{i}" for i, t in enumerate(self.ins)}
        last = {t: i for i, (_, layer) in enumerate(self.code)
                for t in layer["inputs"] if t is not None}
        lines = []
        for i, (_, layer) in enumerate(self.code):
            for t in layer["outputs"]:
                names.setdefault(t, f"v{len(names) - len(self.ins)}")
            args = ", ".join("None" if t is None else names[t] for t in layer["inputs"])
            outs = ", ".join(names[t] for t in layer["outputs"])
            call = f"f{i}({args})"  # no node in a comment: the copies share this line
            lines.append(f"    {outs} = {call}" if outs else f"    {call}")
            dead = [names[t] for t in dict.fromkeys(layer["inputs"] + layer["outputs"])
                    if t is not None and t not in self.outs and last.get(t, i) == i]
            if dead:
                lines.append(f"    del {', '.join(dead)}")
        lines.append(f"    return ({''.join(names[t] + ', ' for t in self.outs)})")
        return "def block({}):\n{}\n".format(", ".join(names[t] for t in self.ins), "\n".join(lines))


def _segments(code: list, outputs: list[str]) -> list[_Segment]:
    starts = [0] + cuts(code)
    parts = [code[a:b] for a, b in zip(starts, starts[1:] + [len(code)])]
    later: list[set] = [set(outputs)]
    for part in reversed(parts[1:]):
        later.insert(0, later[0] | {t for _, layer in part for t in layer["inputs"] if t})
    segments = []
    for part, needed in zip(parts, later):
        made, ins = set(), []
        for _, layer in part:
            ins += [t for t in layer["inputs"] if t is not None and t not in made and t not in ins]
            made.update(layer["outputs"])
        outs = [t for _, layer in part for t in layer["outputs"] if t in needed]
        segments.append(_Segment(part, ins, list(dict.fromkeys(outs))))
    return segments


def _define(source: str, filename: str, steps: list[Callable]) -> Callable:
    text = f"def make({', '.join(f'f{i}' for i in range(len(steps)))}):\n" + "\n".join(
        "  " + line for line in source.splitlines()) + "\n  return block\n"
    return run_make(text, filename, steps)


def segmented_step(program, compile_block: Callable[[Callable], Callable]) -> Callable | None:
    """`program`'s step as its segments in order, each distinct segment made once by
    `compile_block` (e.g. torch.compile) and shared by its copies; None when more than about
    half the segments are distinct (then the whole step compiles faster as one: every compile
    has a fixed cost)."""
    plan = program.plan
    constants, steps, layers = dict(plan.constants), [], []
    for layer_step, layer in plan.code:
        traced = getattr(layer_step, "traced_as", None)  # a step holding its layer's own tensors
        if traced is not None:
            layer_step, held = traced
            ids = [None if t is None else f"{layer['id']}:held:{i}" for i, t in enumerate(held)]
            constants.update((i, t) for i, t in zip(ids, held) if i is not None)
            layer = {**layer, "inputs": layer["inputs"] + ids}
        steps.append(layer_step)
        layers.append(layer)
    code = list(zip(same_steps(steps), layers))
    segments = _segments(code, plan.outputs)
    keys = [(s.source(), tuple(id(step) for step, _ in s.code)) for s in segments]
    copies = len(keys) - len(set(keys))
    if not copies or copies < len(keys) // 2:  # mostly distinct: each compile has a fixed cost
        return None
    made: dict = {}
    for key, segment in zip(keys, segments):
        if key not in made:
            filename = f"{PROGRAM_FILE} {plan.role} block {len(made)}>"
            made[key] = compile_block(_define(key[0], filename, [s for s, _ in segment.code]))
    calls = [made[key] for key in keys]
    inputs, outputs = plan.inputs, plan.outputs
    last = {t: i for i, s in enumerate(segments) for t in s.ins if t not in constants}
    drops = [[t for t, at in last.items() if at == i and t not in outputs]
             for i in range(len(segments))]

    def step(args):
        values = dict(zip(inputs, args))
        for segment, call, drop in zip(segments, calls, drops):
            got = call(*[constants[t] if t in constants else values[t] for t in segment.ins])
            values.update(zip(segment.outs, got))
            for t in drop:  # each activation freed after its last use, as the step frees it
                del values[t]
        return [constants[t] if t in constants else values[t] for t in outputs]
    step.blocks = len(made)  # type: ignore[attr-defined]  # distinct segments compiled: what a test counts
    return step
