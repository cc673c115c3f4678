"""The Qwen3 network (`Qwen3ForCausalLM`), batch 1, with a fixed-capacity KV cache.

Every role has the same inputs and outputs (names from the family's DecoderIO), so the runtime
drives them the same way:

* `input_ids`, `position_ids` INT32 [1, S]; `past_length` INT32 [1] (where this step's keys are
  written: the device-side cache length before the step); `total_length` INT32 [1] (past + S: the
  attention's key/value length);
* per layer N, `past_key.N` / `past_value.N` [1, KV, C, D] in the build precision (C =
  max_cache_length), updated in place into the outputs `present_key.N` / `present_value.N`;
* unified only: `attention_mask` [1, 1, S, C] in the build precision, added to the scores (0 =
  attend, the dtype's lowest value = masked), because a causal alignment that is unambiguous with a
  padded cache exists only for prefill-from-empty and s_q = 1. It replaces `total_length` as the
  key limit there: TensorRT-RTX 1.7 fails to compile (Myelin "more than one op named
  <mask>_iota") two attention layers sharing a BOOL mask, and an additive mask builds.
* output `logits` FP32 [1, 1, vocab]: the last position only.

Attention per role: prefill (cache empty, total_length = S) uses the UPPER_LEFT causal mask;
decode (S = 1) uses no mask; both limit keys by `total_length`; unified uses the mask alone. The query is scaled by
head_dim**-0.5 in FP32 and rounded to the precision before the attention layer, so the layer (and
a kernel replacing it) uses softmax scale 1.0.
"""
from __future__ import annotations

import torch

from pipeline.errors import UserError
from pipeline.families import config_size
from pipeline.families.qwen3 import ATTENTION_RECIPE, FAMILY, IO, LOGITS_RECIPE
from pipeline.trt.network import NetworkBuilder
from pipeline import dtypes
from pipeline.trt import data_type, trt

class _Dims:
    def __init__(self, cfg: dict, path):
        where = f"{path / 'config.json'}"
        size = lambda key, default=None: config_size(cfg, key, path, default)  # noqa: E731
        self.hidden = size("hidden_size")
        self.heads = size("num_attention_heads")
        self.kv_heads = size("num_key_value_heads", self.heads)
        self.head_dim = size("head_dim", self.hidden // self.heads)
        self.layers = size("num_hidden_layers")
        self.inter = size("intermediate_size")
        self.vocab = size("vocab_size")
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.bias = bool(cfg.get("attention_bias", False))
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.positions = size("max_position_embeddings")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise UserError(f"{where}: rope type '{rope.get('rope_type', rope.get('type'))}' is not "
                            f"supported (expected the default RoPE)")
        self.theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        if cfg.get("hidden_act", "silu") != "silu":
            raise UserError(f"{where}: hidden_act '{cfg['hidden_act']}' is not supported "
                            f"(expected 'silu')")
        if cfg.get("use_sliding_window"):
            raise UserError(f"{where}: use_sliding_window is not supported (expected false)")
        if self.heads % self.kv_heads:
            raise UserError(f"{where}: num_attention_heads {self.heads} is not a multiple of "
                            f"num_key_value_heads {self.kv_heads}")


def rope_tables(head_dim: int, theta: float, length: int, dtype: torch.dtype):
    """cos and sin [length, head_dim / 2], computed as transformers does (FP32, then rounded)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(length, dtype=torch.float)[:, None] * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


class _Decoder:
    def __init__(self, nb: NetworkBuilder, d: _Dims, dtype: str, role: str, cache: int, unified: bool):
        self.nb, self.net, self.d, self.dtype, self.role, self.cache = nb, nb.network, d, dtype, role, cache
        self.unified = unified  # one engine for prefill and decode, keys limited by the mask
        self.tables = None

    # -- helpers ---------------------------------------------------------------------------
    def weight(self, name: str, shape):
        """A checkpoint tensor as stored, cast to the precision when it is stored otherwise."""
        t = self.nb.checkpoint_constant(name, shape)
        if t.dtype == data_type(self.dtype):
            return t
        return self.net.add_cast(t, data_type(self.dtype)).get_output(0)

    def reshape(self, x, dims, transpose=None):
        s = self.net.add_shuffle(x)
        s.reshape_dims = tuple(dims)
        if transpose is not None:
            s.second_transpose = tuple(transpose)
        return s.get_output(0)

    def ew(self, a, b, op):
        return self.net.add_elementwise(a, b, getattr(trt.ElementWiseOperation, op)).get_output(0)

    def cast(self, x, dtype: str):
        return self.net.add_cast(x, data_type(dtype)).get_output(0)

    def linear(self, x, name: str, n_in: int, n_out: int, bias: bool = False):
        y = self.net.add_matrix_multiply(x, trt.MatrixOperation.NONE,
                                         self.weight(f"{name}.weight", [n_out, n_in]),
                                         trt.MatrixOperation.TRANSPOSE).get_output(0)
        if bias:
            y = self.ew(y, self.reshape(self.weight(f"{name}.bias", [n_out]), (1, n_out)), "SUM")
        return y

    def rms_norm(self, x, name: str, size: int, rank: int):
        """transformers' Qwen3RMSNorm: FP32 statistics, rounded, then times the weight."""
        xf = self.cast(x, "FP32")
        mean = self.net.add_reduce(self.ew(xf, xf, "PROD"), trt.ReduceOperation.AVG,
                                   1 << (rank - 1), True).get_output(0)
        eps = self.nb.scalar(f"rms_norm_eps_{rank}", self.d.eps, "FP32", rank)
        rstd = self.net.add_unary(self.net.add_unary(self.ew(mean, eps, "SUM"),
                                                     trt.UnaryOperation.SQRT).get_output(0),
                                  trt.UnaryOperation.RECIP).get_output(0)
        y = self.cast(self.ew(xf, rstd, "PROD"), self.dtype)
        return self.ew(self.reshape(self.weight(f"{name}.weight", [size]), (1,) * (rank - 1) + (size,)),
                       y, "PROD")

    def heads(self, x, n: int, norm: str | None, p: str):
        """[S, n*D] -> [1, n, S, D], with Qwen3's per-head RMSNorm before the transpose."""
        x = self.reshape(x, (1, -1, n, self.d.head_dim))
        if norm:
            x = self.rms_norm(x, p + norm, self.d.head_dim, 4)
        s = self.net.add_shuffle(x)
        s.first_transpose = (0, 2, 1, 3)
        return s.get_output(0)

    def rope(self, x, positions):
        if self.tables is None:  # once per network: [C, D/2] tables are large for long caches
            cos, sin = rope_tables(self.d.head_dim, self.d.theta, self.cache, dtypes.torch_dtype(self.dtype))
            self.tables = (self.nb.computed_constant("rope_cos", cos),
                           self.nb.computed_constant("rope_sin", sin))
        layer = self.net.add_rotary_embedding(x, *self.tables, False, self.d.head_dim)
        layer.set_input(3, positions)
        return layer.get_output(0)

    # -- blocks ----------------------------------------------------------------------------
    def attention(self, x, i: int, io: dict):
        d, net, p = self.d, self.net, f"model.layers.{i}.self_attn."
        q = self.heads(self.linear(x, p + "q_proj", d.hidden, d.heads * d.head_dim, d.bias),
                       d.heads, "q_norm", p)
        k = self.heads(self.linear(x, p + "k_proj", d.hidden, d.kv_heads * d.head_dim, d.bias),
                       d.kv_heads, "k_norm", p)
        v = self.heads(self.linear(x, p + "v_proj", d.hidden, d.kv_heads * d.head_dim, d.bias),
                       d.kv_heads, None, p)
        q, k = self.rope(q, io[IO.position_ids]), self.rope(k, io[IO.position_ids])
        scale = self.nb.scalar("query_scale", d.head_dim ** -0.5, "FP32", 4)
        q = self.cast(self.ew(self.cast(q, "FP32"), scale, "PROD"), self.dtype)
        q.name = f"decoder.layers.{i}.attention.scaled_query"
        caches = []
        for kind, update, past_name, present_name in (("key", k, IO.past_key, IO.present_key),
                                                      ("value", v, IO.past_value, IO.present_value)):
            past = self.nb.input(f"{past_name}{i}", self.dtype,
                                 [1, d.kv_heads, self.cache, d.head_dim])
            layer = net.add_kv_cache_update(past, update, io[IO.past_length], trt.KVCacheMode.LINEAR)
            layer.name = f"decoder.layers.{i}.{kind}_cache_update"
            caches.append(self.nb.mark_output(layer.get_output(0), f"{present_name}{i}"))
        first = self.nb.layer_index()
        causal = trt.CausalMaskKind.UPPER_LEFT if self.role == IO.prefill_role else trt.CausalMaskKind.NONE
        att = net.add_attention_v2(q, caches[0], caches[1], trt.AttentionNormalizationOp.SOFTMAX,
                                   causal)
        att.name = f"decoder.layers.{i}.attention"
        # TensorRT's own remedy for long caches: its dedicated attention kernels do not cover every
        # padded shape (40,960 slots fails to build), and a decomposable attention always builds.
        att.decomposable = True
        att.get_output(0).name = f"decoder.layers.{i}.attention.context"
        if self.unified:
            att.mask = io[IO.attention_mask]
        else:
            att.key_value_lengths = io[IO.total_length]
        if self.role == IO.decode_role and not self.unified:
            self.nb.record_recipe(ATTENTION_RECIPE, f"decoder.layers.{i}.decode_attention", first,
                                  self.nb.layer_index(), output_shape_like_input=0)
        s = net.add_shuffle(att.get_output(0))
        s.first_transpose = (0, 2, 1, 3)
        s.reshape_dims = (-1, d.heads * d.head_dim)
        return self.linear(s.get_output(0), p + "o_proj", d.heads * d.head_dim, d.hidden, d.bias)

    def mlp(self, x, i: int):
        d, p = self.d, f"model.layers.{i}.mlp."
        gate = self.linear(x, p + "gate_proj", d.hidden, d.inter)
        sig = self.net.add_activation(gate, trt.ActivationType.SIGMOID).get_output(0)
        h = self.ew(self.ew(gate, sig, "PROD"), self.linear(x, p + "up_proj", d.hidden, d.inter), "PROD")
        return self.linear(h, p + "down_proj", d.inter, d.hidden)

    def block(self, x, i: int, io: dict):
        p, name = f"model.layers.{i}.", f"decoder.layers.{i}"
        with self.nb.scope(f"{name}.attention"):
            h = self.attention(self.rms_norm(x, p + "input_layernorm", self.d.hidden, 2), i, io)
        x = self._residual(x, h, f"{name}.attention_residual")
        with self.nb.scope(f"{name}.mlp"):
            h = self.mlp(self.rms_norm(x, p + "post_attention_layernorm", self.d.hidden, 2), i)
        return self._residual(x, h, f"{name}.mlp_residual")

    def _residual(self, x, h, name: str):
        add = self.net.add_elementwise(x, h, trt.ElementWiseOperation.SUM)
        add.name = f"{name}_add"
        add.get_output(0).name = name
        return add.get_output(0)

    def logits(self, x, io: dict):
        """LM head of the last position only ([1, 1, vocab]: static, and the prefill skips the
        full-vocab matmul of every other position), then the zero-bias region (CONSTANT -> CAST ->
        SUM) and the FP32 `logits`. The last row is S - 1 = total_length - past_length - 1, a
        device-side index, so no shape tensor enters the network."""
        d, net = self.d, self.net
        one = self.nb.computed_constant("one_int32", torch.ones(1, dtype=torch.int32))
        last = self.ew(self.ew(io[IO.total_length], io[IO.past_length], "SUB"), one, "SUB")
        x = net.add_gather(x, last, 0).get_output(0)
        head = "model.embed_tokens" if d.tied else "lm_head"
        y = self.reshape(self.linear(self.rms_norm(x, "model.norm", d.hidden, 2), head, d.hidden, d.vocab),
                         (1, 1, d.vocab))
        first = self.nb.layer_index()
        zero = self.nb.computed_constant("logits_zero_bias", torch.zeros(1, 1, d.vocab))
        y = self.ew(y, self.cast(zero, self.dtype), "SUM")
        self.nb.record_recipe(LOGITS_RECIPE, "decoder.logits_zero_bias", first, self.nb.layer_index())
        return self.nb.mark_output(self.cast(y, "FP32"), IO.logits)


def build_network(checkpoint, role: str, options: dict) -> NetworkBuilder:
    d = _Dims(checkpoint.config, checkpoint.path)
    cache = options["max_cache_length"]
    if not isinstance(cache, int) or not 1 <= cache <= d.positions:
        raise UserError(f"max_cache_length {cache}: expected 1..{d.positions} "
                        f"(max_position_embeddings of {checkpoint.path / 'config.json'})",
                        param="max_cache_length")
    dtype = FAMILY.precisions[options["precision"]]
    nb = NetworkBuilder(checkpoint)
    unified = options["decoder_engine_layout"] == "unified"
    dec = _Decoder(nb, d, dtype, role, cache, unified)
    io = {name: nb.input(name, "INT32", [1, -1]) for name in (IO.input_ids, IO.position_ids)}
    io |= {name: nb.input(name, "INT32", [1]) for name in (IO.past_length, IO.total_length)}
    if unified:
        io[IO.attention_mask] = nb.input(IO.attention_mask, dtype, [1, 1, -1, cache])
    with nb.scope("decoder.embeddings"):
        x = nb.network.add_gather(dec.weight("model.embed_tokens.weight", [d.vocab, d.hidden]),
                                  io[IO.input_ids], 0).get_output(0)
        x = dec.reshape(x, (-1, d.hidden))
    for i in range(d.layers):
        x = dec.block(x, i, io)
    with nb.scope("decoder.logits"):
        dec.logits(x, io)
    return nb
