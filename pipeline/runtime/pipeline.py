"""A pipeline: one bundle, its bound kernels, and the lowered programs of its roles.

Binding happens only here, while the pipeline is constructed. To bind other kernels, open a new
pipeline from the same bundle with another manifest; `Pipeline.use_kernels` only switches slots
between their bound kernel and their native region.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Collection, Iterator, Mapping

import torch

from pipeline.bundle.reader import Bundle
from pipeline.dtypes import torch_dtype
from pipeline.errors import UserError
from pipeline.families import SINGLE_ENGINE_ROLE, EncoderIO, Family, family_named
from pipeline.graph.abi import SlotLayout
from pipeline.graph.patch import layer_key, slot_key, slots_of
from pipeline.kernels.bind import bind_slots
from pipeline.log import get as log_topic
from pipeline.modes import Mode
from pipeline.models.tokenizer import Tokenizer
from pipeline.runtime.shadow import Audit, Shadow, checked

log = log_topic("pipeline")


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"device {device}: expected cpu, cuda, cuda:N or auto", param="device") from None
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"device {device}: expected cpu, cuda, cuda:N or auto", param="device")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device}: no CUDA device is available here (use cpu)", param="device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        names = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise UserError(f"device {device}: this machine has {count} CUDA device"
                        f"{'s' if count > 1 else ''} ({names})", param="device")
    return dev


class BundleFacts:
    """What a pipeline knows from its bundle alone, and the runs made of its encoder: shared by a
    pipeline run in this process and one whose kernels run in a kernel host
    (pipeline/host/hosted.py), which give it `bundle`, `device` and `encoder`."""
    bundle: Bundle
    device: torch.device

    @property
    def encoder(self) -> Callable[..., Mapping[str, torch.Tensor]]:
        """The encoder's engine, called with its inputs by name: the subclass's."""
        raise NotImplementedError

    @property
    def family(self) -> Family:
        return family_named(self.bundle.family)

    @property
    def kind(self) -> str:
        return self.family.kind

    @property
    def sequence_length(self) -> int:
        return self.bundle.manifest["build_options"]["sequence_length"]

    @property
    def precision(self) -> torch.dtype:
        """The build precision's dtype: what the engine computes in, so the rounding step of its
        outputs (FP32 logits from a BF16 engine step by BF16's spacing)."""
        return torch_dtype(self.family.precisions[self.bundle.manifest["build_options"]["precision"]])

    def encode_text(self, tokenizer: Tokenizer, text: str) -> dict[str, torch.Tensor]:
        """The encoder's inputs for one text, padded to the fixed sequence length."""
        io = self.family.io
        ids = tokenizer.encode(text)
        if len(ids) > self.sequence_length:  # said, never silent: the rest of the text is not seen
            log.warning("input of %d tokens cut to the bundle's sequence length %d", len(ids),
                        self.sequence_length)
            ids = tokenizer.encode(text, max_length=self.sequence_length)
        pad = tokenizer.pad_token_id or 0
        n = len(ids)
        input_ids = torch.full((self.sequence_length,), pad, dtype=torch.int32)
        input_ids[:n] = torch.tensor(ids, dtype=torch.int32)
        mask = torch.zeros(self.sequence_length, dtype=torch.int32)
        mask[:n] = 1
        return {io.input_ids: input_ids.to(self.device), io.attention_mask: mask.to(self.device)}

    def require_decoder(self) -> None:
        """Generation needs a decoder bundle: a UserError for an encoder's (the family's
        workload decides)."""
        self.family.workload.check_generates(
            f"{self.bundle.path}: run needs a decoder bundle (use `trtmc embed`)")

    def close(self) -> None:
        """End what runs the kernels: a kernel host's process (nothing for a pipeline whose
        kernels run in this process)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def embed(self, texts: list[str], *, pooling: str | None = None,
              normalize: bool = False) -> list[torch.Tensor]:
        """Full last hidden state [S, H] per text (padded positions included). `pooling="mean"`:
        the FP32 mean over the real tokens only (the attention mask), [H]; `normalize`: every
        vector (each row of [S, H], or the pooled one) scaled to unit L2 norm, in FP32."""
        self.family.workload.check_embeds(f"{self.bundle.path}: embed needs an encoder bundle, "
                                          f"this is a {self.bundle.family} decoder (use `trtmc run`)")
        if pooling not in (None, "mean"):
            raise UserError(f"pooling {pooling}: expected mean (or none)", param="pooling")
        io, tok = self.family.io, self.bundle.tokenizer()
        assert isinstance(io, EncoderIO)  # the workload refused a decoder's bundle above
        out = []
        for text in texts:
            inputs = self.encode_text(tok, text)
            hidden = self.encoder(**inputs)[io.hidden]
            if pooling == "mean":
                mask = inputs[io.attention_mask].to(torch.float32).unsqueeze(-1)
                hidden = (hidden.float() * mask).sum(0) / mask.sum()
            if normalize:
                hidden = torch.nn.functional.normalize(hidden.float(), dim=-1)
            out.append(hidden)
        return out


@dataclass(frozen=True)
class Pipeline(BundleFacts):
    bundle: Bundle
    device: torch.device
    kernels: Mapping[str, object]
    programs: Mapping[str, object]
    regions: Mapping[str, "Region"]   # slot-ready bundles: each slot's kernel and native region
    mode: Mode = Mode.EAGER            # decided once, by open_pipeline
    shadow: Shadow | None = None       # every slot call checked (a gate's)
    audit: Audit | None = None         # slot calls drawn for a judge
    opened: Mapping = field(default_factory=dict)  # open_pipeline's arguments, for `reopen`
    switch: "KernelSwitch | None" = None  # which slots call their kernel (`use_kernels`)
    weights: Mapping = field(default_factory=dict, repr=False)  # verified, on `device` (`reopen`)

    @property
    def encoder(self):
        """The encoder's single engine: its program, or in the optimized mode that program
        compiled whole and replayed as a CUDA graph (captured on the first call)."""
        program = self.programs[SINGLE_ENGINE_ROLE]
        if not self.mode.optimized:
            return program
        if SINGLE_ENGINE_ROLE not in self._graphed:
            from pipeline.runtime.compiled import compiled_program
            from pipeline.runtime.cudagraph import LazyGraphedProgram
            self._graphed[SINGLE_ENGINE_ROLE] = LazyGraphedProgram(compiled_program(program))
        return self._graphed[SINGLE_ENGINE_ROLE]

    @functools.cached_property
    def _graphed(self) -> dict:
        return {}

    def use_kernels(self, keys) -> None:
        """From now on only the slots `keys` call their kernel, the others their native region
        (the correctness gate's bisection): nothing is loaded, lowered or compiled again, since
        the choice is read at every slot call; captured CUDA graphs are dropped, as they replay
        the choice made when they were captured."""
        assert self.switch is not None  # every Pipeline open_pipeline makes has one
        self.switch.on = _slot_keys(self.bundle, self.regions, keys)
        if "kv_cache" in self.__dict__:
            self.kv_cache.drop_graphs()
        for graphed in self._graphed.values():
            graphed.graphed = None

    @functools.cached_property
    def kv_cache(self):
        """A decoder's one KV cache (reset per prompt); it also keeps the decode step's compiled
        twin and CUDA graph, so they are made once per pipeline."""
        from pipeline.runtime.generate import KVCache, _programs
        return KVCache(_programs(self)[0], self.family.io)

    def generate(self, prompts: list[str], max_new_tokens: int, **sampling) -> list[dict]:
        self.require_decoder()
        from pipeline.runtime.generate import generate_texts
        return generate_texts(self, prompts, max_new_tokens, **sampling)

    def teacher_forced_logits(self, prompt_ids: list[int], token_ids: list[int]) -> list[torch.Tensor]:
        """FP32 logits [vocab] after the prompt, then after each of `token_ids` fed in turn
        (runtime/generate.py: teacher_forced_logits)."""
        from pipeline.runtime.generate import teacher_forced_logits
        return teacher_forced_logits(self, prompt_ids, token_ids)


@dataclass(frozen=True)
class Region:
    """A slot of the pipeline: its bound kernel and the native region it replaced, lowered on
    its own (boundary inputs in, boundary output out) so a probe can run both side by side."""
    binding_id: str
    key: str                # graph.patch.slot_key: the binding id, or ID:INSTANCE of many
    engine_role: str
    abi: Mapping
    kernel: object
    native: object          # Program of the removed layers
    input_names: tuple[str, ...]
    output_name: str
    input_ids: tuple[str, ...]  # the boundary inputs' tensor ids in the role's network export

    @functools.cached_property
    def layout(self) -> SlotLayout:
        """Where the call's inputs, workspace and output stand (graph/abi.py)."""
        return SlotLayout.of(self.abi)


def _regions(b: Bundle, kernels, weights, device, mode: Mode, shared: dict) -> dict[str, Region]:
    """Each slot's native region lowered as the pipeline's roles are (in `mode`), so a gate
    times the region the engine would run."""
    from pipeline.runtime.program import Program
    out = {}
    for entry, export, key, slot in _bundle_slots(b):
        names = {t["id"]: t["name"] for t in export["tensors"]}
        native = Program.lower({**export, "layers": slot["attrs"]["native_layers"]}, weights,
                               device=device, inputs=slot["inputs"], outputs=slot["outputs"],
                               mode=mode, shared=shared)
        out[key] = Region(entry["binding_id"], key, entry["engine_role"], entry["abi"],
                          kernels[entry["binding_id"]], native,
                          tuple(names[t] for t in slot["inputs"]), names[slot["outputs"][0]],
                          tuple(slot["inputs"]))
    return out


def _region_weight_keys(b: Bundle) -> frozenset[str]:
    """The weights the slots' native layers read (their CONSTANT layers, runtime/ops.py)."""
    return frozenset(layer["attrs"]["weights"] for *_, slot in _bundle_slots(b)
                     for layer in slot["attrs"]["native_layers"] if layer["type"] == "CONSTANT")


def _bundle_slots(b: Bundle) -> Iterator[tuple[dict, dict, str, dict]]:
    """(bundle slot entry, its role's network export, slot key, the slot layer) per slot."""
    for entry in b.slots:
        export = b.network(entry["engine_role"])
        key = slot_key(entry["binding_id"], entry.get("instance_id"))
        yield entry, export, key, next(s for s in slots_of(export) if layer_key(s) == key)


class KernelSwitch:
    """The slots that call their kernel (`on`); every other slot runs its native region."""

    def __init__(self, on: frozenset[str]):
        self.on = on

    def call(self, key: str, kernel: Callable, native: Callable) -> Callable:
        return lambda *args: (kernel if key in self.on else native)(*args)


def _slot_keys(bundle: Bundle, regions: Mapping, keys) -> frozenset[str]:
    unknown = sorted(set(keys) - regions.keys())
    if unknown:
        raise UserError(f"kernels_in: {unknown[0]!r} is not a slot of {bundle.path} (slots: "
                        f"{', '.join(regions)})", param="kernels_in")
    return frozenset(keys)


def _native_call(region: Region) -> Callable:
    """A slot's native region behind the kernel's call signature (abi.call_order): the output
    written in place."""
    layout = region.layout

    def call(*args):
        (y,) = region.native.step(list(layout.inputs(args)))
        layout.output(args).copy_(y)
    return call


def _tapped(key: str, call: Callable, tap: Callable, region: Region) -> Callable:
    layout = region.layout

    def tapped(*args):
        call(*args)
        tap(key, layout.inputs(args), layout.output(args))
    return tapped


def reopen(pipeline: Pipeline, kernels_in, **changes) -> Pipeline:
    """The pipeline opened again with only the slots `kernels_in` (slot keys) calling their
    kernel, the others their native region; no shadow (the correctness gate's in-situ capture),
    on the same weights: nothing is read, hashed or copied again. `changes`:
    other open_pipeline arguments (mode, tap)."""
    return open_pipeline(**{**pipeline.opened, "shadow": False, **changes},
                         kernels_in=tuple(kernels_in), weights=pipeline.weights)


# A checkpoint tensor already on a device, by (content digest, dtype, shape, device): pipelines of
# one process that reference the same checkpoint (a gate's native and slot bundles) hold one copy
# of each weight. Weights are never written after they are loaded; a tensor no pipeline holds
# any more drops out.
_ON_DEVICE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _device_weights(b: Bundle, checkpoint, dev: torch.device,
                    keys: Collection[str] | None = None) -> Mapping[str, torch.Tensor]:
    """The bundle's weights (or only `keys`) on `dev`; a referenced weight (whose digest the
    bundle verified when it read it) that is on `dev` already is shared, not copied again."""
    table = b.manifest["weights"]
    out = {}
    for key, tensor in b.weights(checkpoint, keys).items():
        digest = table[key].get("sha256") if table[key]["storage"] == "referenced" else None
        ident = (digest, tensor.dtype, tuple(tensor.shape), str(dev))
        held = _ON_DEVICE.get(ident) if digest else None
        if held is None:
            held = tensor.to(dev)
            if digest:
                _ON_DEVICE[ident] = held
        out[key] = held
    return MappingProxyType(out)


def _opening(bundle, device: str | None, mode: str | Mode | None) -> tuple[Bundle, torch.device, Mode]:
    """The bundle, the device (made current) and the mode a pipeline or its regions open with."""
    b = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle)
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is not None:  # torch's default streams, events, graphs
        torch.cuda.set_device(dev)
    mode = Mode.of(mode, dev.type)  # the one place a pipeline's mode is decided
    if mode.optimized and dev.type == "cuda":  # before any of its Triton kernels compiles
        from pipeline.runtime.compiled import use_compile_cache
        use_compile_cache(dev)
    return b, dev, mode


def open_regions(bundle, kernels: Mapping, device: str | None = "cpu", checkpoint=None,
                 mode: str | None = None) -> Mapping[str, Region]:
    """Each slot's native region (by slot key) with `kernels` (by binding id), lowered as
    `open_pipeline` lowers it, holding only the weights those regions read: the judge of a
    pipeline whose engine runs in kernel hosts times and checks regions without a third copy of
    the model on the device."""
    b, dev, mode = _opening(bundle, device, mode)
    weights = _device_weights(b, checkpoint, dev, _region_weight_keys(b))
    return MappingProxyType(_regions(b, kernels, weights, dev, mode, {}))


def open_pipeline(bundle, kernel_bindings=None, device: str | None = "cpu",
                  checkpoint=None, mode: str | None = None, shadow: bool = False,
                  kernels_in=None, tap: Callable | None = None,
                  weights: Mapping | None = None, audit: float = 0.0,
                  in_process: bool = False, kernels: Mapping | None = None) -> Pipeline:
    """Bind (once), load weights, lower every role: the only way a Pipeline is made. `mode`:
    "optimized" (the default on CUDA: lowering passes, then compiled and CUDA-graphed steps, a
    slot staying an opaque call) or "eager" (the default on a CPU, and for debugging). `shadow`
    (the correctness gate): every slot call also runs the native region on a copy of its inputs
    and is compared (pipeline/runtime/shadow.py); the kernel itself is called exactly as in a run.
    A device cuda:N becomes the process's current CUDA device, as the gates' events and the
    graph captures assume. `kernels_in` (slot keys; default all): the slots that call their
    kernel, the others running their native region. `tap(key, inputs, output)`: called after
    every slot call (the eager mode only: a compiled or graphed step does not run Python per call).
    `weights`: the verified device weights of a pipeline opened on the same bundle, checkpoint
    and device (`reopen`); by default they are read, checked against the bundle's digests and
    moved to the device once, so the roles and regions share one copy. `audit`: the probability
    that a slot call is drawn once it returns and kept whole for a judge (runtime/shadow.py).

    With a binding manifest the kernels' library loads into this process: `in_process=True` says
    that is meant (the kernel host does it, pipeline/host/__main__.py); no promise of the gates
    covers a kernel run so. `pipeline.host.open_pipeline` runs them in a confined kernel host, as
    `trtmc run`, `trtmc embed` and the gates do. `kernels`: callables bound already, by binding
    id, in place of a manifest."""
    from pipeline.runtime.program import Program
    if kernel_bindings is not None and not in_process:
        raise UserError("kernel_bindings: this opener loads the kernels into this process; use "
                        "pipeline.host.open_pipeline (a confined kernel host, as trtmc run does) or "
                        "pass in_process=True", param="kernel_bindings")
    b, dev, mode = _opening(bundle, device, mode)
    if tap is not None and mode.optimized:
        raise UserError("tap: the eager mode only (a compiled step runs no Python per slot call)",
                        param="tap")
    shared: dict = {}  # the optimized roles share each merged weight
    if kernels is None:
        kernels = bind_slots(b.slots, kernel_bindings, str(b.path))
    if weights is None:
        weights = _device_weights(b, checkpoint, dev)
    regions = _regions(b, kernels, weights, dev, mode, shared)
    switch = KernelSwitch(_slot_keys(b, regions, regions if kernels_in is None else kernels_in))
    ledger = Shadow(dev) if shadow and regions else None
    auditor = Audit(audit) if audit else None
    calls = {key: switch.call(key, checked(region.kernel, region, ledger, auditor),
                              _native_call(region))  # by slot key
             for key, region in regions.items()}
    if tap is not None:
        calls = {key: _tapped(key, call, tap, regions[key]) for key, call in calls.items()}
    programs = {}
    for role in b.roles:
        log.info("lowering role %s on %s", role, dev)
        programs[role] = Program.lower(b.network(role), weights, device=dev, slots=calls,
                                       mode=mode, shared=shared)
    opened = {"bundle": b, "kernel_bindings": kernel_bindings, "device": str(dev),
              "checkpoint": checkpoint, "mode": mode.value, "shadow": shadow,
              "in_process": True, "kernels": kernels}
    return Pipeline(b, dev, kernels, MappingProxyType(programs), MappingProxyType(regions), mode,
                    ledger, auditor, MappingProxyType(opened), switch, weights)
