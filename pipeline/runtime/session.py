"""A pipeline: one bundle, its bound kernels, and the lowered programs of its roles.

Binding happens only here, while the pipeline is constructed; the result is frozen. To switch kernels,
open a new pipeline from the same bundle with another manifest.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch

from pipeline.bundle.reader import Bundle
from pipeline.errors import UserError

ENCODER_FAMILIES = ("bert", "distilbert")


def _log(msg: str) -> None:
    print(f"[pipeline] {msg}", file=sys.stderr, flush=True)


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is available here (use cpu)")
    return dev


def bind_kernels(bundle: Bundle, kernel_bindings) -> Mapping[str, object]:
    """Every slot of the bundle bound exactly once, or a UserError and nothing bound."""
    slots = bundle.slots
    if not slots:
        if kernel_bindings is not None:
            raise UserError(f"{bundle.path}: a native bundle has no kernel slots; "
                            f"--kernel-bindings {kernel_bindings} binds nothing")
        return MappingProxyType({})
    if kernel_bindings is None:
        ids = ", ".join(s["binding_id"] for s in slots)
        raise UserError(f"{bundle.path}: slot-ready bundle needs --kernel-bindings "
                        f"(unbound slots: {ids})")
    from pipeline.binding import bind
    return MappingProxyType(dict(bind(kernel_bindings, slots)))


@dataclass(frozen=True)
class Pipeline:
    bundle: Bundle
    device: torch.device
    kernels: Mapping[str, object]
    programs: Mapping[str, object]

    @property
    def kind(self) -> str:
        return "encoder" if self.bundle.family in ENCODER_FAMILIES else "decoder"

    @property
    def sequence_length(self) -> int:
        return self.bundle.manifest["build_options"]["sequence_length"]

    def encode_text(self, tokenizer, text: str) -> dict[str, torch.Tensor]:
        ids = tokenizer(text, truncation=True, max_length=self.sequence_length)["input_ids"]
        pad = tokenizer.pad_token_id or 0
        n = len(ids)
        input_ids = torch.full((self.sequence_length,), pad, dtype=torch.int32)
        input_ids[:n] = torch.tensor(ids, dtype=torch.int32)
        mask = torch.zeros(self.sequence_length, dtype=torch.int32)
        mask[:n] = 1
        return {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}

    def embed(self, texts: list[str]) -> list[torch.Tensor]:
        """Full last hidden state [S, H] per text (padded positions included)."""
        if self.kind != "encoder":
            raise UserError(f"{self.bundle.path}: embed needs an encoder bundle, this is a "
                            f"{self.bundle.family} decoder (use `trtmc run`)")
        tok = self.bundle.tokenizer()
        program = self.programs["decode"]
        return [program(**self.encode_text(tok, t))["last_hidden_state"] for t in texts]

    def generate(self, prompts: list[str], max_new_tokens: int, **sampling) -> list[dict]:
        if self.kind != "decoder":
            raise UserError(f"{self.bundle.path}: run needs a decoder bundle (use `trtmc embed`)")
        from pipeline.runtime.generate import generate_texts
        return generate_texts(self, prompts, max_new_tokens, **sampling)


def open_pipeline(bundle, kernel_bindings=None, device: str | None = "cpu",
                  checkpoint=None) -> Pipeline:
    from pipeline.runtime.program import Program
    b = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle)
    dev = resolve_device(device)
    kernels = bind_kernels(b, kernel_bindings)
    weights = b.weights(checkpoint)
    programs = {}
    for role in b.roles:
        _log(f"lowering role {role} on {dev}")
        programs[role] = Program.lower(b.network(role), weights, device=dev, slots=kernels)
    return Pipeline(b, dev, kernels, MappingProxyType(programs))
