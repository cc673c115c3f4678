"""Device-state greedy decode (the step a CUDA graph captures) and the attention rule's BF16 path.

CPU: the chained device-state step with chunked EOS reads gives exactly the eager tokens; the
three-part BF16 split of FP32 attention weights is exact. GPU (marked): the captured decode and
prefill graphs give the eager tokens and prompt logits, and the BF16 tensor-core attention
products match the FP32 reference.
"""
from __future__ import annotations

import pytest
import torch

from pipeline.errors import UserError
from pipeline.runtime.decoder_ops import _bf16_products, _upcast_products, split_bf16
from pipeline.runtime.generate import (PREFILL_GRAPHS, Generation, GreedyDecodeGraph,
                                       GreedyDecodeStep, KVCache, PrefillGraph, _replay, _Step,
                                       generate)
from tests.test_qwen3_generate import lower_roles

PROMPT = [9, 8, 7, 6]


@pytest.fixture(scope="module", params=["split", "unified"])
def programs(request, tiny_qwen3):
    return lower_roles(tiny_qwen3, request.param)


def chained(prefill, decode, prompt, n, eos=(), every=16) -> Generation:
    """generate()'s graphed path with the uncaptured step: prefill, then _replay."""
    cache = KVCache(prefill)
    stepper = GreedyDecodeStep(decode, cache)
    stepper()  # dirty the cache and the state, as a capture's warm-up does
    cache.reset()
    past = torch.zeros(1, dtype=torch.int32)
    logits = _Step(prefill, cache)(torch.tensor([prompt], dtype=torch.int32), past)
    out = Generation(list(prompt), [], "max_new_tokens")
    _replay(stepper, out, logits.argmax().reshape(1), n, set(eos), every)
    return out


def test_chained_device_state_steps_give_the_eager_tokens(programs):
    prefill, decode = programs[0], programs[-1]
    eager = generate(prefill, decode, PROMPT, 20, cuda_graph=False)
    assert chained(prefill, decode, PROMPT, 20).token_ids == eager.token_ids
    assert generate(prefill, decode, PROMPT, 20).token_ids == eager.token_ids  # CPU: eager path


@pytest.mark.parametrize("every", [1, 3, 16])
def test_eos_read_back_in_chunks_stops_like_eager(programs, every):
    prefill, decode = programs[0], programs[-1]
    free = generate(prefill, decode, PROMPT, 12, cuda_graph=False).token_ids
    for stop in (free[0], free[4], free[-1]):
        eager = generate(prefill, decode, PROMPT, 12, eos_token_ids=(stop,), cuda_graph=False)
        got = chained(prefill, decode, PROMPT, 12, eos=(stop,), every=every)
        assert (got.token_ids, got.stop_reason) == (eager.token_ids, eager.stop_reason)
        assert got.stop_reason == "eos" and got.token_ids[-1] == stop


def test_graph_needs_cuda_and_eos_interval_is_checked(programs):
    prefill, decode = programs[0], programs[-1]
    with pytest.raises(UserError, match="needs a CUDA program"):
        GreedyDecodeGraph(decode, KVCache(prefill))
    with pytest.raises(UserError, match="needs a CUDA program"):
        PrefillGraph(prefill, KVCache(prefill), len(PROMPT))
    with pytest.raises(UserError, match="eos_check_every 0"):
        generate(prefill, decode, PROMPT, 4, eos_check_every=0)


def test_three_bf16_parts_sum_to_the_fp32_value_exactly():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, 4, 4096, generator=g) * 6, -1)
    parts = split_bf16(p)
    assert parts.dtype == torch.bfloat16 and parts.shape == (8, 12, 4096)
    hi, mid, lo = parts.float().split(4, dim=-2)
    assert torch.equal(hi + mid + lo, p)
    assert not torch.equal(hi, p)  # the lower parts matter


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["split", "unified"])
def test_cuda_graph_decode_equals_eager(tiny_qwen3, layout):
    prefill, *rest = lower_roles(tiny_qwen3, layout, device="cuda")
    decode = rest[0] if rest else prefill
    cache = KVCache(prefill)
    for prompt in (PROMPT, [100, 7], list(range(300, 340))):
        eager = generate(prefill, decode, prompt, 40, cuda_graph=False, cache=cache)
        graphed = generate(prefill, decode, prompt, 40, cache=cache)
        assert graphed.token_ids == eager.token_ids
        stop = eager.token_ids[5]
        assert generate(prefill, decode, prompt, 40, cache=cache, eos_token_ids=(stop,)).token_ids \
            == generate(prefill, decode, prompt, 40, cache=cache, eos_token_ids=(stop,),
                        cuda_graph=False).token_ids
    assert len(cache.graphs) == 1  # captured once per (program, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["split", "unified"])
def test_cuda_graph_prefill_equals_eager(tiny_qwen3, layout):
    """The prompt's logits from the captured prefill against the eager prefill's, prompts of
    several lengths through one cache (a length seen again replays its graph; past
    PREFILL_GRAPHS lengths the least recently used graph is dropped). Small tensors full of
    huge values are made between calls: they take any memory the allocator got back after a
    capture, so a graph reading a tensor that was freed (its start position) would write the
    cache out of bounds."""
    prefill, *rest = lower_roles(tiny_qwen3, layout, device="cuda")
    decode = rest[0] if rest else prefill
    cache = KVCache(prefill)
    prompts = (PROMPT, [100, 7], list(range(300, 340)), [9, 8, 7, 5], [5] * 7, [6] * 9, [7] * 11,
               [1, 2, 3, 4])
    junk = []
    for prompt in prompts + prompts[:2]:
        # keep_logits: the decode steps stay eager, the prompt's logits come back
        eager = generate(prefill, decode, prompt, 3, cuda_graph=False, keep_logits=True, cache=cache)
        junk += [torch.full((n,), 2 ** 30, dtype=torch.int32, device="cuda") for n in (1, 2, 64)]
        graphed = generate(prefill, decode, prompt, 3, keep_logits=True, cache=cache)
        torch.testing.assert_close(graphed.logits[0], eager.logits[0], rtol=1e-5, atol=1e-5)
        assert graphed.token_ids == eager.token_ids
    assert PREFILL_GRAPHS == 4 and [n for _, n in cache.prefill_graphs] == [9, 11, 4, 2]
    # the greedy path (prefill and decode graphs) over the same cache
    assert generate(prefill, decode, PROMPT, 12, cache=cache).token_ids == \
        generate(prefill, decode, PROMPT, 12, cuda_graph=False, cache=cache).token_ids


@pytest.mark.gpu
def test_a_capture_is_not_broken_by_the_collector_finding_a_dropped_graph(tiny_qwen3):
    """A dropped decode graph sits in a reference cycle (its capture holds its own step) until
    the collector runs; destroyed inside a later capture, it made that capture fail. With the
    collector run at nearly every allocation and the graph dropped before each capture (as a
    kernel switch drops it), every capture holds and gives the eager tokens."""
    import gc
    prefill, decode = lower_roles(tiny_qwen3, "split", device="cuda")
    cache = KVCache(prefill)
    eager = generate(prefill, decode, PROMPT, 8, cuda_graph=False, cache=cache).token_ids
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for _ in range(3):
            cache.drop_graphs()
            assert generate(prefill, decode, PROMPT, 8, cache=cache).token_ids == eager
    finally:
        gc.set_threshold(*threshold)


@pytest.mark.gpu
def test_bf16_attention_products_match_fp32():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(8, n, 128, generator=g, device="cuda").bfloat16() for n in (4, 4096, 4096))
    torch.testing.assert_close(_bf16_products.scores(q, k), _upcast_products.scores(q, k),
                               rtol=1e-5, atol=1e-4)
    p = torch.softmax(_upcast_products.scores(q, k) / 11.3, -1)
    torch.testing.assert_close(_bf16_products.weighted(p, v), _upcast_products.weighted(p, v),
                               rtol=1e-5, atol=1e-6)

