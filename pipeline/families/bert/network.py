"""The BERT/DistilBERT encoder network.

Input: `input_ids` and `attention_mask` INT32 [S] (padded to the fixed sequence length);
output: `last_hidden_state` [S, H] in the build precision. Checkpoint tensors are constants as
stored (FP32 usually) followed by a CAST to the precision, so a bundle can reference them by name.
"""
from __future__ import annotations

import math

import torch

from pipeline.errors import UserError
from pipeline.families import config_size
from pipeline.families.bert import FAMILY, IO
from pipeline.trt.network import NetworkBuilder
from pipeline.trt import data_type, trt

class _Dims:
    """BERT and DistilBERT name the same sizes differently."""

    def __init__(self, cfg: dict, path):
        distil = cfg["model_type"] == "distilbert"
        self.distil = distil
        size = lambda key: config_size(cfg, key, path)  # noqa: E731
        self.hidden = size("dim" if distil else "hidden_size")
        self.heads = size("n_heads" if distil else "num_attention_heads")
        self.layers = size("n_layers" if distil else "num_hidden_layers")
        self.inter = size("hidden_dim" if distil else "intermediate_size")
        self.vocab = size("vocab_size")
        self.positions = size("max_position_embeddings")
        self.type_vocab = 0 if distil else cfg.get("type_vocab_size", 2)
        self.eps = 1e-12 if distil else cfg.get("layer_norm_eps", 1e-12)
        act = cfg.get("activation", "gelu") if distil else cfg.get("hidden_act", "gelu")
        if act != "gelu":
            raise UserError(f"config.json: activation '{act}' is not supported (expected 'gelu')")
        if self.hidden % self.heads:
            raise UserError("config.json: hidden size is not a multiple of the number of heads")


def _names(d: _Dims, prefix: str):
    if d.distil:
        emb = f"{prefix}embeddings."
        layer = lambda i: f"{prefix}transformer.layer.{i}."  # noqa: E731
        return emb, layer, {"q": "attention.q_lin", "k": "attention.k_lin", "v": "attention.v_lin",
                            "o": "attention.out_lin", "ln1": "sa_layer_norm",
                            "up": "ffn.lin1", "down": "ffn.lin2", "ln2": "output_layer_norm"}
    emb = f"{prefix}embeddings."
    layer = lambda i: f"{prefix}encoder.layer.{i}."  # noqa: E731
    return emb, layer, {"q": "attention.self.query", "k": "attention.self.key",
                        "v": "attention.self.value", "o": "attention.output.dense",
                        "ln1": "attention.output.LayerNorm", "up": "intermediate.dense",
                        "down": "output.dense", "ln2": "output.LayerNorm"}


def _prefix(checkpoint) -> str:
    """Checkpoints of task heads prefix the encoder's tensors (`bert.`, `distilbert.`)."""
    if checkpoint.has_weights:
        for name in checkpoint._index:
            if name.endswith("embeddings.word_embeddings.weight"):
                return name[: -len("embeddings.word_embeddings.weight")]
        raise UserError(f"{checkpoint.path}: no '*embeddings.word_embeddings.weight' tensor "
                        f"(expected a BERT/DistilBERT checkpoint)")
    return ""


class _Encoder:
    def __init__(self, nb: NetworkBuilder, d: _Dims, dtype: str, seq: int, prefix: str):
        self.nb, self.net, self.d, self.dtype, self.seq = nb, nb.network, d, dtype, seq
        self.emb, self.layer_prefix, self.n = _names(d, prefix)

    def weight(self, name, shape):
        t = self.nb.checkpoint_constant(name, shape)
        if t.dtype != trt.DataType.FLOAT or self.dtype == "FP32":
            return t
        return self.net.add_cast(t, data_type(self.dtype)).get_output(0)

    def vector(self, name, size):
        """A [size] checkpoint vector viewed as [1, size] for broadcasting over rows."""
        s = self.net.add_shuffle(self.weight(name, [size]))
        s.reshape_dims = (1, size)
        return s.get_output(0)

    def linear(self, x, name, n_in, n_out):
        w = self.weight(f"{name}.weight", [n_out, n_in])
        y = self.net.add_matrix_multiply(x, trt.MatrixOperation.NONE, w,
                                         trt.MatrixOperation.TRANSPOSE).get_output(0)
        b = self.vector(f"{name}.bias", n_out)
        return self.net.add_elementwise(y, b, trt.ElementWiseOperation.SUM).get_output(0)

    def layer_norm(self, x, name):
        scale = self.vector(f"{name}.weight", self.d.hidden)
        bias = self.vector(f"{name}.bias", self.d.hidden)
        layer = self.net.add_normalization(x, scale, bias, 1 << 1)
        layer.epsilon = self.d.eps
        return layer.get_output(0)

    def heads(self, x):
        """[S, H] -> [heads, S, head_dim]"""
        s = self.net.add_shuffle(x)
        s.reshape_dims = (self.seq, self.d.heads, self.d.hidden // self.d.heads)
        s.second_transpose = (1, 0, 2)
        return s.get_output(0)

    def scalar(self, name, value):
        return self.nb.scalar(name, value, self.dtype, 3)

    def mask_bias(self, mask):
        """INT32 [S] of 1/0 -> additive [1, 1, S]: 0 for tokens, -10000 for padding."""
        m = self.net.add_cast(mask, data_type(self.dtype)).get_output(0)
        s = self.net.add_shuffle(m)
        s.reshape_dims = (1, 1, self.seq)
        m = s.get_output(0)
        one = self.scalar("one", 1.0)
        inv = self.net.add_elementwise(one, m, trt.ElementWiseOperation.SUB).get_output(0)
        return self.net.add_elementwise(inv, self.scalar("mask_value", -10000.0),
                                        trt.ElementWiseOperation.PROD).get_output(0)

    def attention(self, x, p, bias):
        d, net = self.d, self.net
        q, k, v = (self.heads(self.linear(x, p + self.n[c], d.hidden, d.hidden)) for c in "qkv")
        scores = net.add_matrix_multiply(q, trt.MatrixOperation.NONE, k,
                                         trt.MatrixOperation.TRANSPOSE).get_output(0)
        scale = self.scalar("attention_scale", 1.0 / math.sqrt(d.hidden // d.heads))
        scores = net.add_elementwise(scores, scale, trt.ElementWiseOperation.PROD).get_output(0)
        scores = net.add_elementwise(scores, bias, trt.ElementWiseOperation.SUM).get_output(0)
        soft = net.add_softmax(scores)
        soft.axes = 1 << 2
        ctx = net.add_matrix_multiply(soft.get_output(0), trt.MatrixOperation.NONE, v,
                                      trt.MatrixOperation.NONE).get_output(0)
        s = net.add_shuffle(ctx)
        s.first_transpose = (1, 0, 2)
        s.reshape_dims = (self.seq, d.hidden)
        return self.linear(s.get_output(0), p + self.n["o"], d.hidden, d.hidden)

    def residual(self, x, h, name: str):
        """x + h as the layer `<name>_add` with output `<name>` (what graph listings show)."""
        add = self.net.add_elementwise(x, h, trt.ElementWiseOperation.SUM)
        add.name = f"{name}_add"
        add.get_output(0).name = name
        return add.get_output(0)

    def block(self, x, i, bias):
        p, net, d, name = self.layer_prefix(i), self.net, self.d, f"encoder.layers.{i}"
        with self.nb.scope(f"{name}.attention"):
            proj = self.attention(x, p, bias)
            proj.name = f"{name}.attention.projection"
        with self.nb.scope(f"{name}.attention.norm"):
            x = self.layer_norm(self.residual(x, proj, f"{name}.attention_residual"), p + self.n["ln1"])
            x.name = f"{name}.attention.output"
        with self.nb.scope(f"{name}.mlp"):
            h = self.linear(x, p + self.n["up"], d.hidden, d.inter)
            act = net.add_activation(h, trt.ActivationType.GELU_ERF)
            h = self.linear(act.get_output(0), p + self.n["down"], d.inter, d.hidden)
            h.name = f"{name}.mlp.projection"
        with self.nb.scope(f"{name}.output"):
            out = self.layer_norm(self.residual(x, h, f"{name}.mlp_residual"), p + self.n["ln2"])
            out.name = f"{name}.output"
        return out

    def embeddings(self, ids):
        d, net, S = self.d, self.net, self.seq
        x = net.add_gather(self.nb.checkpoint_constant(self.emb + "word_embeddings.weight",
                                                       [d.vocab, d.hidden]), ids, 0).get_output(0)
        positions = self.nb.computed_constant("position_ids", torch.arange(S, dtype=torch.int32))
        pos = net.add_gather(self.nb.checkpoint_constant(self.emb + "position_embeddings.weight",
                                                         [d.positions, d.hidden]), positions, 0)
        x = net.add_elementwise(x, pos.get_output(0), trt.ElementWiseOperation.SUM).get_output(0)
        if d.type_vocab:
            types = self.nb.computed_constant("token_type_ids", torch.zeros(S, dtype=torch.int32))
            tt = net.add_gather(self.nb.checkpoint_constant(
                self.emb + "token_type_embeddings.weight", [d.type_vocab, d.hidden]), types, 0)
            x = net.add_elementwise(x, tt.get_output(0), trt.ElementWiseOperation.SUM).get_output(0)
        if self.dtype != "FP32" and x.dtype == trt.DataType.FLOAT:
            x = net.add_cast(x, data_type(self.dtype)).get_output(0)
        return self.layer_norm(x, self.emb + "LayerNorm")


def build_network(checkpoint, role: str, options: dict) -> NetworkBuilder:
    d = _Dims(checkpoint.config, checkpoint.path)
    seq = options["sequence_length"]
    if not 1 <= seq <= d.positions:
        raise UserError(f"sequence_length {seq}: expected 1..{d.positions} "
                        f"(max_position_embeddings of {checkpoint.path / 'config.json'})",
                        param="sequence_length")
    nb = NetworkBuilder(checkpoint)
    enc = _Encoder(nb, d, FAMILY.precisions[options["precision"]], seq, _prefix(checkpoint))
    ids = nb.input(IO.input_ids, "INT32", [seq])
    mask = nb.input(IO.attention_mask, "INT32", [seq])
    with nb.scope("encoder.embeddings"):
        x = enc.embeddings(ids)
        x.name = "encoder.embeddings.output"
    with nb.scope("encoder.attention_mask"):
        bias = enc.mask_bias(mask)
    for i in range(d.layers):
        x = enc.block(x, i, bias)
    nb.mark_output(x, IO.hidden)
    return nb
