"""Gate inputs nobody chose in advance: besides a spec's texts or prompts, each gate run draws
items of its own from a seed drawn when it starts, so a kernel that learns the spec's inputs (or
hashes them) meets others it could not know. The seed and the items are in the report.

Three kinds, in turn: a sentence of the corpus shipped with trtmc (`corpus.txt`), a sequence of
tokens sampled from the tokenizer's own vocabulary, and a perturbation of one of the spec's items
(words shuffled, letters swapped, case flipped, the text doubled or cut). Each is cut to the
token count of the spec's longest item, so a drawn prompt fits wherever the spec's do.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.models.tokenizer import Tokenizer

KINDS = ("corpus", "vocabulary", "perturbed")
VOCABULARY_TOKENS = (4, 24)  # how many tokens a vocabulary item samples, at least and at most


def draw_seed() -> int:
    """A seed nobody chose: from the operating system's random source, per run."""
    return int.from_bytes(os.urandom(4), "little")


def corpus() -> tuple[str, ...]:
    text = resources.files("pipeline.gates").joinpath("corpus.txt").read_text(encoding="utf-8")
    return tuple(line for line in text.splitlines() if line and not line.startswith("#"))


@dataclass(frozen=True)
class Drawn:
    """The items one gate run drew (`kind`, `text` each) and the seed they came from."""
    seed: int
    items: tuple[dict[str, str], ...]

    @property
    def texts(self) -> tuple[str, ...]:
        return tuple(item["text"] for item in self.items)

    def as_dict(self) -> dict[str, object]:
        return {"seed": self.seed, "items": list(self.items)}


def _perturbed(text: str, rng: random.Random) -> str:
    words = text.split()
    how = rng.randrange(5)
    if how == 0 and len(words) > 1:
        rng.shuffle(words)
        return " ".join(words)
    if how == 1 and len(text) > 2:
        chars = list(text)
        for _ in range(max(1, len(chars) // 10)):
            i = rng.randrange(len(chars) - 1)
            chars[i], chars[i + 1] = chars[i + 1], chars[i]
        return "".join(chars)
    if how == 2:
        return text.swapcase()
    if how == 3:
        return f"{text} {text}"
    return text[:max(1, rng.randrange(1, len(text) + 1))]


def _vocabulary(tokenizer: Tokenizer, rng: random.Random) -> str:
    """Tokens sampled from the vocabulary, as text; a token whose text holds a NUL character
    (byte-level vocabularies have one) is left out: the item goes into the report, and trtmc
    reads no JSON string with one."""
    special = {tokenizer.pad_token_id, tokenizer.eos_token_id}
    ids = [i for i in (rng.randrange(len(tokenizer)) for _ in range(rng.randint(*VOCABULARY_TOKENS)))
           if i not in special and "\x00" not in tokenizer.decode([i])]
    return tokenizer.decode(ids) or "?"


def draw(spec_items: tuple[str, ...], tokenizer: Tokenizer, count: int, seed: int | None = None) -> Drawn:
    """`count` items drawn with `seed` (None: one drawn now), each cut to the token count of the
    longest of `spec_items`."""
    seed = draw_seed() if seed is None else seed
    rng = random.Random(seed)
    texts = corpus()
    longest = max((len(tokenizer.encode(t)) for t in spec_items), default=VOCABULARY_TOKENS[1])
    items = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        if kind == "corpus":
            text = rng.choice(texts)
        elif kind == "vocabulary":
            text = _vocabulary(tokenizer, rng)
        else:
            text = _perturbed(rng.choice(spec_items), rng)
        if len(tokenizer.encode(text)) > longest:
            text = tokenizer.decode(tokenizer.encode(text, max_length=longest)) or text[:8]
        items.append({"kind": kind, "text": text})
    return Drawn(seed, tuple(items))
