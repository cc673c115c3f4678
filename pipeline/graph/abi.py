"""The kernel ABI of a selection: what the exported function is called with, and its sha256.

The ABI is what a kernel depends on — boundary dtypes and declared shapes in call order, the
workspace size, the fixed extra args and the dynamic-output rule — and nothing a kernel cannot see
(node ids, tensor names), so an equivalent region elsewhere in the graph binds the same kernel.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, TypeGuard

from pipeline.errors import UserError

ABI_VERSION = 1
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
EXTRA_ARG_TYPES = ("none", "int", "float", "ptr")
# A binding id, as a whole string (fullmatch): the one pattern in code; each schema that names a
# binding id carries it as `^...$` in its own `$defs/binding_id` (tests/test_abi.py checks them)
BINDING_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.:@-]*"


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_extra_arg(arg, where: str) -> dict:
    """One extra arg as its canonical JSON object (floats as floats), or a UserError naming it."""
    if not isinstance(arg, dict) or arg.get("type") not in EXTRA_ARG_TYPES:
        raise UserError(f"{where}: {json.dumps(arg)} is not an extra arg (expected one of "
                        f'{{"type": "none"}}, {{"type": "int", "value": INT32}}, '
                        f'{{"type": "float", "value": FINITE}}, {{"type": "ptr", "value": null}})')
    kind = arg["type"]
    expected_keys = {"type"} if kind == "none" else {"type", "value"}
    if set(arg) != expected_keys:
        raise UserError(f"{where}: extra arg of type '{kind}' has keys {sorted(arg)}, "
                        f"expected {sorted(expected_keys)}")
    value = arg.get("value")
    if kind == "int":
        if not _is_int(value) or not INT32_MIN <= value <= INT32_MAX:
            raise UserError(f"{where}: int extra arg {json.dumps(value)} is not a signed 32-bit "
                            f"integer ({INT32_MIN}..{INT32_MAX})")
        return {"type": "int", "value": value}
    if kind == "float":
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
            raise UserError(f"{where}: float extra arg {value!r} is not a finite number")
        return {"type": "float", "value": float(value)}
    if kind == "ptr":
        if value is not None:
            raise UserError(f"{where}: ptr extra arg {json.dumps(value)} must be null (a kernel "
                            f"cannot be given a fixed address)")
        return {"type": "ptr", "value": None}
    return {"type": "none"}


def check_extra_args(extra_args, where: str = "extra args") -> list[dict]:
    if not isinstance(extra_args, (list, tuple)):
        raise UserError(f"{where}: expected a list of extra args, got {type(extra_args).__name__}")
    return [check_extra_arg(a, f"{where}[{i}]") for i, a in enumerate(extra_args)]


def abi_of(inputs: list[dict], outputs: list[dict], workspace_bytes: int, extra_args,
           output_shape_like_input: int | None) -> dict:
    """`inputs`/`outputs`: boundary descriptions in call order (only dtype and shape are used)."""
    if not _is_int(workspace_bytes) or workspace_bytes < 0:
        raise UserError(f"workspace bytes {workspace_bytes!r}: expected an integer >= 0")
    return {
        "abi_version": ABI_VERSION,
        "inputs": [{"dtype": t["dtype"], "shape": list(t["shape"])} for t in inputs],
        "outputs": [{"dtype": t["dtype"], "shape": list(t["shape"])} for t in outputs],
        "workspace_bytes": workspace_bytes,
        "extra_args": check_extra_args(extra_args),
        "output_shape_like_input": output_shape_like_input,
    }


def canonical_json(abi: dict) -> bytes:
    """Sorted keys, no whitespace, ASCII, no NaN: reproducible by any JSON library."""
    return json.dumps(abi, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def abi_sha256(abi: dict) -> str:
    return hashlib.sha256(canonical_json(abi)).hexdigest()


def extra_value(arg: dict):
    """A canonical extra arg as the Python value the kernel receives (int, float or None)."""
    kind = arg["type"]
    return int(arg["value"]) if kind == "int" else float(arg["value"]) if kind == "float" else None


def arrange(inputs: Sequence, workspace, outputs: Sequence, extras: Sequence) -> list:
    """THE call order of the exported function: boundary inputs, the workspace when there is one
    (None: no workspace), boundary outputs, extra args. `Signature.of` orders its parameters
    with it and `call_order` the values of a call, so the two cannot disagree."""
    return [*inputs, *(() if workspace is None else (workspace,)), *outputs, *extras]


@dataclass(frozen=True)
class SlotLayout:
    """Where each kind of argument stands in a slot call, in the one order `arrange` makes: a
    caller takes a call's inputs, workspace and output apart through it, not by position
    arithmetic of its own."""
    n_inputs: int
    has_workspace: bool

    @classmethod
    def of(cls, abi: Mapping) -> "SlotLayout":
        return cls(len(abi["inputs"]), abi["workspace_bytes"] > 0)

    def inputs(self, args: Sequence) -> Sequence:
        return args[:self.n_inputs]

    def workspace(self, args: Sequence):
        """The workspace argument, or None where the slot has none."""
        return args[self.n_inputs] if self.has_workspace else None

    def output(self, args: Sequence):
        """The (first) boundary output."""
        return args[self.n_inputs + self.has_workspace]


def extra_values(extra_args) -> tuple:
    """The canonical extra args as the values a call passes (`extra_value` of each)."""
    return tuple(extra_value(a) for a in extra_args)


def call_order(inputs: list, workspace, outputs: list, extra_args: list) -> list:
    """The exported function's arguments in the one order (`arrange`): boundary inputs, the
    workspace when there is one (None: no workspace), boundary outputs, extra arg values."""
    return arrange(inputs, workspace, outputs,
                   [extra_value(a) for a in extra_args] if extra_args else ())


@dataclass(frozen=True)
class Param:
    """One parameter of the exported function. `kind`: input, workspace, output or extra;
    `index`: its place among its kind; `type`: what the call passes (`tensor`, or the extra arg's
    type: none, int, float, ptr); `dtype`/`shape`: a tensor's (the workspace: UINT8
    [workspace_bytes]), None for an extra arg; `name`: a boundary tensor's name when known;
    `arg`: an extra arg's canonical JSON object."""
    kind: str
    index: int
    type: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    name: str | None = None
    arg: Mapping[str, Any] | None = None

    @property
    def label(self) -> str:
        """`input 0`, `workspace`, `output 0`, `extra 0`."""
        return "workspace" if self.kind == "workspace" else f"{self.kind} {self.index}"


@dataclass(frozen=True)
class Signature:
    """The exported function's call signature: every parameter in call order (`arrange`), and
    the ABI's dynamic-output rule. What the binding check, the printed contract and a call's
    argument order all read."""
    params: tuple[Param, ...]
    output_shape_like_input: int | None = None

    @classmethod
    def of(cls, abi: Mapping, names: Sequence[str] | None = None) -> "Signature":
        """The signature of an ABI (abi_of's object); `names`: the boundary tensors' names,
        inputs then outputs (a receipt's), when known."""
        names = list(names) if names is not None else []
        n_in = len(abi["inputs"])

        def tensors(kind: str, described, offset: int) -> list[Param]:
            return [Param(kind, i, "tensor", t["dtype"], tuple(t["shape"]),
                          names[offset + i] if offset + i < len(names) else None)
                    for i, t in enumerate(described)]
        ws = abi["workspace_bytes"]
        workspace = Param("workspace", 0, "tensor", "UINT8", (ws,)) if ws > 0 else None
        extras = [Param("extra", i, a["type"], arg=a) for i, a in enumerate(abi["extra_args"])]
        params = arrange(tensors("input", abi["inputs"], 0), workspace,
                         tensors("output", abi["outputs"], n_in), extras)
        return cls(tuple(params), abi["output_shape_like_input"])

    def of_kind(self, kind: str) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.kind == kind)

    @property
    def workspace(self) -> Param | None:
        return next(iter(self.of_kind("workspace")), None)
