"""Checkpoint resolution (local dirs, offline HF cache) and synthetic checkpoints (`trtmc model synth`)."""
from __future__ import annotations

import shutil
import subprocess
import sys

import orjson
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.models import checkpoint
from pipeline.models.synth import parse_override, shipped_config, synthesize


def _config(d) -> dict:
    return orjson.loads((d / "config.json").read_bytes())


@pytest.fixture
def micro_bert(tiny_bert) -> dict:
    """One layer, smallest vocab: for tests that synthesize their own checkpoints."""
    return {**_config(tiny_bert), "num_hidden_layers": 1, "vocab_size": 64, "max_position_embeddings": 32}


def test_shipped_configs_are_the_public_ones():
    q = shipped_config("Qwen/Qwen3-8B")
    assert q == shipped_config("Qwen3-8B")
    assert (q["hidden_size"], q["intermediate_size"], q["num_hidden_layers"], q["num_attention_heads"],
            q["num_key_value_heads"], q["head_dim"], q["vocab_size"]) == (4096, 12288, 36, 32, 8, 128, 151936)
    assert (q["bos_token_id"], q["eos_token_id"], q["rope_theta"], q["torch_dtype"]) == \
        (151643, 151645, 1000000, "bfloat16")
    d = shipped_config("distilbert/distilbert-base-uncased")
    assert (d["dim"], d["n_layers"], d["n_heads"], d["hidden_dim"], d["vocab_size"], d["activation"]) == \
        (768, 6, 12, 3072, 30522, "gelu")
    with pytest.raises(UserError, match="not a shipped model config"):
        shipped_config("Qwen/Qwen3-9B")


def test_local_revision_is_stable_and_tracks_config_and_weight_index(tiny_bert, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(tiny_bert, d)
    rev = checkpoint.load(str(tiny_bert)).revision
    assert checkpoint.load(str(d)).revision == rev
    (d / "tokenizer.json").write_text("{}")  # not part of the revision
    assert checkpoint.load(str(d)).revision == rev
    assert checkpoint.load(str(d), rev).revision == rev

    cfg = _config(d)
    (d / "config.json").write_bytes(orjson.dumps({**cfg, "layer_norm_eps": 1e-5}))
    assert checkpoint.load(str(d)).revision != rev
    (d / "config.json").write_bytes((tiny_bert / "config.json").read_bytes())
    assert checkpoint.load(str(d)).revision == rev

    tensors = load_file(d / "model.safetensors")
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    changed = checkpoint.load(str(d)).revision
    assert changed != rev
    with pytest.raises(UserError, match="does not match the directory's revision"):
        checkpoint.load(str(d), rev)


def test_arrays_are_the_stored_bytes_mapped_in_place(tmp_path):
    """A network points at checkpoint weights mapped from the file, and a referenced weight's
    digest is taken from the same bytes: both must equal the loaded tensor's."""
    d = tmp_path / "ck"
    d.mkdir()
    (d / "config.json").write_text("{}")
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(3, 5, generator=g).bfloat16(), "b": torch.randn(7, generator=g),
               "c.half": torch.randn(2, 2, generator=g).half(), "scalar": torch.tensor(3.5),
               "empty": torch.zeros(0, 4)}
    save_file(tensors, d / "model.safetensors")
    ck = checkpoint.load(str(d))
    for name, t in tensors.items():
        a = ck.array(name)
        assert not a.flags.writeable and list(a.shape) == list(t.shape)
        assert a.tobytes() == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert ck.digest(name) == checkpoint.tensor_digest(ck.tensor(name))
    # a header whose offsets run past the file: one line naming the file and the tensor
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[:-8])
    with pytest.raises(UserError, match=r"model.safetensors: tensor '.*': data_offsets \[\d+, \d+\] "
                                        r"are not a range within the file's \d+ bytes of data"):
        [checkpoint.load(str(d)).array(n) for n in tensors]
    # offsets within the file that do not hold the shape's bytes
    header = orjson.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    header["b"]["shape"] = [8]
    text = orjson.dumps(header)
    (d / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text +
                                          raw[8 + int.from_bytes(raw[:8], "little"):])
    with pytest.raises(UserError, match=r"model.safetensors: tensor 'b' \(FP32 \[8\]\) has 28 bytes "
                                        r"at offset \d+; expected 32 bytes within the file"):
        checkpoint.load(str(d)).array("b")


def test_local_dir_errors(tmp_path):
    with pytest.raises(UserError, match="no such model directory"):
        checkpoint.load(str(tmp_path / "missing"))
    with pytest.raises(UserError, match="no config.json"):
        checkpoint.load(str(tmp_path))


def test_hub_id_needs_a_revision():
    with pytest.raises(UserError, match="needs a model revision"):
        checkpoint.load("Qwen/Qwen3-8B")


def test_hub_id_resolved_offline_from_the_cache(tmp_path, micro_bert, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--acme--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)  # as huggingface_hub writes it
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_bytes(orjson.dumps(micro_bert))

    by_ref = checkpoint.load("acme/tiny", "main")
    assert (by_ref.path, by_ref.model_id, by_ref.revision) == (snap, "acme/tiny", commit)
    assert by_ref.config["hidden_size"] == 64 and not by_ref.has_weights
    assert checkpoint.load("acme/tiny", commit).path == snap

    with pytest.raises(UserError, match="not in the local Hugging Face cache"):
        checkpoint.load("acme/tiny", "v2")
    with pytest.raises(UserError, match="not in the local Hugging Face cache"):
        checkpoint.load("acme/other", "main")


def test_tiny_distilbert_loads_in_transformers(tiny_distilbert):
    from transformers import AutoModel
    model = AutoModel.from_pretrained(tiny_distilbert, local_files_only=True)
    assert type(model).__name__ == "DistilBertModel"
    cfg = _config(tiny_distilbert)
    assert (cfg["dim"], cfg["n_layers"], cfg["n_heads"], cfg["hidden_dim"]) == (64, 2, 4, 128)
    assert cfg["vocab_size"] == 30522  # untouched keys keep the public value

    tok = checkpoint.load(str(tiny_distilbert)).tokenizer()
    assert len(tok) == 30522 and tok.pad_token_id == 0
    ids = tok.encode("The quick brown fox, 2026!")
    special = tok.special_ids
    assert ids[0] == special["cls"] and ids[-1] == special["sep"] and special["unk"] not in ids
    assert tok.decode(ids) == "the quick brown fox, 2026!"
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids])).last_hidden_state
    assert out.shape == (1, len(ids), 64) and torch.isfinite(out).all()


def test_tiny_qwen3_loads_in_transformers(tiny_qwen3):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, local_files_only=True)
    cfg = _config(tiny_qwen3)
    assert model.dtype == torch.bfloat16 and cfg["torch_dtype"] == "bfloat16"
    ck = checkpoint.load(str(tiny_qwen3))
    assert ck.tensor_info("model.embed_tokens.weight") == ("BF16", [512, 64])
    assert ck.tensor_info("lm_head.weight") == ("BF16", [512, 64])
    assert ck.tensor_info("model.layers.1.self_attn.k_proj.weight") == ("BF16", [2 * 16, 64])

    tok = ck.tokenizer()
    # The public bos/eos ids do not fit a 512-entry vocabulary: they move into range with the config.
    assert cfg["bos_token_id"] < 512 and cfg["eos_token_id"] < 512
    assert (tok.special_ids["bos"], tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"])
    text = "Hello world! ünïcode → bytes"
    ids = tok.encode(text)
    assert max(ids) < 512 and tok.decode(ids) == text
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512) and torch.isfinite(logits.float()).all()


def test_no_weights_full_size_qwen3(qwen3_8b_config_dir):
    assert not list(qwen3_8b_config_dir.glob("*.safetensors"))
    ck = checkpoint.load(str(qwen3_8b_config_dir))
    assert not ck.has_weights and ck.torch_dtype == "BF16"
    assert ck.config == shipped_config("Qwen3-8B")  # public bos/eos ids fit: config unchanged
    tok = ck.tokenizer()
    assert [tok.token(i) for i in (151643, 151645)] == ["<|endoftext|>", "<|im_end|>"]
    assert (tok.special_ids["bos"], tok.eos_token_id) == (151643, 151645)


TOKENIZED = ["Hello world!", "The quick brown FOX, naïve café: 日本語 テキスト 🙂",
             "[CLS] x [SEP] <|endoftext|> y <|im_end|>", "  spaces\tand\nlines  ", "word " * 600, ""]


def test_the_tokenizer_gives_transformers_ids_special_tokens_and_text(
        minilm_dir, tiny_qwen3, tiny_distilbert, qwen3_8b_config_dir, tmp_path):
    """The checkpoint's tokenizer.json run by `tokenizers` gives what transformers' AutoTokenizer
    gives for the same folder: ids, ids cut to a length (special tokens kept), special-token ids,
    vocabulary size and decoded text; for a real BERT (MiniLM, whose tokenizer.json carries a
    padding setting that must not apply), the tiny and full-size Qwen3 and the tiny DistilBERT.
    A folder with vocabulary files only is converted by AutoTokenizer, to the same ids."""
    from transformers import AutoTokenizer
    vocab_only = tmp_path / "vocab-only"
    vocab_only.mkdir()
    for name in ("config.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, vocab_only / name)
    for folder in (minilm_dir, tiny_qwen3, tiny_distilbert, qwen3_8b_config_dir, vocab_only):
        ours = checkpoint.load(str(folder)).tokenizer()
        theirs = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        assert len(ours) == len(theirs), folder
        assert ours.special_ids == {role: i for role in ("bos", "eos", "pad", "unk", "cls", "sep",
                                                         "mask")
                                    if (i := getattr(theirs, f"{role}_token_id")) is not None}, folder
        for text in TOKENIZED:
            ids = theirs(text)["input_ids"]
            assert ours.encode(text) == ids, (folder, text)
            assert ours.encode(text, max_length=8) == \
                theirs(text, truncation=True, max_length=8)["input_ids"], (folder, text)
            assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), (folder, text)
    assert checkpoint.load(str(minilm_dir)).tokenizer().encode("Hello world!") == \
        checkpoint.load(str(vocab_only)).tokenizer().encode("Hello world!")


def test_no_weights_distilbert(distilbert_config_dir):
    assert not list(distilbert_config_dir.glob("*.safetensors"))
    assert _config(distilbert_config_dir) == shipped_config("distilbert-base-uncased")
    assert len(checkpoint.load(str(distilbert_config_dir)).tokenizer()) == 30522


def test_weights_follow_the_seed(tmp_path, micro_bert):
    a = load_file(synthesize(micro_bert, tmp_path / "a", seed=1) / "model.safetensors")
    b = load_file(synthesize(micro_bert, tmp_path / "b", seed=1) / "model.safetensors")
    c = load_file(synthesize(micro_bert, tmp_path / "c", seed=2) / "model.safetensors")
    name = "encoder.layer.0.attention.self.query.weight"
    assert a.keys() == b.keys() == c.keys() and name in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[name], c[name]) and a[name].std() > 0


def test_synth_errors(tmp_path, micro_bert):
    with pytest.raises(UserError, match="'hidden' is not a key of Qwen3-8B"):
        synthesize("Qwen3-8B", tmp_path / "x", weights=False, overrides={"hidden": 64})
    with pytest.raises(UserError, match="config file not found"):
        synthesize(tmp_path / "nope.json", tmp_path / "x")
    with pytest.raises(UserError, match="byte-level BPE tokenizer needs at least"):
        synthesize("Qwen3-8B", tmp_path / "x", weights=False, overrides={"vocab_size": 100})
    assert not (tmp_path / "x").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("")
    with pytest.raises(UserError, match="already exists and is not an empty directory"):
        synthesize(micro_bert, tmp_path / "full")
    assert [p.name for p in tmp_path.iterdir()] == ["full"]  # no temp dir left behind


def test_parse_override():
    assert parse_override("num_hidden_layers=2") == ("num_hidden_layers", 2)
    assert parse_override("tie_word_embeddings=false") == ("tie_word_embeddings", False)
    assert parse_override("rope_scaling=null") == ("rope_scaling", None)
    assert parse_override("hidden_act=gelu") == ("hidden_act", "gelu")
    assert parse_override("architectures=[\"A\"]") == ("architectures", ["A"])
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        parse_override("num_hidden_layers")


@pytest.mark.slow
def test_cli_model_synth(tmp_path, micro_bert, capsys):
    """The installed entry point end to end (subprocess), and a user error as one line, exit 2."""
    cfg = tmp_path / "config.json"
    cfg.write_bytes(orjson.dumps(micro_bert))
    out = tmp_path / "ck"
    cli = [sys.executable, "-m", "pipeline.cli", "model", "synth"]
    r = subprocess.run(cli + [str(cfg), "-o", str(out), "--seed", "3", "--override", "num_hidden_layers=2",
                              "--override", "hidden_act=gelu"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)
    assert _config(out) == {**micro_bert, "num_hidden_layers": 2}
    assert "encoder.layer.1.output.dense.weight" in load_file(out / "model.safetensors")

    assert main(["model", "synth", "Qwen3-8B", "--no-weights", "-o", str(tmp_path / "q"),
                 "--override", "depth=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trtmc: error: --override depth: 'depth' is not a key of Qwen3-8B")
    assert len(err.splitlines()) == 1 and not (tmp_path / "q").exists()


@pytest.mark.parametrize("ref", ["../../../escaped", "a/../b", ".hidden", ""])
def test_a_ref_that_is_no_ref_name_is_refused_before_anything_is_cached(tiny_bert, tmp_path,
                                                                       monkeypatch, ref):
    """Before: `--ref ../../../escaped` wrote outside the cache, and a ref that failed to write
    left the snapshot cached, so the command could not be run again."""
    from pipeline.models import hubcache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    with pytest.raises(UserError, match=r"^ref .*: expected a ref name"):
        hubcache.add_to_cache(tiny_bert, "org/tiny", commit, ref=ref)
    assert not (tmp_path / "hub").exists() and not (tmp_path / "escaped").exists()
    snapshot = hubcache.add_to_cache(tiny_bert, "org/tiny", commit, ref="pr/1")
    assert (tmp_path / "hub" / "models--org--tiny" / "refs" / "pr" / "1").read_text() == commit
    assert snapshot.name == commit


@pytest.mark.parametrize("overrides, message", [
    ({"n_heads": 0}, "transformers rejects this config (ZeroDivisionError"),
    ({"max_position_embeddings": -5}, "transformers rejects this config (RuntimeError: Trying to "
                                      "create tensor with negative dimension"),
    ({"vocab_size": 10 ** 9}, "'vocab_size' must be an integer in 1..2097152 (got 1000000000)"),
    ({"vocab_size": True}, "'vocab_size' must be an integer in 1..2097152 (got True)"),
    ({"dim": 20480, "n_heads": 16}, "GiB, more than half this machine's memory"),
    ({"dim": 96000, "n_heads": 12}, "$.dim: 96000 is greater than the maximum of 20480"),
    ({"model_type": "nosuch"}, "model_type nosuch is not an architecture transformers knows"),
    ({"model_type": "bert\nx"}, "model_type 'bert\\nx' is not an architecture"),
    ({"model_type": 5}, "$.model_type: 5 is not of type 'string'"),
])
def test_a_config_synth_cannot_build_is_one_line(tmp_path, overrides, message):
    """Before: tracebacks from transformers or torch, and for a huge size an allocation that ran
    until memory was gone; then transformers' list of every model type (11,916 characters), and a
    reason cut at the colon that introduced it."""
    with pytest.raises(UserError) as e:
        synthesize("distilbert-base-uncased", tmp_path / "x", overrides=overrides)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "x").exists()


def test_a_reason_transformers_introduces_with_a_colon_keeps_its_next_line(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "qwen3", "head_dim": null, "vocab_size": 100}')
    with pytest.raises(UserError, match="field 'head_dim': TypeError: Field 'head_dim' expected "
                                        "int, got NoneType"):
        synthesize(config, tmp_path / "x")


@pytest.mark.parametrize("repo_id", ["a--b/c", "a/b--c", "org/..x"])
def test_a_repo_id_the_cache_could_not_tell_apart_is_refused(tiny_bert, tmp_path, monkeypatch,
                                                            repo_id):
    from pipeline.models import hubcache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UserError, match="expected ORG/NAME"):
        hubcache.add_to_cache(tiny_bert, repo_id, "0123456789abcdef0123456789abcdef01234567")
    assert not (tmp_path / "hub").exists()
