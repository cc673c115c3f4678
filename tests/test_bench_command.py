"""`trtmc bench region` and `trtmc bench decode` on tiny Qwen3 bundles (CPU), and the library
functions they call: the lines and the JSON they print, never how fast anything is."""
from __future__ import annotations

import re

import orjson
import pytest

from pipeline.cli import main

def bench(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["bench", *map(str, argv)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.slow
def test_region_prints_one_line_per_slot(logits_slot, capsys):
    bundle, manifest, receipt = logits_slot
    rc, out, err = bench(capsys, "region", bundle, "--kernel-bindings", manifest, "--device",
                         "cpu", "--trials", "3", "--warmup", "1")
    assert rc == 0, err
    (line,) = out.splitlines()
    assert line.startswith(f"{receipt.binding_id}  native ")
    for field in ("  kernel ", "  speedup ", "x  bytes ", "(copy ", "no roofline on a CPU",
                  "  outputs right (4 calls)"):
        assert field in line, line


@pytest.mark.slow
def test_region_json(logits_slot, capsys):
    bundle, manifest, receipt = logits_slot
    rc, out, err = bench(capsys, "region", bundle, "--kernel-bindings", manifest, "--device",
                         "cpu", "--trials", "2", "--warmup", "0", "--json")
    assert rc == 0, err
    doc = orjson.loads(out)
    assert doc["device"] == "cpu" and doc["trials"] == 2 and doc["warmup"] == 0
    assert doc["roofline"]["timer"] == "perf_counter" and doc["roofline"]["bytes_per_s"] > 0
    (region,) = doc["regions"]
    assert region["binding_id"] == receipt.binding_id and region["timer"] == "perf_counter"
    for key in ("native_median_s", "kernel_median_s", "kernel_speedup", "bytes", "floor_s",
                "kernel_roofline_fraction"):
        assert isinstance(region[key], (int, float)), key
    assert region["outputs"]["first_wrong_call"] is None and region["outputs"]["calls_checked"] == 2


@pytest.mark.slow
def test_region_of_a_native_bundle_is_refused(qwen3_native_bundle, capsys):
    rc, out, err = bench(capsys, "region", qwen3_native_bundle, "--device", "cpu")
    assert rc == 2 and out == ""
    assert "has no kernel slots (a native bundle)" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_decode_prints_tokens_per_second_roofline_and_transformers(logits_slot, capsys):
    bundle, manifest, _ = logits_slot
    rc, out, err = bench(capsys, "decode", bundle, "--kernel-bindings", manifest, "--device",
                         "cpu", "--prompt-tokens", "4", "--new-tokens", "4", "--trials", "2",
                         "--transformers")
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 6, lines
    assert lines[0].startswith("trtmc  ") and " tokens/s  (median decode " in lines[0]
    assert "for 3 tokens, 2 trials, prompt 4 tokens, cpu, eager)" in lines[0]
    assert re.fullmatch(r"first token  \d+\.\d\d ms  \(median of 2: the prompt's 4 tokens and "
                        r"one argmax\)", lines[1]), lines[1]
    assert re.fullmatch(r"first call  \d+\.\d\d s  \(a generation, eager\)", lines[2]), lines[2]
    assert lines[3].startswith("roofline  none on a CPU (weights ")
    # each of transformers' configurations, on the same checkpoint; on a CPU nothing compiles
    assert re.fullmatch(r"transformers  [\d.]+ tokens/s  \(dynamic cache: median decode [\d.]+ ms, "
                        r"first token [\d.]+ ms, transformers [\w.]+(, the fastest)?\)", lines[4]), lines[4]
    assert re.fullmatch(r"transformers  [\d.]+ tokens/s  \(static cache: median decode [\d.]+ ms, "
                        r"first token [\d.]+ ms, transformers [\w.]+(, the fastest)?\)", lines[5]), lines[5]
    assert sum(line.endswith(", the fastest)") for line in lines[4:]) == 1


def test_decode_json_skips_transformers_without_a_checkpoint(qwen3_native_bundle, capsys):
    rc, out, err = bench(capsys, "decode", qwen3_native_bundle, "--device", "cpu",
                         "--prompt-tokens", "3", "--new-tokens", "3", "--trials", "1",
                         "--transformers", "--json")
    assert rc == 0, err
    doc = orjson.loads(out)
    assert (doc["prompt_tokens"], doc["new_tokens"], doc["trials"]) == (3, 3, 1)
    assert len(doc["decode_seconds"]) == 1 and doc["kernels"] == []
    assert len(doc["first_token_seconds"]) == 1 and doc["first_token_seconds"][0] > 0
    assert doc["median_first_token_s"] == doc["first_token_seconds"][0]
    assert doc["first_call_s"] > 0 and doc["compile_cache"] is None  # eager: nothing compiled
    assert doc["weight_bytes"] > 0 and doc["roofline"] is None
    assert doc["roofline_tokens_per_s"] is None
    # a step reads every weight but the token embedding (512 x 64) and the rotary tables (64
    # positions x 8, cos and sin), all BF16, of which it reads a row; and the cache's keys and
    # values (2 layers x 2 heads x 16, BF16) at the mean context of 3 + 3 // 2 positions
    tables = (512 * 64 + 2 * 64 * 8) * 2
    assert doc["step_bytes"] == doc["weight_bytes"] - tables + 2 * 2 * 2 * 16 * 2 * (3 + 1)
    assert "embeds its weights" in doc["transformers"]["skipped"]


def test_decode_needs_room_in_the_cache(qwen3_native_bundle, capsys):
    rc, out, err = bench(capsys, "decode", qwen3_native_bundle, "--device", "cpu",
                         "--prompt-tokens", "60", "--new-tokens", "10")
    assert rc == 2 and out == "" and "max_cache_length is 64" in err


@pytest.mark.slow
def test_the_library_functions_return_the_figures_the_commands_print(logits_slot):
    from pipeline.gates.bench import bench_decode, bench_region
    from pipeline.runtime.pipeline import open_pipeline
    bundle, manifest, receipt = logits_slot
    pipe = open_pipeline(bundle, manifest, "cpu", in_process=True)  # as `trtmc bench` opens it
    region = bench_region(pipe, trials=2, warmup=0, seed=0)
    (timed,) = region.regions
    assert (region.mode, region.trials, timed.binding_id) == ("eager", 2, receipt.binding_id)
    assert region.to_json()["regions"] == [timed.to_json()]
    assert region.to_json()["roofline"] == region.roofline.to_json()
    (line,) = region.lines()
    assert line.startswith(f"{receipt.binding_id}  native ") and "no roofline on a CPU" in line
    decode = bench_decode(pipe, prompt_tokens=3, new_tokens=3, trials=1)
    doc = decode.to_json()
    assert decode.kernels == (receipt.binding_id,) and len(decode.decode_seconds) == 1
    assert "transformers" not in doc and doc["decode_seconds"] == list(decode.decode_seconds)
    assert doc["roofline"] is None and doc["weight_bytes"] == decode.weight_bytes > 0
    assert [line.split("  ")[0] for line in decode.lines()] == ["trtmc", "first token", "first call",
                                                                "roofline"]
