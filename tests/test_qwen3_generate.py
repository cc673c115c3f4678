"""Qwen3 on the reference runtime vs transformers' Qwen3ForCausalLM (tiny random checkpoint).

Reference: transformers in FP32 on the same weights (the synthetic checkpoint is BF16, so both
sides start from identical values); ours runs the BF16 network. The network rounds activations
and the logits themselves to BF16 (2^-8 relative), so logits are compared with a tolerance of 1%
of their range, and greedy tokens must equal transformers' greedy tokens exactly -- except that a
divergence is allowed at a step where transformers' own top-2 margin is within that tolerance (a
numerical tie, which no BF16 network can resolve like an FP32 one); after it, every token we pick
must still be transformers' argmax up to the tolerance, teacher-forced on our sequence.
"""
from __future__ import annotations

import pytest
import torch

from pipeline.errors import UserError
from pipeline.families.capture import capture_role
from pipeline.models.checkpoint import load
from pipeline.trt.export import export_network
from pipeline.runtime.generate import KVCache, Sampling, generate
from pipeline.runtime.program import Program
from pipeline.modes import Mode

PROMPTS = ([1, 2, 3, 4, 5], [100, 7], list(range(300, 340)))
NEW_TOKENS = 32
CACHE = 96


def role_exports(model_dir, layout: str, precision: str = "bf16") -> list[tuple[dict, dict]]:
    """(network export, weights) of each role of the tiny checkpoint, in role order."""
    ck = load(str(model_dir))
    options = {"max_cache_length": CACHE, "decoder_engine_layout": layout, "precision": precision}
    first = capture_role(str(model_dir), None, None, options, checkpoint=ck)
    exports = []
    for role in first.all_roles:
        cap = first if role == first.role else capture_role(str(model_dir), None, role, options,
                                                            checkpoint=ck)
        export = export_network(cap.nb, role)
        weights = {k: ck.tensor(v["tensor"]) for k, v in export["weights"].items()
                   if v["source"] == "checkpoint"} | cap.nb.computed
        exports.append((export, weights))
    return exports


def lower_roles(model_dir, layout: str, precision: str = "bf16", device: str = "cpu",
                mode: Mode = Mode.EAGER) -> list[Program]:
    return [Program.lower(export, weights, device=device, mode=mode)
            for export, weights in role_exports(model_dir, layout, precision)]


@pytest.fixture(scope="module")
def hf(tiny_qwen3):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["split", "unified"])
def programs(request, tiny_qwen3):
    return lower_roles(tiny_qwen3, request.param)


def check_against_hf(hf, programs, prompt):
    g = generate(programs[0], programs[-1], prompt, NEW_TOKENS, keep_logits=True)
    assert len(g.token_ids) == NEW_TOKENS and g.stop_reason == "max_new_tokens"
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1:-1]
        hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
    ours = torch.stack(g.logits)
    tol = 0.01 * float(ref.max() - ref.min())
    assert (ours - ref).abs().max().item() <= tol
    chosen = ref.gather(1, torch.tensor(g.token_ids)[:, None])[:, 0]
    assert (ref.max(-1).values - chosen).max().item() <= tol  # every pick is HF's argmax or a tie
    same = next((i for i, (a, b) in enumerate(zip(g.token_ids, hf_tokens)) if a != b), None)
    if same is not None:
        top2 = ref[same].topk(2).values
        assert (top2[0] - top2[1]).item() <= tol, f"diverged from transformers at step {same}"
    return g.token_ids, hf_tokens


@pytest.mark.parametrize("prompt", PROMPTS, ids=["p5", "p2", "p40"])
def test_logits_and_greedy_tokens_match_transformers(hf, programs, prompt):
    check_against_hf(hf, programs, prompt)


def test_sampling_is_seeded_and_top_p_limits_the_choice(tiny_qwen3, programs):
    prefill, decode = programs[0], programs[-1]
    a = generate(prefill, decode, [5, 6, 7], 12, sampling=Sampling(False, 1.5, 0.9, seed=3))
    b = generate(prefill, decode, [5, 6, 7], 12, sampling=Sampling(False, 1.5, 0.9, seed=3))
    c = generate(prefill, decode, [5, 6, 7], 12, sampling=Sampling(False, 1.5, 0.9, seed=4))
    assert a.token_ids == b.token_ids != c.token_ids
    nucleus = generate(prefill, decode, [5, 6, 7], 12, sampling=Sampling(False, 1.0, 1e-6, seed=3))
    assert nucleus.token_ids == generate(prefill, decode, [5, 6, 7], 12).token_ids


def test_eos_stops_and_cache_capacity_is_checked(programs):
    prefill, decode = programs[0], programs[-1]
    free = generate(prefill, decode, [9, 8, 7], 6)
    stop = free.token_ids[2]
    g = generate(prefill, decode, [9, 8, 7], 6, eos_token_ids=(stop,))
    assert g.stop_reason == "eos" and g.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]
    with pytest.raises(UserError, match="max_cache_length is 96"):
        generate(prefill, decode, list(range(90)), 8)
    cache = KVCache(prefill)
    assert sorted(cache.buffers)[:2] == ["past_key.0", "past_key.1"] and cache.capacity == CACHE


@pytest.mark.parametrize("layout", ["split", "unified"])
@pytest.mark.slow
def test_fp16_greedy_tokens_identical_to_transformers(hf, tiny_qwen3, layout):
    """FP16 rounds 8x finer than BF16, so on this checkpoint no step is a rounding tie: greedy
    tokens must equal transformers' exactly, 40 new tokens on every prompt, in both layouts."""
    prefill, *rest = lower_roles(tiny_qwen3, layout, "fp16")
    decode = rest[0] if rest else prefill
    for prompt in PROMPTS + ([7, 8, 9, 10], [42] * 12):
        ours = generate(prefill, decode, prompt, 40).token_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                              min_new_tokens=40)[0, len(prompt):].tolist()
        assert ours == ref, f"prompt {prompt[:5]}...: first difference at step " \
                            f"{next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)}"


def test_pipelines_of_one_process_share_each_referenced_weight(logits_slot):
    """Two pipelines over one checkpoint (a gate's judge holds the native one and the slot
    bundle's regions) hold one copy of each weight they reference; what a bundle embeds stays
    its own, and a weight no pipeline holds is let go."""
    import gc

    from pipeline.runtime import pipeline as runtime
    bundle, bindings, _ = logits_slot
    first = runtime.open_pipeline(bundle, kernel_bindings=bindings, device="cpu", in_process=True)
    second = runtime.open_pipeline(bundle, kernel_bindings=bindings, device="cpu", in_process=True)
    table = first.bundle.manifest["weights"]
    referenced = [k for k, r in table.items() if r["storage"] == "referenced"]
    embedded = [k for k, r in table.items() if r["storage"] == "embedded"]
    assert referenced and embedded
    assert all(first.weights[k] is second.weights[k] for k in referenced)
    assert not any(first.weights[k] is second.weights[k] for k in embedded)
    held = [id(first.weights[k]) for k in referenced]
    del first, second
    gc.collect()
    assert not {id(t) for t in runtime._ON_DEVICE.values()} & set(held)


def test_teacher_forcing_runs_in_the_pipelines_one_cache(qwen3_native_bundle):
    """A gate holds a decoder pipeline for generation and teacher forcing alike: forcing reuses
    its one cache, reset first, and gives the logits of a pipeline that never generated."""
    from pipeline.runtime.pipeline import open_pipeline
    prompt, forced = [3, 7, 11], [5, 9, 4]
    fresh = torch.stack(open_pipeline(qwen3_native_bundle).teacher_forced_logits(prompt, forced))
    pipe = open_pipeline(qwen3_native_bundle)
    pipe.generate(["the cat sat on"], 24)  # more of the cache written than forcing writes
    buffers = dict(pipe.kv_cache.buffers)
    written = len(prompt) + len(forced) - 1  # the last forced token is fed, not stored past it
    assert all(b[:, :, written + 1:].any() for b in buffers.values())
    assert torch.equal(torch.stack(pipe.teacher_forced_logits(prompt, forced)), fresh)
    for name, b in pipe.kv_cache.buffers.items():
        assert b is buffers[name], name
        assert b[:, :, :written].any() and not b[:, :, written + 1:].any(), name


def test_the_pipelines_of_one_process_share_one_set_of_cache_buffers(qwen3_native_bundle):
    """A judge holds several pipelines of one model and a kernel host two: they share the cache
    buffers (each run resets them first), and each run's result is what a pipeline of its own
    gives; the buffers go when no pipeline holds them."""
    import gc
    import weakref

    from pipeline.runtime.pipeline import open_pipeline
    first, second = open_pipeline(qwen3_native_bundle), open_pipeline(qwen3_native_bundle)
    assert first.kv_cache.buffers is second.kv_cache.buffers
    alone = first.generate(["the cat sat on"], 12)
    forced = torch.stack(second.teacher_forced_logits([3, 7, 11], [5, 9, 4]))
    assert first.generate(["the cat sat on"], 12) == alone
    assert torch.equal(torch.stack(second.teacher_forced_logits([3, 7, 11], [5, 9, 4])), forced)
    held = weakref.ref(first.kv_cache.buffers)
    del first, second
    gc.collect()
    assert held() is None
    with torch.inference_mode():  # as a kernel host and a timed gate run: buffers made here
        made_there = open_pipeline(qwen3_native_bundle)
        alone = made_there.generate(["the cat sat on"], 12)
    assert open_pipeline(qwen3_native_bundle).generate(["the cat sat on"], 12) == alone  # written here
