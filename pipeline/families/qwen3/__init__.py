"""Decoder family: Qwen3 (`Qwen3ForCausalLM`), batch 1, fixed-capacity KV cache. Roles: `prefill`
and `decode` (layout "split") or one engine `decode` (layout "unified", which serves the prompt
too). Network and its input/output contract: `network.py`; what the decode-attention recipe's
region computes, as a kernel task outside trtmc: `reference.py`."""
from pipeline.families import DecoderIO, DecoderWorkload, Family, SINGLE_ENGINE_ROLE
from pipeline.families.qwen3.reference import DECODE_ATTENTION

IO = DecoderIO()
LAYOUTS = {"split": (IO.prefill_role, IO.decode_role), "unified": (SINGLE_ENGINE_ROLE,)}
ATTENTION_RECIPE = "qwen.decode_attention_region@2"
LOGITS_RECIPE = "qwen.decode_logits_copy@1"


def _roles(options: dict) -> tuple[str, ...]:
    return LAYOUTS[options["decoder_engine_layout"]]


def _profile(role: str, options: dict) -> dict:
    """(min, opt, max) shapes of the dynamic inputs: one token in the split decode engine, up to
    the cache length where the prompt is processed."""
    c, unified = options["max_cache_length"], options["decoder_engine_layout"] == "unified"
    s = (1, 1, 1) if role == IO.decode_role and not unified else (1, min(128, c), c)
    out: dict[str, tuple[tuple[int, ...], ...]] = {
        name: tuple((1, n) for n in s) for name in (IO.input_ids, IO.position_ids)}
    if unified:
        out[IO.attention_mask] = tuple((1, 1, n, c) for n in s)
    return out


FAMILY = Family(
    name="qwen3", model_types=("qwen3",), kind="decoder", io=IO,
    default_options={"precision": "bf16", "max_cache_length": 4096, "decoder_engine_layout": "split"},
    precisions={"bf16": "BF16", "fp16": "FP16"},
    option_choices={"decoder_engine_layout": tuple(LAYOUTS)},
    roles_of=_roles, profile_of=_profile,
    references={ATTENTION_RECIPE: DECODE_ATTENTION},  # the logits copy states none
    network_module="pipeline.families.qwen3.network", workload=DecoderWorkload,
)
