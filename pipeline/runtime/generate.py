"""Token generation over lowered decoder programs, driven by the family's DecoderIO contract
(input/output names, roles; pipeline/families).

The runtime owns the KV cache: one zeroed [1, KV, C, D] buffer per past key/value input, passed to
every call and updated in place by the KV_CACHE_UPDATE layers. Step state
(token, position, past and total length) lives in device tensors that each decode step advances
on the device, so a step needs no host values except the sampled token (read for EOS).

Split layout: `prefill` runs the prompt from an empty cache, `decode` one token per step. Unified
layout: the same program does both; its `attention_mask` input is filled per call (additive:
0 where key j <= past + i, the dtype's lowest value elsewhere).

On CUDA, a prompt's prefill replays a CUDA graph captured for its length (PrefillGraph; a cache
keeps the PREFILL_GRAPHS lengths used last), so a prompt costs its GPU work rather than one host
launch per operation; a length not seen before pays one eager run and the capture.
On CUDA, greedy decode replays one CUDA graph per step (GreedyDecodeGraph): the graph reads the
cache buffers themselves and small static state buffers, and writes the argmax and the advanced
state back, so steps run back to back with no host work; the host reads the tokens every
`eos_check_every` steps (only at the end when there is no EOS id) and drops what follows an EOS.
With `compile`, the decode program's step is torch.compile'd whole first (pipeline/runtime/
compiled.py; slots are an opaque custom op), and that compiled step is what the graph captures.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from pipeline import progress
from pipeline.errors import UserError
from pipeline.families import DecoderIO
from pipeline.runtime.compiled import compiled_program
from pipeline.runtime.cudagraph import capture, require_cuda


@dataclass(frozen=True)
class Sampling:
    """Greedy (argmax), or temperature + top-p (nucleus) sampling from a seeded generator."""
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.greedy and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise UserError(f"sampling: temperature {self.temperature} must be > 0 and top_p "
                            f"{self.top_p} in (0, 1]")


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]                 # the new tokens, EOS included when it stopped there
    stop_reason: str                     # "eos" | "max_new_tokens"
    logits: list[torch.Tensor] = field(default_factory=list)  # per new token, FP32 [vocab] (if kept)


class _Buffers(dict):
    """Cache buffers by input name (a dict subclass, so a weak reference can name it)."""


# The cache buffers of one shape set on one device, shared by the KVCaches of one process (a gate's
# judge holds the native pipeline, the slot bundle's and an in-situ reopening; its kernel host two):
# every run resets the cache before it starts, and a process runs one at a time. They drop out
# when no cache holds them.
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class KVCache:
    """Cache buffers for every past key/value input of `program`, on its device, zeroed by every
    run before it starts; the buffers are the process's one set of that shape (`_SHARED`), the
    captured graphs and compiled steps this cache's own."""

    def __init__(self, program, io: DecoderIO = DecoderIO()):
        self.io = io
        specs = tuple((s.name, tuple(s.shape), s.torch_dtype) for s in program.input_specs
                      if io.is_cache(s.name))
        if not specs:
            raise UserError(f"decoder program has no {io.past_key}N / {io.past_value}N inputs "
                            f"(not a decoder network export)")
        device = program.device
        if device.type == "cuda" and device.index is None:  # the GPU a plain "cuda" means now
            device = torch.device("cuda", torch.cuda.current_device())
        key = (specs, device)
        shared = _SHARED.get(key)
        if shared is None:
            # ordinary tensors even when made in inference mode: a run outside it writes them too
            with torch.inference_mode(False):
                shared = _SHARED[key] = _Buffers(
                    (name, torch.zeros(shape, dtype=dtype, device=device)) for name, shape, dtype in specs)
        self.buffers: dict[str, torch.Tensor] = shared
        self.capacity = next(iter(self.buffers.values())).shape[2]
        self.graphs: dict = {}  # decode program -> its GreedyDecodeGraph over these buffers
        self.prefill_graphs: OrderedDict = OrderedDict()  # (program, length) -> PrefillGraph
        self.compiled: dict = {}  # (decode program, backend) -> its compiled twin

    def reset(self) -> None:
        for b in self.buffers.values():
            b.zero_()

    def drop_graphs(self) -> None:
        """Forget every captured CUDA graph, the prefills' and the decode step's: each replays
        the slot kernels chosen when it was captured (`Pipeline.use_kernels`)."""
        self.graphs.clear()
        self.prefill_graphs.clear()


def _choose(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """Next token id as an INT64 [1] device tensor from FP32 [vocab] logits."""
    if sampling.greedy:
        return logits.argmax().reshape(1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    # keep the smallest prefix whose mass reaches top_p (always at least the top token)
    drop = sorted_p.cumsum(-1) - sorted_p >= sampling.top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return order[torch.multinomial(sorted_p, 1, generator=gen)]


class _Step:
    """Inputs of one program call, built from the device-side state."""

    def __init__(self, program, cache: KVCache):
        names = {s.name: s for s in program.input_specs}
        self.program, self.cache, self.io = program, cache, cache.io
        mask = self.io.attention_mask
        self.mask_dtype = names[mask].torch_dtype if mask in names else None
        self.columns = torch.arange(cache.capacity, device=program.device)

    def __call__(self, ids: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        """ids INT32 [1, S] at positions past..past+S-1 -> FP32 logits [vocab] of the last one."""
        return self.program(**self.inputs(ids, past))[self.io.logits][0, -1]

    def inputs(self, ids: torch.Tensor, past: torch.Tensor) -> dict[str, torch.Tensor]:
        """The program's inputs by name for ids INT32 [1, S] at positions past..past+S-1."""
        s = ids.shape[1]
        offsets = torch.arange(s, dtype=torch.int32, device=ids.device)
        io = self.io
        inputs = {io.input_ids: ids, io.position_ids: (past + offsets).reshape(1, s),
                  io.past_length: past, io.total_length: past + s, **self.cache.buffers}
        if self.mask_dtype is not None:
            visible = self.columns[None, :] <= (past + offsets)[:, None]
            mask = torch.zeros(visible.shape, dtype=self.mask_dtype, device=ids.device)
            inputs[io.attention_mask] = mask.masked_fill(
                ~visible, torch.finfo(self.mask_dtype).min).reshape(1, 1, s, -1)
        return inputs


class GreedyDecodeStep:
    """A greedy decode step of `program` over `cache`'s own buffers that keeps its state on the
    device: `ids` [1, 1] (the last token) and `past` [1] (its position). One call runs the program
    at that position, writes the argmax to `history[past + 1]` (history is indexed by position)
    and advances `ids`/`past`, so calls chain with no host involvement."""

    def __init__(self, program, cache: KVCache):
        device = program.device
        self.ids = torch.zeros(1, 1, dtype=torch.int32, device=device)
        self.past = torch.zeros(1, dtype=torch.int32, device=device)
        self.history = torch.zeros(cache.capacity + 1, dtype=torch.int64, device=device)
        self._run = _Step(program, cache)

    def __call__(self) -> None:
        token = self._run(self.ids, self.past).argmax().reshape(1)
        self.history.index_copy_(0, (self.past + 1).to(torch.long), token)
        self.ids.copy_(token.reshape(1, 1))
        self.past.add_(1)

    replay = __call__

    def start(self, token: torch.Tensor, position: int) -> None:
        """Set the state to `token` (INT64 [1], on the device) at `position`."""
        self.history[position:position + 1] = token
        self.ids.copy_(token.reshape(1, 1))
        self.past.fill_(position)


class GreedyDecodeGraph(GreedyDecodeStep):
    """The step captured once as a CUDA graph; `replay()` runs it. Capture runs the step for real
    (warm-up from state 0), writing the cache at positions 0..warmup: reset the cache after it."""

    def __init__(self, program, cache: KVCache, warmup: int = 2):
        require_cuda(program.device)
        super().__init__(program, cache)
        self.graph, _ = capture(super().__call__, program.device, warmup)
        self.replay = self.graph.replay  # type: ignore[method-assign]  # no call between


PREFILL_GRAPHS = 4  # prompt lengths whose captured prefill a cache keeps (each holds its own memory)


class PrefillGraph:
    """The prefill of prompts of one length from the empty cache, captured as a CUDA graph.
    Calling it copies the ids in and replays; the result is the graph's own FP32 logits [vocab]
    of the last position, valid until the next replay. Capture runs the prefill for real
    (warm-up), writing cache positions 0..length-1: reset the cache after it."""

    def __init__(self, program, cache: KVCache, length: int, warmup: int = 1):
        require_cuda(program.device)
        ids = self.ids = torch.zeros(1, length, dtype=torch.int32, device=program.device)
        past = torch.zeros(1, dtype=torch.int32, device=program.device)
        run = _Step(program, cache)
        # no reference back to self: a graph a cache drops goes then, with its memory
        self.graph, self.logits = capture(lambda: run(ids, past), program.device, warmup)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.graph.replay()
        return self.logits


def _prefill_graph(program, cache: KVCache, length: int) -> PrefillGraph:
    """The cache's graph for `length` (most recently used last), captured when it has none; the
    least recently used is dropped past PREFILL_GRAPHS."""
    graphs, key = cache.prefill_graphs, (program, length)
    if key in graphs:
        graphs.move_to_end(key)
        return graphs[key]
    while len(graphs) >= PREFILL_GRAPHS:
        graphs.popitem(last=False)
    with progress.spinner(f"capturing the prefill of a {length}-token prompt"):
        graphs[key] = PrefillGraph(program, cache, length)
    return graphs[key]


def _decode_graph(program, cache: KVCache) -> GreedyDecodeGraph:
    if program not in cache.graphs:
        with progress.spinner("capturing the decode step (compiling it first when compiled)"):
            cache.graphs[program] = GreedyDecodeGraph(program, cache)
    return cache.graphs[program]


def _compiled(program, cache: KVCache, backend: str):
    if (program, backend) not in cache.compiled:
        cache.compiled[program, backend] = compiled_program(program, backend=backend)
    return cache.compiled[program, backend]


def _take(out: Generation, token_ids: list[int], eos: set[int]) -> bool:
    """Append tokens to `out` up to and including the first EOS id; True when it stopped there."""
    for t in token_ids:
        out.token_ids.append(t)
        if t in eos:
            out.stop_reason = "eos"
            return True
    return False


def _replay(stepper: GreedyDecodeStep, out: Generation, first: torch.Tensor,
            max_new_tokens: int, eos: set[int], every: int) -> None:
    """Decode by chained steps from the first token; read tokens back every `every` steps (only
    at the end without EOS ids) and keep them up to the first EOS."""
    n = len(out.prompt_ids)
    stepper.start(first, n)
    done, read = 1, n  # tokens decided so far; next history position not yet read
    every = every if eos else max_new_tokens
    while True:
        for _ in range(min(every, max_new_tokens - done)):
            stepper.replay()
            done += 1
        if _take(out, stepper.history[read:n + done].tolist(), eos) or done == max_new_tokens:
            return
        read = n + done


def generate(prefill, decode, prompt_ids: list[int], max_new_tokens: int, *,
             sampling: Sampling = Sampling(), eos_token_ids: tuple[int, ...] = (),
             cache: KVCache | None = None, keep_logits: bool = False, cuda_graph: bool = True,
             eos_check_every: int = 16, compile: bool | str = False) -> Generation:
    """Prefill the prompt, then decode until an EOS id or `max_new_tokens`.

    `prefill`/`decode` are lowered Programs of the split roles; for the unified layout pass the
    single engine's program as both (or `decode=None`). `cache` lets a caller reuse buffers across
    prompts (it is reset here). Unless `cuda_graph` is False, on CUDA the prefill replays a CUDA
    graph captured for the prompt's length, and greedy decode without `keep_logits` one captured
    once per decode program and cache; the result is the same tokens as eager. `compile` (True
    for Inductor, or a torch.compile backend name) runs decode steps through the compiled step,
    graphed or not; the prefill is never compiled."""
    decode = decode or prefill
    if not prompt_ids:
        raise UserError("generate: the prompt is empty (expected at least one token)")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens {max_new_tokens}: expected at least 1", param="max_new_tokens")
    if eos_check_every < 1:
        raise UserError(f"eos_check_every {eos_check_every}: expected at least 1")
    cache = cache or KVCache(prefill)
    if compile:
        decode = _compiled(decode, cache, "inductor" if compile is True else compile)
    need = len(prompt_ids) + max_new_tokens - 1
    if need > cache.capacity:
        raise UserError(f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens needs a "
                        f"cache of {need}, the engine's max_cache_length is {cache.capacity}")
    graphed = (cuda_graph and sampling.greedy and not keep_logits and max_new_tokens > 1
               and decode.device.type == "cuda")
    # before the reset: a capture writes the cache
    graph = _decode_graph(decode, cache) if graphed else None
    device = prefill.device
    prompt_graph = _prefill_graph(prefill, cache, len(prompt_ids)) \
        if cuda_graph and device.type == "cuda" else None
    cache.reset()
    gen = None if sampling.greedy else torch.Generator(device=device).manual_seed(sampling.seed)
    eos = set(eos_token_ids)
    run_decode = _Step(decode, cache)
    past = torch.zeros(1, dtype=torch.int32, device=device)
    ids = torch.tensor([prompt_ids], dtype=torch.int32, device=device)
    logits = prompt_graph(ids) if prompt_graph else _Step(prefill, cache)(ids, past)
    past = past + len(prompt_ids)
    out = Generation(list(prompt_ids), [], "max_new_tokens")
    if graph is not None:
        _replay(graph, out, logits.argmax().reshape(1), max_new_tokens, eos, eos_check_every)
        return out
    for i in range(max_new_tokens):
        if keep_logits:
            out.logits.append(logits.detach().to("cpu", copy=True))
        token = _choose(logits, sampling, gen)
        if _take(out, [int(token)], eos):
            break
        if i + 1 < max_new_tokens:
            logits = run_decode(token.to(torch.int32).reshape(1, 1), past)
            past = past + 1
    return out


def eos_ids(config: dict, tokenizer=None) -> tuple[int, ...]:
    """EOS ids from the model config (an int or a list) and the tokenizer."""
    ids = config.get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def _programs(pipeline) -> tuple:
    """(prefill, decode) programs; split layout: two engines; a single engine (role `decode`)
    also serves the prompt (decode None)."""
    roles, io = pipeline.programs, pipeline.family.io
    return (roles[io.prefill_role], roles[io.decode_role]) if io.prefill_role in roles \
        else (roles[io.decode_role], None)


def teacher_forced_logits(pipeline, prompt_ids: list[int], token_ids: list[int]) -> list[torch.Tensor]:
    """FP32 logits [vocab] (host copies) after the prompt, then after each of `token_ids` fed in
    turn whatever the pipeline would have chosen: two pipelines compared on one token sequence.
    It runs in the pipeline's one KV cache, reset first, so nothing a generation left there is read."""
    prefill, decode = _programs(pipeline)
    cache = pipeline.kv_cache
    if len(prompt_ids) + len(token_ids) > cache.capacity:
        raise UserError(f"{len(prompt_ids)} prompt + {len(token_ids)} forced tokens exceed the "
                        f"cache of {cache.capacity}")
    cache.reset()
    run_prefill, run_decode = _Step(prefill, cache), _Step(decode or prefill, cache)
    device = prefill.device
    ids = lambda x: torch.tensor([x], dtype=torch.int32, device=device)  # noqa: E731
    host = lambda t: t.detach().to("cpu", torch.float32, copy=True)  # noqa: E731
    past = torch.zeros(1, dtype=torch.int32, device=device)
    out = [host(run_prefill(ids(prompt_ids), past))]
    for i, t in enumerate(token_ids):
        out.append(host(run_decode(ids([t]), past + len(prompt_ids) + i)))
    return out


def generate_texts(pipeline, prompts: list[str], max_new_tokens: int, *, greedy: bool = True,
                   temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                   cuda_graph: bool = True, compile: bool | str | None = None) -> list[dict]:
    """One record per prompt for a decoder Pipeline (runtime/pipeline.py): prompt, ids and
    decoded text. `compile` defaults to the pipeline's mode (compiled in the optimized mode); the
    pipeline's one KV cache keeps the compiled step and its CUDA graph across calls."""
    prefill, decode = _programs(pipeline)
    tok = pipeline.bundle.tokenizer()
    sampling = Sampling(greedy, temperature, top_p, seed)
    compile = pipeline.mode.optimized if compile is None else compile
    cache = pipeline.kv_cache
    records = []
    for prompt in prompts:
        ids = tok.encode(prompt)
        g = generate(prefill, decode, ids, max_new_tokens, sampling=sampling,
                     eos_token_ids=eos_ids(pipeline.bundle.config, tok), cache=cache,
                     cuda_graph=cuda_graph, compile=compile)
        records.append({"prompt": prompt, "prompt_ids": g.prompt_ids, "token_ids": g.token_ids,
                        "text": tok.decode(g.token_ids),
                        "stop_reason": g.stop_reason})
    return records
