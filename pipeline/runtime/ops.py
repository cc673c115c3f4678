"""Lowering rules of the reference runtime: one function per TensorRT layer type.

Rule interface (stable; pipeline/runtime/decoder_ops.py registers through it too):

    @lowering("TYPE", ..., fold=True)
    def rule(layer: dict, ctx) -> step

* `layer` is one entry of the network export's "layers": id, type, name, inputs (tensor ids, None
  for an absent optional input), outputs, attrs.
* `ctx` (pipeline.runtime.program.Lowering) is only valid during the call, at load:
    ctx.device               the torch.device the program runs on
    ctx.spec(tensor_id)      TensorSpec(id, name, dtype name "FP16"..., shape with -1 = dynamic);
                             .torch_dtype
    ctx.inp(layer, i=0)      spec of input i;  ctx.out(layer, i=0): spec of output i
    ctx.constant(tensor_id)  the tensor when known at load (weights, folded results), else None
    ctx.weight(key)          export weight `key` on ctx.device, in its checkpoint shape and dtype
    ctx.slot(key)            the callable bound to a SLOT (graph.patch.slot_key)
    ctx.accumulate(dtype)    torch dtype to accumulate matmul/softmax/normalization in
    ctx.optimized            the pipeline's mode is the optimized one (decided when it opened)
    ctx.triton               the optimized mode on CUDA: a compiled step may take the runtime's
                             Triton kernels
    ctx.error(layer, what)   a UserError naming the node, its type and name: raise it
* `step(*inputs)` gets one argument per entry of layer["inputs"] (None where absent) and returns
  the output tensor, or a tuple when the layer has several outputs (None when it has none). It
  must return the declared dtype and shape and must not branch on tensor values, so the whole
  program stays traceable by torch.compile and capturable in a CUDA graph.
* fold=True: an instance whose inputs are all constants is run once at load and its outputs become
  constants (CONSTANT -> CAST -> SHUFFLE of weights). Layers with buffers or side effects (SLOT,
  in-place cache updates) register with fold=False.

Precision: every layer returns the dtype TensorRT declares for its output (strongly typed network).
FP16/BF16 matmul, softmax, normalization and sum/average reductions accumulate in
`ctx.accumulate(dtype)` (FP32 on CPU) and round once at the layer output, mirroring TensorRT's FP32
accumulation; element-wise math stays in the declared dtype.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pipeline.graph.patch import layer_key
from pipeline.runtime.compiled import slot_call, slot_invoker

LOWERINGS: dict[str, Callable] = {}
UNFOLDABLE: set[str] = set()



def lowering(*layer_types: str, fold: bool = True):
    def register(fn):
        for t in layer_types:
            LOWERINGS[t] = fn
            if not fold:
                UNFOLDABLE.add(t)
        return fn
    return register


def axes_of(mask: int) -> tuple[int, ...]:
    """TensorRT axes bitmask -> dims, ascending."""
    return tuple(i for i in range(mask.bit_length()) if mask >> i & 1)


def _prepared(ctx, tensor_id: str, fn: Callable) -> Callable:
    """`fn` applied once at load when the input is a constant (so a step does no weight casts or
    re-layouts), else a per-call `fn`."""
    value = ctx.constant(tensor_id)
    if value is None:
        return fn
    value = fn(value)
    return lambda _x: value


# -- data movement --------------------------------------------------------------------------------
@lowering("CONSTANT")
def _constant(layer, ctx):
    key, shape = layer["attrs"]["weights"], layer["attrs"]["shape"]
    value = ctx.weight(key)
    declared = ctx.out(layer).torch_dtype
    if value.dtype != declared or value.numel() != _numel(shape):
        raise ctx.error(layer, f"weight '{key}' is {value.dtype} {list(value.shape)}, expected "
                               f"{declared} with {_numel(shape)} elements (shape {shape})")
    value = value.reshape(shape)
    return lambda: value


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@lowering("CAST", "IDENTITY")
def _cast(layer, ctx):
    dtype = ctx.out(layer).torch_dtype
    return lambda x: x.to(dtype)


def _reshape_plan(dims: list[int], in_shape: list[int], zero_is_placeholder: bool):
    """Reshape target: a tuple when known at load, else a function of the input's runtime shape
    (a 0 placeholder copying a dynamic input dim)."""
    copies = [i for i, d in enumerate(dims) if d == 0 and zero_is_placeholder]
    resolved = [in_shape[i] if i in copies else d for i, d in enumerate(dims)]
    if all(resolved[i] != -1 for i in copies):
        return tuple(resolved)
    return lambda x: [x.shape[i] if i in copies else d for i, d in enumerate(dims)]


def _identity(perm) -> bool:
    return list(perm) == list(range(len(perm)))


@lowering("SHUFFLE")
def _shuffle(layer, ctx):
    a = layer["attrs"]
    first, second, dims = a["first_transpose"], a["second_transpose"], a["reshape_dims"]
    zero = a["zero_is_placeholder"]
    inputs = layer["inputs"]
    if len(inputs) > 1 and inputs[1] is not None:
        shape_value = ctx.constant(inputs[1])
        out_shape = ctx.out(layer).shape
        if shape_value is not None:
            dims = [int(d) for d in shape_value.tolist()]
        elif -1 not in out_shape:
            dims, zero = list(out_shape), False
        else:
            raise ctx.error(layer, "dynamic reshape by a runtime shape tensor with a dynamic "
                                   "output shape is not supported")
    in_shape = list(ctx.inp(layer).shape)
    moved = [in_shape[p] for p in first]
    stages = []
    if not _identity(first):
        stages.append(lambda x: x.permute(first))
    if dims is not None:
        plan = _reshape_plan(dims, moved, zero)
        stages.append((lambda x: x.reshape(plan)) if isinstance(plan, tuple)
                      else (lambda x: x.reshape(plan(x))))
    if not _identity(second):
        stages.append(lambda x: x.permute(second))
    return _chain(stages)


def _chain(stages: list[Callable]) -> Callable:
    if not stages:
        return lambda x, *_shape: x
    if len(stages) == 1:
        f = stages[0]
        return lambda x, *_shape: f(x)

    def step(x, *_shape):
        for f in stages:
            x = f(x)
        return x
    return step


@lowering("UNSQUEEZE", "SQUEEZE")
def _to_declared_shape(layer, ctx):
    """The axes input is a build-time constant, so the declared output shape is the result."""
    shape = tuple(ctx.out(layer).shape)
    if -1 in shape:
        raise ctx.error(layer, "dynamic output shape is not supported")
    return lambda x, *_axes: x.reshape(shape)


@lowering("GATHER")
def _gather(layer, ctx):
    a = layer["attrs"]
    if a["mode"] != "DEFAULT" or a["num_elementwise_dims"] != 0:
        raise ctx.error(layer, f"gather mode {a['mode']} with num_elementwise_dims "
                               f"{a['num_elementwise_dims']} is not supported (DEFAULT, 0)")
    axis = a["axis"]
    if axis == 0 and len(ctx.inp(layer, 0).shape) == 2:
        return lambda data, idx: F.embedding(idx, data)

    def step(data, idx):
        picked = torch.index_select(data, axis, idx.reshape(-1))
        return picked.reshape(data.shape[:axis] + idx.shape + data.shape[axis + 1:])
    return step


@lowering("SLICE")
def _slice(layer, ctx):
    a = layer["attrs"]
    if any(t is not None for t in layer["inputs"][1:]):
        raise ctx.error(layer, "slice with runtime start/size/stride inputs is not supported")
    if a["mode"] not in ("STRICT_BOUNDS", "DEFAULT"):
        raise ctx.error(layer, f"slice mode {a['mode']} is not supported (STRICT_BOUNDS)")
    index, flips = [], []
    for d, (s, n, st) in enumerate(zip(a["start"], a["shape"], a["stride"])):
        if st > 0:
            index.append(slice(s, s + (n - 1) * st + 1, st))
        else:  # negative stride: torch slicing has none, pick the rows explicitly
            index.append(slice(None))
            flips.append((d, torch.arange(s, s + n * st, st, device=ctx.device)
                          if n else torch.empty(0, dtype=torch.int64, device=ctx.device)))
    index = tuple(index)

    def step(x, *_absent):
        x = x[index]
        for d, rows in flips:
            x = x.index_select(d, rows)
        return x
    return step


@lowering("CONCATENATION")
def _concat(layer, ctx):
    axis = layer["attrs"]["axis"]
    return lambda *xs: torch.cat(xs, axis)


@lowering("SELECT")
def _select(layer, ctx):
    return lambda cond, a, b: torch.where(cond, a, b)


# -- arithmetic -------------------------------------------------------------------------------
_ELEMENTWISE = {
    "SUM": torch.add, "PROD": torch.mul, "SUB": torch.sub, "MAX": torch.maximum,
    "MIN": torch.minimum, "POW": torch.pow, "AND": torch.logical_and, "OR": torch.logical_or,
    "XOR": torch.logical_xor, "EQUAL": torch.eq, "GREATER": torch.gt, "LESS": torch.lt,
    "FLOOR_DIV": lambda a, b: torch.div(a, b, rounding_mode="floor"),
}


def _supported(table: dict, key: str, layer: dict, ctx, what: str):
    """table[key], or the load-time error naming the layer and the unsupported `what`."""
    if key not in table:
        raise ctx.error(layer, f"{what} {key} is not supported")
    return table[key]


@lowering("ELEMENTWISE")
def _elementwise(layer, ctx):
    op = layer["attrs"]["op"]
    if op == "DIV":  # integer division truncates toward zero, like C
        floating = ctx.inp(layer).torch_dtype.is_floating_point
        return torch.div if floating else (lambda a, b: torch.div(a, b, rounding_mode="trunc"))
    return _supported(_ELEMENTWISE, op, layer, ctx, "element-wise operation")


@lowering("MATRIX_MULTIPLY")
def _matmul(layer, ctx):
    a = layer["attrs"]
    out = ctx.out(layer).torch_dtype
    acc = ctx.accumulate(out)
    layouts = {  # op -> (operand re-layout, dim to squeeze from the product)
        0: {"NONE": (lambda x: x.to(acc), None), "TRANSPOSE": (lambda x: x.to(acc).mT, None),
            "VECTOR": (lambda x: x.to(acc).unsqueeze(-2), -2)},
        1: {"NONE": (lambda x: x.to(acc), None), "TRANSPOSE": (lambda x: x.to(acc).mT, None),
            "VECTOR": (lambda x: x.to(acc).unsqueeze(-1), -1)},
    }
    fa, sa = layouts[0][a["op0"]]
    fb, sb = layouts[1][a["op1"]]
    fa = _prepared(ctx, layer["inputs"][0], fa)
    fb = _prepared(ctx, layer["inputs"][1], fb)
    squeeze = tuple(d for d in (sa, sb) if d is not None)
    if squeeze:
        return lambda x, y: torch.matmul(fa(x), fb(y)).squeeze(squeeze).to(out)
    return lambda x, y: torch.matmul(fa(x), fb(y)).to(out)


@lowering("SOFTMAX")
def _softmax(layer, ctx):
    axes = axes_of(layer["attrs"]["axes"])
    if len(axes) != 1:
        raise ctx.error(layer, f"softmax over axes {list(axes)}: expected exactly one axis")
    out = ctx.out(layer).torch_dtype
    acc, axis = ctx.accumulate(out), axes[0]
    return lambda x: torch.softmax(x, axis, dtype=acc).to(out)


@lowering("NORMALIZATION")
def _normalization(layer, ctx):
    a = layer["attrs"]
    if a["num_groups"] != 1:
        raise ctx.error(layer, f"num_groups {a['num_groups']} is not supported (1)")
    x_id, scale_id, bias_id = layer["inputs"]
    shape = ctx.spec(x_id).shape
    axes, eps = axes_of(a["axes"]), float(a["epsilon"])
    out = ctx.out(layer).torch_dtype
    acc = ctx.accumulate(out)
    last = shape[-1]
    row = [1] * (len(shape) - 1) + [last]
    if axes == (len(shape) - 1,) and last != -1 and all(
            list(ctx.spec(t).shape) == row[-len(ctx.spec(t).shape):] for t in (scale_id, bias_id)):
        s = _prepared(ctx, scale_id, lambda t: t.reshape(last).to(acc))
        b = _prepared(ctx, bias_id, lambda t: t.reshape(last).to(acc))
        return lambda x, scale, bias: F.layer_norm(x.to(acc), (last,), s(scale), b(bias),
                                                   eps).to(out)
    s = _prepared(ctx, scale_id, lambda t: t.to(acc))
    b = _prepared(ctx, bias_id, lambda t: t.to(acc))

    def step(x, scale, bias):
        x = x.to(acc)
        mean = x.mean(axes, keepdim=True)
        centered = x - mean
        var = centered.square().mean(axes, keepdim=True)
        return (centered * torch.rsqrt(var + eps) * s(scale) + b(bias)).to(out)
    return step


_ACTIVATIONS = {
    "RELU": lambda x, a, b: torch.relu(x),
    "SIGMOID": lambda x, a, b: torch.sigmoid(x),
    "TANH": lambda x, a, b: torch.tanh(x),
    "LEAKY_RELU": lambda x, a, b: F.leaky_relu(x, a),
    "ELU": lambda x, a, b: F.elu(x, a),
    "SELU": lambda x, a, b: b * torch.where(x > 0, x, a * torch.expm1(x)),
    "SOFTSIGN": lambda x, a, b: F.softsign(x),
    "SOFTPLUS": lambda x, a, b: a * F.softplus(b * x),
    "CLIP": lambda x, a, b: torch.clamp(x, a, b),
    "HARD_SIGMOID": lambda x, a, b: torch.clamp(a * x + b, 0.0, 1.0),
    "SCALED_TANH": lambda x, a, b: a * torch.tanh(b * x),
    "THRESHOLDED_RELU": lambda x, a, b: torch.where(x > a, x, torch.zeros_like(x)),
    "GELU_ERF": lambda x, a, b: F.gelu(x),
    "GELU_TANH": lambda x, a, b: F.gelu(x, approximate="tanh"),
}


@lowering("ACTIVATION")
def _activation(layer, ctx):
    a = layer["attrs"]
    f = _supported(_ACTIVATIONS, a["type"], layer, ctx, "activation")
    alpha, beta = float(a["alpha"]), float(a["beta"])
    return lambda x: f(x, alpha, beta)


_UNARY = {
    "EXP": torch.exp, "LOG": torch.log, "SQRT": torch.sqrt, "RECIP": torch.reciprocal,
    "ABS": torch.abs, "NEG": torch.neg, "SIN": torch.sin, "COS": torch.cos, "TAN": torch.tan,
    "SINH": torch.sinh, "COSH": torch.cosh, "ASIN": torch.asin, "ACOS": torch.acos,
    "ATAN": torch.atan, "ASINH": torch.asinh, "ACOSH": torch.acosh, "ATANH": torch.atanh,
    "CEIL": torch.ceil, "FLOOR": torch.floor, "ERF": torch.erf, "NOT": torch.logical_not,
    "SIGN": torch.sign, "ROUND": torch.round, "ISINF": torch.isinf, "ISNAN": torch.isnan,
}


@lowering("UNARY")
def _unary(layer, ctx):
    return _supported(_UNARY, layer["attrs"]["op"], layer, ctx, "unary operation")


@lowering("REDUCE")
def _reduce(layer, ctx):
    a = layer["attrs"]
    axes, keep, op = axes_of(a["axes"]), bool(a["keep_dims"]), a["op"]
    out = ctx.out(layer).torch_dtype
    acc = ctx.accumulate(out)
    if op == "SUM":
        return lambda x: torch.sum(x.to(acc), axes, keepdim=keep).to(out)
    if op == "AVG":
        return lambda x: torch.mean(x.to(acc), axes, keepdim=keep).to(out)
    if op == "MAX":
        return lambda x: torch.amax(x, axes, keepdim=keep)
    if op == "MIN":
        return lambda x: torch.amin(x, axes, keepdim=keep)
    if op == "PROD":  # torch.prod takes one dim at a time
        def step(x):
            x = x.to(acc)
            for d in axes:
                x = x.prod(d, keepdim=True)
            return (x if keep else x.squeeze(axes)).to(out)
        return step
    raise ctx.error(layer, f"reduce operation {op} is not supported")


# -- kernel slots -------------------------------------------------------------------------------
def _slot_static(*args):
    """A static SLOT as a compiled block calls it: the layer's inputs, then its workspace, output
    buffer and selector, so the slot step of every layer is this one function."""
    *xs, ws, out, selector = args
    slot_call(selector, [x.contiguous() for x in xs], ws, out)
    return out


def _slot_dynamic(like: int) -> Callable:
    """`_slot_static` for an output shaped like input `like`, allocated per call."""
    def call(*args):
        *xs, ws, selector = args
        inputs = [x.contiguous() for x in xs]
        out = torch.empty_like(inputs[like])
        slot_call(selector, inputs, ws, out)
        return out
    return call


@lowering("SLOT", fold=False)
def _slot(layer, ctx):
    """Calls the bound kernel as fn(*inputs, [workspace], out, *extras); under torch.compile through
    the opaque custom op trtmc::slot_call (pipeline/runtime/compiled.py), so the step stays one graph;
    the kernel writes `out` in place. A static output is preallocated once (zeros) and reused by
    every call, as is the workspace; a dynamic output is allocated per call with the shape of the
    like-input. Gates call this step exactly as a run does (nothing is poisoned: no argument
    marks a gate); they check every call by shadow execution (pipeline/runtime/shadow.py).
    The step's `traced_as` is how a compiled block calls it (`_slot_static`, `_slot_dynamic`)."""
    a = layer["attrs"]
    fn = ctx.slot(layer_key(layer))
    spec = ctx.out(layer)
    dtype, device = spec.torch_dtype, ctx.device
    ws = (torch.empty(a["workspace_bytes"], dtype=torch.uint8, device=device)
          if a["workspace_bytes"] > 0 else None)
    extras = a["extra_args"]
    if -1 not in spec.shape:
        buffer = torch.zeros(spec.shape, dtype=dtype, device=device)

        def step(*xs):
            invoke([x.contiguous() for x in xs], ws, buffer)
            return buffer
        invoke, selector = slot_invoker(fn, extras, step)
        step.traced_as = (_slot_static, [ws, buffer, selector])
        return step
    like = a["output_shape_like_input"]
    if like is None:
        raise ctx.error(layer, f"output shape {list(spec.shape)} is dynamic and "
                               f"output_shape_like_input is null")

    def dynamic_step(*xs):
        inputs = [x.contiguous() for x in xs]
        out = torch.empty_like(inputs[like])  # the validator made dtype and shape rule equal
        invoke(inputs, ws, out)
        return out
    invoke, selector = slot_invoker(fn, extras, dynamic_step)
    dynamic_step.traced_as = (_slot_dynamic(like), [ws, selector])
    return dynamic_step
