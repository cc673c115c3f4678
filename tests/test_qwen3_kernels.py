"""Bound kernels on Qwen3 recipes: the identity copy on the logits recipe and the reference
decode-attention kernel (examples/byok/decode_attention.cu) on one layer's attention recipe give
the native bundle's greedy tokens; the attention kernel matches the runtime's attention rule."""
from __future__ import annotations

import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
import torch

from pipeline.bundle.writer import build_bundle
from pipeline.families.capture import capture_role
from pipeline.errors import UserError
from pipeline.graph.receipt import SelectionReceipt
from pipeline.graph.select import from_recipe, select_region
from pipeline.host import open_pipeline
from tests.conftest import QWEN3_OPTIONS, QWEN3_PROMPTS

OPTIONS, PROMPTS = QWEN3_OPTIONS, QWEN3_PROMPTS


@pytest.mark.slow
def test_run_command_writes_jsonl_and_benchmarks(qwen3_native_bundle, qwen3_native_tokens, tmp_path, capsys):
    from pipeline.cli import main
    out = tmp_path / "gen.jsonl"
    args = ["run", str(qwen3_native_bundle), "--device", "cpu", "--max-new-tokens", "24", "--greedy"]
    assert main(args + [a for p in PROMPTS for a in ("--prompt", p)] + ["--output", str(out)]) == 0
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["token_ids"] for r in records] == qwen3_native_tokens
    assert all(isinstance(r["text"], str) and r["prompt"] in PROMPTS for r in records)
    capsys.readouterr()
    assert main(args + ["--prompt", PROMPTS[0], "--warmup", "1", "--benchmark", "2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(f.split("=") for f in line.split())
    assert float(fields["generated_tokens_mean"]) == 24.0 and float(fields["tokens_per_sec"]) > 0


def slot_bundle(model, recipe, instance, kernel: Path, out: Path, workspace_bytes: int = 0,
                function: str = "run") -> tuple[Path, Path]:
    """The recipe's slot bundle and a manifest binding it to `function` of `kernel`; with
    `workspace_bytes`, the recipe's nodes selected by hand with that workspace instead."""
    snapshot = capture_role(str(model), None, "decode", OPTIONS).snapshot
    receipt = from_recipe(snapshot, recipe, instance)
    if workspace_bytes:
        receipt = select_region(snapshot, list(receipt.nodes), binding_id="layer1.attention.workspace@1",
                                workspace_bytes=workspace_bytes,
                                output_shape_like_input=receipt.output_shape_like_input)
    bundle = build_bundle(str(model), None, OPTIONS, out / "slot.bundle", selection=receipt,
                          build_plans=False)
    return bundle, binding(receipt, kernel, out, function)


def binding(receipt: SelectionReceipt | SimpleNamespace, kernel: Path, out: Path, function: str) -> Path:
    """A manifest in `out` binding the receipt's slot to `function` of a copy of `kernel`."""
    manifest = out / f"bindings.{function}.json"
    manifest.write_bytes(orjson.dumps({"schema_version": 1, "bindings": [
        {"id": receipt.binding_id, "abi_sha256": receipt.abi_sha256,
         "library": kernel.name, "function": function}]}))
    if not (out / kernel.name).exists():  # never over a library a pipeline has loaded
        shutil.copy2(kernel, out / kernel.name)
    return manifest


@pytest.mark.parametrize("recipe,instance,kernel", [
    ("qwen.decode_logits_copy@1", "decoder.logits_zero_bias", "identity_copy"),
    ("qwen.decode_attention_region@2", "decoder.layers.1.decode_attention", "decode_attention"),
    ("qwen.decode_attention_region@2", "decoder.layers.1.decode_attention", "decode_attention_hopper"),
])
def test_bound_kernel_gives_native_greedy_tokens(tiny_qwen3, qwen3_kernels, qwen3_native_tokens, tmp_path,
                                                 recipe, instance, kernel):
    bundle, manifest = slot_bundle(tiny_qwen3, recipe, instance, qwen3_kernels[kernel], tmp_path)
    pipe = open_pipeline(bundle, manifest)
    assert [r["token_ids"] for r in pipe.generate(PROMPTS, 24, greedy=True)] == qwen3_native_tokens


@pytest.mark.slow
def test_hopper_kernel_takes_the_workspace_of_a_manual_selection(tiny_qwen3, qwen3_kernels, qwen3_native_tokens,
                                                                  tmp_path):
    """The attention recipe's nodes selected by hand with a workspace: run_workspace (the CPU
    build is the reference path; the CUDA path is probed in benchmarks/gpu_attention.py) gives the
    native tokens, and `run`, which takes no workspace, is refused at binding."""
    bundle, manifest = slot_bundle(tiny_qwen3, "qwen.decode_attention_region@2",
                                   "decoder.layers.1.decode_attention",
                                   qwen3_kernels["decode_attention_hopper"], tmp_path,
                                   workspace_bytes=266240, function="run_workspace")
    pipe = open_pipeline(bundle, manifest)
    assert [r["token_ids"] for r in pipe.generate(PROMPTS, 24, greedy=True)] == qwen3_native_tokens
    receipt = orjson.loads(manifest.read_bytes())["bindings"][0]
    wrong = binding(SimpleNamespace(binding_id=receipt["id"], abi_sha256=receipt["abi_sha256"]),
                    qwen3_kernels["decode_attention_hopper"], tmp_path, "run")
    with pytest.raises(UserError, match=r"decode_attention_hopper.so:run takes .* calls it with 6 args"):
        open_pipeline(bundle, wrong)


@pytest.mark.parametrize("kernel", ["decode_attention", "decode_attention_hopper"])
def test_decode_attention_kernel_matches_the_attention_rule(qwen3_kernels, kernel):
    """GQA, a padded cache limited by kv_len, one query row: kernel vs the runtime's rule (the
    Hopper kernel's CPU build is its fallback path; its CUDA path is probed in benchmarks/gpu_attention.py)."""
    import tvm_ffi
    from tests.test_runtime_ops import attention_rule
    fn = tvm_ffi.load_module(str(qwen3_kernels[kernel])).get_function("run")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g).to(torch.bfloat16)
               for s in ((1, 8, 1, 32), (1, 2, 40, 32), (1, 2, 40, 32)))
    k[:, :, 17:] = 1e4  # padding beyond kv_len must not be used
    length = torch.tensor([17], dtype=torch.int32)
    expected = attention_rule("BF16", [1, 8, -1, 32], [1, 2, 40, 32], "NONE")(
        q, k, v, None, None, None, length)
    out = torch.full_like(q, float("nan"))
    fn(q, k, v, length, out)
    torch.testing.assert_close(out.float(), expected.float(), rtol=1.6e-2, atol=1e-2)


def test_region_timing_counts_only_the_active_part_of_the_cache(tiny_qwen3, qwen3_kernels, tmp_path):
    """The floor of a length-bounded region is the bytes it must move: keys and values up to the
    typical case's length (half the capacity), not the whole cache."""
    from pipeline import dtypes
    from pipeline.gates.performance import time_region
    bundle, manifest = slot_bundle(tiny_qwen3, "qwen.decode_attention_region@2",
                                   "decoder.layers.1.decode_attention",
                                   qwen3_kernels["decode_attention_hopper"], tmp_path)
    pipe = open_pipeline(bundle, manifest)
    (region,) = pipe.regions.values()
    timing = time_region(pipe, region, trials=1, warmup=0, seed=0, bandwidth=1e9)
    capacity = OPTIONS["max_cache_length"]
    assert timing.case == f"dim=1 kv_length={capacity // 2}" and timing.engine == "eager"

    def size(spec):
        n = torch.empty(0, dtype=dtypes.torch_dtype(spec["dtype"])).element_size() * math.prod(
            1 if d < 0 else d for d in spec["shape"])  # the case's dynamic dim is 1
        return n // 2 if len(spec["shape"]) == 4 and spec["shape"][2] == capacity else n
    caches = [s for s in region.abi["inputs"] if len(s["shape"]) == 4 and s["shape"][2] == capacity]
    assert len(caches) == 2  # keys and values
    assert timing.bytes == sum(size(s) for s in region.abi["inputs"] + region.abi["outputs"])
