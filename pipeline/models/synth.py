"""Synthetic Hugging Face checkpoints: a real config, seeded weights, a small real tokenizer.

Nothing can be downloaded here, so tests and demos run on checkpoints written from the shipped public
configs (`pipeline/models/configs/`), shrunk with overrides. The result loads with plain
`transformers` (`from_pretrained(dir, local_files_only=True)`) and with `pipeline.models.checkpoint`.
"""
from __future__ import annotations

import copy
import math
import os
import zlib
from pathlib import Path

import orjson

from pipeline import dtypes, jsonio
from pipeline.errors import UserError, as_typed
from pipeline.files import file_problem, shown, staged_dir

CONFIG_DIR = Path(__file__).parent / "configs"
# random: transformers' own seeded init, built in memory. pattern: values from an integer hash of
# (seed, tensor name, element index), written shard by shard: the same bits on every machine and
# torch version, in little memory, so a CPU and a GPU runner each write the same 16 GB checkpoint
# instead of carrying it
INITS = ("random", "pattern")
PATTERN_SHARD_BYTES = 2 << 30
_PATTERN_CHUNK = 1 << 18  # elements hashed at a time: the temporaries stay in cache
# Hub ids accepted as aliases of the shipped configs (the file name is the hub id's NAME part).
SHIPPED = {"distilbert-base-uncased": "distilbert/distilbert-base-uncased", "Qwen3-8B": "Qwen/Qwen3-8B"}

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BOS, EOS = "<|endoftext|>", "<|im_end|>"
# Deterministic training text for the byte-level BPE and the word part of the WordPiece vocab.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A kernel author replaces one region of a network with their own kernel.",
    "Hello world! This is a small tokenizer for synthetic checkpoints, made offline.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 and 2026 appear in text; so do commas, colons: and quotes.",
    "Attention is all you need: queries, keys and values meet in every layer of the model.",
    "The cat sat on the mat and the dog sat on the log while the sun was shining.",
]


def shipped_names() -> list[str]:
    return sorted(SHIPPED)


def shipped_config(name: str) -> dict:
    """The public config.json of a shipped model, by file name or hub id."""
    aliases = {hub: short for short, hub in SHIPPED.items()}
    short = aliases.get(name, name)
    if short not in SHIPPED:
        raise UserError(f"{name}: not a shipped model config (expected one of "
                        f"{', '.join(shipped_names() + sorted(aliases))}, or a path to a config.json)")
    return orjson.loads((CONFIG_DIR / f"{short}.json").read_bytes())


def parse_override(text: str) -> tuple[str, object]:
    """`key=value`: the value is JSON when it parses as JSON, else the literal string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UserError(f"override {text}: expected KEY=VALUE", param="override")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = raw
    return key, value


def _load_config(name_or_config: str | Path | dict) -> tuple[dict, str]:
    """-> (config dict, a name for messages)."""
    if isinstance(name_or_config, dict):
        return copy.deepcopy(name_or_config), "the given config"
    text = str(name_or_config)
    p = Path(text)
    if p.is_dir():
        p = p / "config.json"
    problem = file_problem(p)
    if problem is None:
        return jsonio.read_json(p, "hf_config"), str(p)
    path_like = isinstance(name_or_config, Path) or text.startswith((".", "/", "~")) or \
        text.endswith(".json")
    if problem != "not found" or path_like:
        raise UserError(f"{shown(p)}: config file {problem}")
    return shipped_config(text), text


def _apply_overrides(config: dict, overrides: dict, source: str) -> None:
    for key, value in overrides.items():
        if key not in config:
            raise UserError(f"override {key}: '{key}' is not a key of {source} "
                            f"(expected one of {', '.join(sorted(config))})", param="override")
        config[key] = value


def _is_decoder(config: dict) -> bool:
    return any(a.endswith("ForCausalLM") for a in config.get("architectures") or [])


MAX_VOCAB_SIZE = 1 << 21  # a synthetic tokenizer lists every id (real vocabularies: up to ~262k)


def _reason(e: Exception) -> str:
    """An exception from transformers or torch as a short one-line reason: its first line, and
    the line after it when the first only introduces it (ends with ':')."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return f"{type(e).__name__}: {jsonio.excerpt(text)}"


def _hf_config(config: dict, source: str):
    from transformers import AutoConfig
    fields = dict(config)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise UserError(f"{source}: no 'model_type' (expected a Hugging Face config.json)")
    from transformers import CONFIG_MAPPING
    if not isinstance(model_type, str):  # an override or a dict config skips the schema
        raise UserError(f"{source}: model_type {jsonio.excerpt(repr(model_type), 40)}: expected "
                        f"a string")
    shown_type = as_typed(jsonio.excerpt(model_type, 40))
    if model_type not in CONFIG_MAPPING:  # transformers' own refusal lists its 400-odd types
        raise UserError(f"{source}: model_type {shown_type} is not an architecture transformers "
                        f"knows")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # transformers and huggingface_hub raise many types for a bad field
        raise UserError(f"{source}: not a usable {shown_type} config ({_reason(e)})") from None


def _dtype(config: dict, source: str):
    from pipeline.models.checkpoint import DECLARED_DTYPES, declared_dtype
    name = declared_dtype(config)
    if name not in DECLARED_DTYPES:
        raise UserError(f"{source}: torch_dtype '{name}' (expected one of "
                        f"{', '.join(DECLARED_DTYPES)})")
    return dtypes.torch_dtype(DECLARED_DTYPES[name])


def _memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _write_weights(config: dict, source: str, seed: int, out: Path) -> None:
    """Seeded random init through transformers: causal LMs keep lm_head, encoders are base models."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    hf = _hf_config(config, source)
    auto = AutoModelForCausalLM if _is_decoder(config) else AutoModel
    dtype = _dtype(config, source)
    try:
        with torch.device("meta"):  # shapes only: what the weights would cost, before they do
            shapes = auto.from_config(hf, dtype=dtype)
            nbytes = sum(p.numel() * p.element_size() for p in shapes.parameters())
        memory = _memory_bytes()
        if nbytes > memory // 2:
            raise UserError(f"{source}: its weights take {nbytes / 2**30:.1f} GiB, more than half "
                            f"this machine's memory ({memory / 2**30:.1f} GiB); synth builds them "
                            f"in memory (--no-weights writes the config and tokenizer only)")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = auto.from_config(hf, dtype=dtype)
    except UserError:
        raise
    except Exception as e:  # transformers' and torch's checks (heads vs hidden size, sizes < 0)
        raise UserError(f"{source}: transformers rejects this config ({_reason(e)})") from None
    from transformers.utils import logging as hf_logging
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a library call should not draw on the caller's terminal
    try:
        model.save_pretrained(out)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    (out / "config.json").unlink()  # ours (below) is the one written: the given file plus overrides


def pattern_tensor(name: str, shape, dtype, seed: int = 0):
    """Values in [-0.02, 0.02) from a 32-bit hash of (seed, name, element index): integer steps,
    one exact scaling, one rounding to `dtype`."""

    import torch
    word = zlib.crc32(name.encode()) ^ seed
    n = math.prod(shape)
    out = torch.empty(n, dtype=dtype)
    for lo in range(0, n, _PATTERN_CHUNK):
        h = torch.arange(lo, min(n, lo + _PATTERN_CHUNK), dtype=torch.int64)
        h.mul_(2654435761).add_(word).bitwise_and_(0xFFFFFFFF)
        h.bitwise_xor_(h >> 15).mul_(0x2C1B3C6D).bitwise_and_(0xFFFFFFFF)
        h.bitwise_xor_(h >> 12).bitwise_and_(0xFFFF)
        out[lo:lo + len(h)] = ((h.to(torch.float32) - 32768.0) * (0.02 / 32768.0)).to(dtype)
    return out.reshape(tuple(shape))


def _write_pattern_weights(config: dict, source: str, seed: int, out: Path) -> None:
    """Pattern weights in safetensors shards of at most PATTERN_SHARD_BYTES, with the index
    transformers reads; one shard is in memory at a time."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoModelForCausalLM
    hf = _hf_config(config, source)
    auto = AutoModelForCausalLM if _is_decoder(config) else AutoModel
    dtype = _dtype(config, source)
    try:
        with torch.device("meta"):
            params = list(auto.from_config(hf, dtype=dtype).named_parameters())  # tied: once
    except Exception as e:  # transformers' and torch's checks (heads vs hidden size, sizes < 0)
        raise UserError(f"{source}: transformers rejects this config ({_reason(e)})") from None
    shards: list[list] = [[]]
    size = 0
    for name, p in params:
        nbytes = p.numel() * p.element_size()
        if shards[-1] and size + nbytes > PATTERN_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, tuple(p.shape), p.dtype))
        size += nbytes
    weight_map, total = {}, 0
    for k, members in enumerate(shards, 1):
        file = (f"model-{k:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                else "model.safetensors")
        tensors = {n: pattern_tensor(n, s, d, seed) for n, s, d in members}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: file for n in tensors})
        del tensors
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_bytes(orjson.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, option=orjson.OPT_INDENT_2))


def _bert_tokenizer(config: dict):
    """A real lower-casing WordPiece tokenizer: specials 0..4, characters, ##suffixes, words, fillers."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    vocab_size = config["vocab_size"]
    if vocab_size < len(BERT_SPECIALS):
        raise UserError(f"vocab_size {vocab_size}: a WordPiece tokenizer needs at least "
                        f"{len(BERT_SPECIALS)} ids ({' '.join(BERT_SPECIALS)})")
    chars = sorted({c for line in CORPUS for c in line.lower() if not c.isspace()})
    alnum = [c for c in chars if c.isalnum()]
    words = sorted({w.strip(".,!?;:'\"") for line in CORPUS for w in line.lower().split()} - {""})
    tokens = list(dict.fromkeys(BERT_SPECIALS + chars + ["##" + c for c in alnum] + words))
    tokens += [f"[unused{i}]" for i in range(vocab_size - len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens[:vocab_size])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls, sep = vocab.get("[CLS]"), vocab.get("[SEP]")
    if cls is not None and sep is not None:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    specials = dict(zip(["pad_token", "unk_token", "cls_token", "sep_token", "mask_token"], BERT_SPECIALS))
    return tok, {k: v for k, v in specials.items() if v in vocab}


def _byte_bpe_tokenizer(config: dict):
    """A real byte-level BPE trained on CORPUS, bos/eos at the config's ids when those are free.

    Ids that are out of range or taken move to the top of the vocabulary and the config follows them,
    so every id the model can see is < vocab_size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    vocab_size = config["vocab_size"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = list(dict.fromkeys([BOS, EOS]))
    if vocab_size < len(alphabet) + len(specials):
        raise UserError(f"vocab_size {vocab_size}: a byte-level BPE tokenizer needs at least "
                        f"{len(alphabet) + len(specials)} ids (256 bytes + {', '.join(specials)})")
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials), initial_alphabet=alphabet, show_progress=False))
    state = orjson.loads(trained.to_str())["model"]
    vocab, merges = state["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                                     for m in state["merges"]]
    wanted = {BOS: config.get("bos_token_id"), EOS: config.get("eos_token_id")}
    taken = set(vocab.values())
    ids = {}
    for token in specials:
        i = wanted[token]
        if isinstance(i, int) and not isinstance(i, bool) and len(vocab) <= i < vocab_size and i not in taken:
            ids[token] = i
            taken.add(i)
    top = (i for i in range(vocab_size - 1, -1, -1) if i not in taken)
    for token in specials:
        if token not in ids:
            ids[token] = next(top)
    config["bos_token_id"], config["eos_token_id"] = ids[BOS], ids[EOS]
    tok = Tokenizer(models.BPE(vocab={**vocab, **ids}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, {"bos_token": BOS, "eos_token": EOS, "pad_token": BOS}


def _write_tokenizer(config: dict, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast
    build = _byte_bpe_tokenizer if _is_decoder(config) else _bert_tokenizer
    tok, specials = build(config)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=config.get(
        "max_position_embeddings", 512), **specials)
    fast.save_pretrained(out)


def _claim_output(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: already exists and is not an empty directory "
                        f"(synth never overwrites; choose a new -o)")


def synthesize(name_or_config: str | Path | dict, out: Path, *, seed: int = 0, weights: bool = True,
               overrides: dict | None = None, init: str = "random") -> Path:
    """Write an HF-format checkpoint to `out` (atomically) and return it; `init` is one of INITS."""
    out = Path(out)
    if init not in INITS:
        raise UserError(f"init {init!r}: expected one of {', '.join(INITS)}", param="init")
    config, source = _load_config(name_or_config)
    _apply_overrides(config, overrides or {}, source)
    jsonio.validate(config, "hf_config", source)  # its size bounds, before any work
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 0 < vocab <= MAX_VOCAB_SIZE:
        raise UserError(f"{source}: 'vocab_size' must be an integer in 1..{MAX_VOCAB_SIZE} "
                        f"(got {jsonio.excerpt(repr(vocab), 40)})")
    _claim_output(out)
    umask = os.umask(0)
    os.umask(umask)
    with staged_dir(out, replace=True) as tmp:  # replaces at most an empty folder (claimed above)
        _write_tokenizer(config, tmp)  # first: it may move bos/eos ids into range
        if weights:
            (_write_pattern_weights if init == "pattern" else _write_weights)(config, source, seed, tmp)
        (tmp / "config.json").write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        for f in tmp.iterdir():
            f.chmod(0o666 & ~umask)  # some writers create 0600 files
        _claim_output(out)
    return out
