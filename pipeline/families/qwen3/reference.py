"""What the Qwen3 recipes' regions compute, stated for a kernel task outside trtmc (a
FlashInfer-Bench Definition, `pipeline/families/definition.py`). The reference is the rule of the
decode-attention region as `network.py` builds it (the query scaled before the attention layer,
no causal mask in the decode role, the key limit `total_length`) and as the runtime lowers it
(`pipeline/runtime/decoder_ops.py`: grouped-query heads, FP32 scores, softmax and weighted sum)."""
from pipeline.families import RegionReference

# Plain PyTorch, the family's constant text: FlashInfer-Bench runs `run` as the task's reference.
DECODE_ATTENTION_REFERENCE = '''\
import torch


@torch.no_grad()
def run(q, k_cache, v_cache, kv_length):
    """q [1, Hq, Q, D], already multiplied by the softmax scale; k_cache, v_cache [1, Hkv, C, D];
    kv_length int32 [1]: the active keys are positions 0 .. kv_length - 1, the rest are never read.
    Query head h reads key/value head h // (Hq // Hkv). No causal mask: every query position
    attends every active key. Scores, softmax and the weighted sum in float32."""
    group = q.shape[1] // k_cache.shape[1]
    n = int(kv_length[0])
    k = k_cache[0, :, :n].float().repeat_interleave(group, dim=0)  # [Hq, n, D]
    v = v_cache[0, :, :n].float().repeat_interleave(group, dim=0)
    scores = q[0].float() @ k.transpose(1, 2)  # [Hq, Q, n], softmax scale 1.0
    weights = torch.softmax(scores, dim=-1)
    return (weights @ v).to(q.dtype).unsqueeze(0)
'''

DECODE_ATTENTION = RegionReference(
    op_type="gqa_linear",
    name="gqa_linear_decode_h{num_qo_heads}_kv{num_kv_heads}_d{head_dim}_c{kv_capacity}_{dtype}",
    inputs=(("q", ("batch_size", "num_qo_heads", "qo_len", "head_dim")),
            ("k_cache", ("batch_size", "num_kv_heads", "kv_capacity", "head_dim")),
            ("v_cache", ("batch_size", "num_kv_heads", "kv_capacity", "head_dim")),
            ("kv_length", ("batch_size",))),
    outputs=(("output", ("batch_size", "num_qo_heads", "qo_len", "head_dim")),),
    axes={"batch_size": "sequences per call (one: the decoder runs batch 1)",
          "num_qo_heads": "query heads, and the output's",
          "qo_len": "query positions per call (one in decode); each attends every active key",
          "head_dim": "the head dimension",
          "num_kv_heads": "key/value heads: query head h reads key/value head "
                          "h // (num_qo_heads // num_kv_heads)",
          "kv_capacity": "the caches' fixed capacity in positions"},
    tensors={"q": "the query, already multiplied by head_dim ** -0.5 (the softmax scale is 1.0)",
             "k_cache": "the key cache; positions from kv_length on hold anything and are never read",
             "v_cache": "the value cache, laid out as k_cache",
             "kv_length": "the active length, a device tensor: 1 <= kv_length <= kv_capacity",
             "output": "the attention output, in the query's dtype"},
    reference=DECODE_ATTENTION_REFERENCE,
    description="Decode attention of one Qwen3 layer over a fixed-capacity KV cache (trtmc's "
                "qwen.decode_attention_region@2): softmax(q k^T) v over the first kv_length "
                "keys, without a causal mask, grouped-query heads, scores, softmax and the "
                "weighted sum in float32, the output rounded to the query's dtype.",
    tags=("trtmc", "model:qwen3", "stage:decode"),
    constraints=("num_qo_heads % num_kv_heads == 0",),
)
