"""A checkpoint's tokenizer, run by the `tokenizers` library from the checkpoint's tokenizer.json.

transformers' fast tokenizers run the same `tokenizers` object; loading it directly spares every
`trtmc run`, `trtmc embed` and gate stage the import of transformers (about a second on a 2-core
machine). A folder without tokenizer.json is converted by transformers' AutoTokenizer.
"""
from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.files import read_regular, shown

if TYPE_CHECKING:
    import tokenizers

# the files that make up a tokenizer (they travel with a bundle)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
         "merges.txt", "vocab.json", "generation_config.json")
MAX_FILE_BYTES = 256 << 20  # far above any public tokenizer file (Qwen3's tokenizer.json: 11 MB)
ROLES = ("bos", "eos", "pad", "unk", "cls", "sep", "mask")  # the special tokens a config may name


@dataclass(frozen=True)
class Tokenizer:
    """Text to token ids and back, as transformers' fast tokenizer of the same files does it:
    the special tokens its post-processor adds, no padding, truncation only when asked."""
    backend: tokenizers.Tokenizer
    special_ids: Mapping[str, int]  # role (ROLES) -> id, for the roles the files name

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        """The ids of `text`, special tokens included; at most `max_length` of them when given
        (the text is cut, the special tokens kept)."""
        backend = self.backend
        if max_length is not None:
            import tokenizers
            backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
            backend.enable_truncation(max_length)
        return backend.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens left out."""
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def pad_token_id(self) -> int | None:
        return self.special_ids.get("pad")

    @property
    def eos_token_id(self) -> int | None:
        return self.special_ids.get("eos")


def read_tokenizer_files(folder: Path) -> dict[str, bytes]:
    """The tokenizer files (TOKENIZER_FILES) present in `folder`, read as regular files within
    MAX_FILE_BYTES."""
    return {name: read_regular(folder / name, MAX_FILE_BYTES, "pipeline.models.tokenizer."
                               "MAX_FILE_BYTES")
            for name in TOKENIZER_FILES if (folder / name).is_file()}


def load_tokenizer(files: Mapping[str, bytes], shown_as: Path) -> Tokenizer:
    """The tokenizer of `files` (name -> bytes, as read_tokenizer_files gives them); errors name
    `shown_as`, the folder they came from."""
    if "tokenizer.json" not in files:
        return _converted(files, shown_as)
    try:
        return _from_json(files, shown_as)
    except UserError:
        raise
    except Exception as e:  # tokenizers raises many types for a bad tokenizer.json
        raise _unusable(shown_as, e) from e


def _unusable(shown_as: Path, e: Exception, private: str | None = None) -> UserError:
    """The one line for a tokenizer that cannot be loaded; `private`, the folder of a copy,
    is named as `shown_as`."""
    reason = " ".join(str(e).split())
    if private:
        reason = reason.replace(private, shown(shown_as))
    return UserError(f"{shown(shown_as)}: no usable tokenizer ({type(e).__name__}: "
                     f"{jsonio.excerpt(reason)})")


def _from_json(files: Mapping[str, bytes], shown_as: Path) -> Tokenizer:
    import tokenizers
    backend = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
    backend.no_padding()  # a tokenizer.json may carry a batch setting; transformers drops it too
    backend.no_truncation()
    named: dict[str, object] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config has the last word
        if name in files:
            doc = jsonio.parse_json(files[name], None, shown_as / name)
            if not isinstance(doc, dict):
                raise UserError(f"{shown(shown_as / name)}: holds {type(doc).__name__}, expected "
                                f"an object")
            named |= {role: doc[f"{role}_token"] for role in ROLES if doc.get(f"{role}_token")}
    special = {}
    for role, token in named.items():
        content = token.get("content") if isinstance(token, dict) else token
        token_id = backend.token_to_id(content) if isinstance(content, str) else None
        if token_id is not None:
            special[role] = token_id
    return Tokenizer(backend, special)


def _converted(files: Mapping[str, bytes], shown_as: Path) -> Tokenizer:
    """AutoTokenizer's conversion of vocabulary files (no tokenizer.json) to a fast tokenizer."""
    from transformers import AutoTokenizer
    with tempfile.TemporaryDirectory(prefix="trtmc-tokenizer-") as folder:
        for name, data in files.items():
            Path(folder, name).write_bytes(data)
        try:
            auto = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as e:  # transformers raises many types for a missing tokenizer
            raise _unusable(shown_as, e, folder) from e
    backend = getattr(auto, "backend_tokenizer", None)
    if backend is None:
        raise UserError(f"{shown(shown_as)}: no usable tokenizer ({type(auto).__name__} has no "
                        f"fast tokenizer; expected tokenizer.json)")
    special = {role: getattr(auto, f"{role}_token_id") for role in ROLES}
    return Tokenizer(backend, {role: i for role, i in special.items() if i is not None})
