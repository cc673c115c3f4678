"""A pipeline: one bundle, its bound kernels, and the lowered programs of its roles.

Binding happens only here, while the pipeline is constructed; the result is frozen. To switch kernels,
open a new pipeline from the same bundle with another manifest.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch

from pipeline.bundle.reader import Bundle
from pipeline.errors import UserError
from pipeline.families import SINGLE_ENGINE_ROLE, Family, family_named
from pipeline.kernels.bind import bind_slots
from pipeline.log import get as log_topic

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
    return dev


@dataclass(frozen=True)
class Pipeline:
    bundle: Bundle
    device: torch.device
    kernels: Mapping[str, object]
    programs: Mapping[str, object]
    regions: Mapping[str, "Region"]   # slot-ready bundles: each slot's kernel and native region

    @property
    def family(self) -> Family:
        return family_named(self.bundle.family)

    @property
    def kind(self) -> str:
        return self.family.kind

    @property
    def sequence_length(self) -> int:
        return self.bundle.manifest["build_options"]["sequence_length"]

    def encode_text(self, tokenizer, text: str) -> dict[str, torch.Tensor]:
        """The encoder's inputs for one text, padded to the fixed sequence length."""
        io = self.family.io
        ids = tokenizer(text, truncation=True, max_length=self.sequence_length)["input_ids"]
        pad = tokenizer.pad_token_id or 0
        n = len(ids)
        input_ids = torch.full((self.sequence_length,), pad, dtype=torch.int32)
        input_ids[:n] = torch.tensor(ids, dtype=torch.int32)
        mask = torch.zeros(self.sequence_length, dtype=torch.int32)
        mask[:n] = 1
        return {io.input_ids: input_ids.to(self.device), io.attention_mask: mask.to(self.device)}

    @property
    def encoder(self):
        """The program of an encoder's single engine."""
        return self.programs[SINGLE_ENGINE_ROLE]

    def embed(self, texts: list[str]) -> list[torch.Tensor]:
        """Full last hidden state [S, H] per text (padded positions included)."""
        if self.kind != "encoder":
            raise UserError(f"{self.bundle.path}: embed needs an encoder bundle, this is a "
                            f"{self.bundle.family} decoder (use `trtmc run`)")
        tok = self.bundle.tokenizer()
        return [self.encoder(**self.encode_text(tok, t))[self.family.io.hidden] for t in texts]

    def generate(self, prompts: list[str], max_new_tokens: int, **sampling) -> list[dict]:
        if self.kind != "decoder":
            raise UserError(f"{self.bundle.path}: run needs a decoder bundle (use `trtmc embed`)")
        from pipeline.runtime.generate import generate_texts
        return generate_texts(self, prompts, max_new_tokens, **sampling)


@dataclass(frozen=True)
class Region:
    """A slot of the pipeline: its bound kernel and the native region it replaced, lowered on
    its own (boundary inputs in, boundary output out) so a probe can run both side by side."""
    binding_id: str
    engine_role: str
    abi: Mapping
    kernel: object
    native: object          # Program of the removed layers
    input_names: tuple[str, ...]
    output_name: str


def _regions(b: Bundle, kernels, weights, device) -> dict[str, Region]:
    from pipeline.graph.patch import slots_of
    from pipeline.runtime.program import Program
    out = {}
    for entry in b.slots:
        export = b.network(entry["engine_role"])
        slot = next(s for s in slots_of(export) if s["attrs"]["binding_id"] == entry["binding_id"])
        names = {t["id"]: t["name"] for t in export["tensors"]}
        native = Program.lower({**export, "layers": slot["attrs"]["native_layers"]}, weights,
                               device=device, inputs=slot["inputs"], outputs=slot["outputs"])
        out[entry["binding_id"]] = Region(entry["binding_id"], entry["engine_role"], entry["abi"],
                                          kernels[entry["binding_id"]], native,
                                          tuple(names[t] for t in slot["inputs"]),
                                          names[slot["outputs"][0]])
    return out


def open_pipeline(bundle, kernel_bindings=None, device: str | None = "cpu",
                  checkpoint=None) -> Pipeline:
    """Bind (once), load weights, lower every role: the only way a Pipeline is made."""
    from pipeline.runtime.program import Program
    b = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle)
    dev = resolve_device(device)
    kernels = bind_slots(b.slots, kernel_bindings, str(b.path))
    weights = b.weights(checkpoint)
    programs = {}
    for role in b.roles:
        log.info("lowering role %s on %s", role, dev)
        programs[role] = Program.lower(b.network(role), weights, device=dev, slots=kernels)
    return Pipeline(b, dev, kernels, MappingProxyType(programs),
                    MappingProxyType(_regions(b, kernels, weights, dev)))
