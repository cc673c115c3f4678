#!/usr/bin/env bash
# The tutorial's commands, one by one, as docs/tutorial.md gives them. Departures, each
# forced by this machine and named here: TRTMC is `trtmc`; `trtmc kernel build` replaces the CMake
# target; our decode-attention kernel stands in for the SM 10.3 FlashInfer POC; on a machine
# without a GPU the C++ residual add stands in for the CuTe DSL export (which needs one); the
# DistilBERT node id is read from our own listing, as the tutorial tells users to do.
# Needs: HF_HOME holding Qwen/Qwen3-8B@REVISION and distilbert/distilbert-base-uncased@CUTE_REVISION.
set -euo pipefail

export MODEL=Qwen/Qwen3-8B
export REVISION=b968826d9c46dd6066d109eabc6255188de91218
export WORK="$PWD/artifacts/qwen3-graph-slot"
export BUILD_DIR="${BUILD_DIR:-$PWD/build}"
export TRTMC="${TRTMC:-trtmc}"
mkdir -p "$WORK" "$BUILD_DIR"

BUILD_ARGS=(
  "$MODEL"
  --model-revision "$REVISION"
  --precision bf16
  --max-cache-length 40960
  --decoder-engine-layout split
)

# Level 1, step 1: slot-ready bundle from the recipe
export BINDING_ID=qwen.decode_logits_copy@1
"$TRTMC" build "${BUILD_ARGS[@]}" \
  --recipe "$BINDING_ID" decoder.logits_zero_bias \
  -o "$WORK/qwen3-slot-ready.bundle"
test -d "$WORK/qwen3-slot-ready.bundle"
test -f "$WORK/qwen3-slot-ready.selection.json"

"$TRTMC" graph inspect \
  --engine-role decode \
  --snapshot "$WORK/decode.graph.json" \
  "${BUILD_ARGS[@]}"
"$TRTMC" graph recipes "$WORK/decode.graph.json" \
  | tee "$WORK/decode.recipes.txt"

# step 2: the example DSO (trtmc kernel build stands in for the CMake target)
"$TRTMC" kernel build examples/byok/identity_copy.cu -o "$BUILD_DIR/identity_copy_kernel.so"
export SOURCE_DSO="$BUILD_DIR/identity_copy_kernel.so"
test -f "$SOURCE_DSO"

# step 3: bind when a pipeline loads
export DSO="$WORK/kernel.so"
cp "$SOURCE_DSO" "$DSO"
export ABI_SHA256="$(
  python -c 'import json,sys; print(json.load(open(sys.argv[1]))["abi_sha256"])' \
    "$WORK/qwen3-slot-ready.selection.json"
)"
cat > "$WORK/kernel-bindings.json" <<JSON
{
  "schema_version": 1,
  "bindings": [
    {
      "id": "$BINDING_ID",
      "abi_sha256": "$ABI_SHA256",
      "library": "./kernel.so",
      "function": "run"
    }
  ]
}
JSON
"$TRTMC" run "$WORK/qwen3-slot-ready.bundle" \
  --kernel-bindings "$WORK/kernel-bindings.json" \
  --prompt "Explain grouped-query attention in one sentence." \
  --max-new-tokens 32 \
  --greedy

# step 4: correctness and no regression
"$TRTMC" build "${BUILD_ARGS[@]}" -o "$WORK/qwen3-native.bundle"
TEST_PROMPT='Explain grouped-query attention, KV caching, and decode latency.'
MAX_NEW_TOKENS=64
"$TRTMC" run "$WORK/qwen3-native.bundle" \
  --prompt "$TEST_PROMPT" \
  --max-new-tokens "$MAX_NEW_TOKENS" --greedy \
  --output "$WORK/native.jsonl"
"$TRTMC" run "$WORK/qwen3-slot-ready.bundle" \
  --kernel-bindings "$WORK/kernel-bindings.json" \
  --prompt "$TEST_PROMPT" \
  --max-new-tokens "$MAX_NEW_TOKENS" --greedy \
  --output "$WORK/external.jsonl"
diff -u "$WORK/native.jsonl" "$WORK/external.jsonl"

"$TRTMC" run "$WORK/qwen3-native.bundle" \
  --prompt "$TEST_PROMPT" --max-new-tokens "$MAX_NEW_TOKENS" --greedy \
  --warmup 3 --benchmark 10 > "$WORK/native.perf.log" 2>&1
"$TRTMC" run "$WORK/qwen3-slot-ready.bundle" \
  --kernel-bindings "$WORK/kernel-bindings.json" \
  --prompt "$TEST_PROMPT" --max-new-tokens "$MAX_NEW_TOKENS" --greedy \
  --warmup 3 --benchmark 10 > "$WORK/external.perf.log" 2>&1
# The tutorial's check. Its 0.98 verdict depends on an idle machine; the caller decides what a
# CPU verdict means (TUTORIAL_PERF_VERDICT=report prints it and goes on).
python - "$WORK/native.perf.log" "$WORK/external.perf.log" <<'PY' || [ "${TUTORIAL_PERF_VERDICT:-strict}" = report ]
import re
import sys

def result(path):
    text = open(path, encoding="utf-8").read()
    matches = re.findall(
        r"generated_tokens_mean=([0-9.]+).*tokens_per_sec=([0-9.]+)", text
    )
    if not matches:
        raise SystemExit(f"{path}: benchmark result was not reported")
    generated_tokens, throughput = matches[-1]
    return float(generated_tokens), float(throughput)

native_tokens, native_throughput = result(sys.argv[1])
external_tokens, external_throughput = result(sys.argv[2])
print(f"native={native_throughput:.2f} external={external_throughput:.2f} tokens/s")
if external_tokens != native_tokens:
    raise SystemExit("FAIL: generated-token means differ")
if native_throughput <= 0 or external_throughput <= 0:
    raise SystemExit("FAIL: throughput must be positive")
ratio = external_throughput / native_throughput
if ratio < 0.98:
    raise SystemExit(f"FAIL: external/native throughput is {ratio:.4f}, below 0.98")
print(f"PASS: external/native throughput is {ratio:.4f}")
PY

# step 5: the attention recipe (our decode-attention kernel in place of the FlashInfer POC)
"$TRTMC" build "${BUILD_ARGS[@]}" \
  --recipe qwen.decode_attention_region@2 \
           decoder.layers.0.decode_attention \
  -o "$WORK/qwen3-attention-slot.bundle"
"$TRTMC" kernel build examples/byok/decode_attention.cu -o "$WORK/qwen3-decode-attention.so"
export ATTENTION_BINDING_ID=qwen.decode_attention_region@2
export ATTENTION_ABI_SHA256="$(
  python -c 'import json,sys; print(json.load(open(sys.argv[1]))["abi_sha256"])' \
    "$WORK/qwen3-attention-slot.selection.json"
)"
cat > "$WORK/attention-kernel-bindings.json" <<JSON
{
  "schema_version": 1,
  "bindings": [
    {
      "id": "$ATTENTION_BINDING_ID",
      "abi_sha256": "$ATTENTION_ABI_SHA256",
      "library": "./qwen3-decode-attention.so",
      "function": "run"
    }
  ]
}
JSON
"$TRTMC" run "$WORK/qwen3-attention-slot.bundle" \
  --kernel-bindings "$WORK/attention-kernel-bindings.json" \
  --prompt "Explain grouped-query attention in one sentence." \
  --max-new-tokens 32 \
  --greedy

# Level 2, step 6: inspect and circle raw nodes
"$TRTMC" graph inspect \
  --engine-role decode \
  --snapshot "$WORK/decode.graph.json" \
  "${BUILD_ARGS[@]}"
"$TRTMC" graph list "$WORK/decode.graph.json" \
  | tee "$WORK/decode.nodes.txt" \
  | tail -n 10
# the three nodes before the final `CAST -> logits`, copied from our own listing
read -r -a NODES <<<"$(python - "$WORK/decode.graph.json" <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))
out = {t["id"] for t in g["tensors"] if t["name"] == "logits"}
last = next(i for i, n in enumerate(g["nodes"]) if set(n["outputs"]) & out)
print(" ".join(n["id"] for n in g["nodes"][last - 3:last]))
PY
)"
export BINDING_ID=qwen3.decode.logits_copy.manual@1
"$TRTMC" graph select "$WORK/decode.graph.json" \
  --nodes "${NODES[@]}" \
  --binding-id "$BINDING_ID" \
  --workspace-bytes 0 \
  -o "$WORK/manual.selection.json"
"$TRTMC" graph select "$WORK/decode.graph.json" \
  --nodes "${NODES[@]}" \
  --binding-id "$BINDING_ID.extra" \
  --workspace-bytes 0 \
  --extra-arg '{"type":"int","value":32}' \
  --extra-arg '{"type":"float","value":0.5}' \
  -o "$WORK/manual-extra.selection.json"
"$TRTMC" build "${BUILD_ARGS[@]}" \
  --graph-patch "$WORK/manual.selection.json" \
  -o "$WORK/qwen3-manual-slot-ready.bundle"
MANUAL_ABI_SHA256="$(
  python -c 'import json,sys; print(json.load(open(sys.argv[1]))["abi_sha256"])' \
    "$WORK/manual.selection.json"
)"
cat > "$WORK/manual-kernel-bindings.json" <<JSON
{"schema_version": 1, "bindings": [{"id": "$BINDING_ID", "abi_sha256": "$MANUAL_ABI_SHA256",
  "library": "./kernel.so", "function": "run"}]}
JSON
"$TRTMC" run "$WORK/qwen3-manual-slot-ready.bundle" \
  --kernel-bindings "$WORK/manual-kernel-bindings.json" \
  --prompt "$TEST_PROMPT" --max-new-tokens "$MAX_NEW_TOKENS" --greedy \
  --output "$WORK/manual.jsonl"
diff -u "$WORK/native.jsonl" "$WORK/manual.jsonl"

# step 7: DistilBERT, manual selection, CuTe DSL kernel
export CUTE_REVISION=12040accade4e8a0f71eabdb258fecc2e7e948be
export CUTE_MODEL="${CUTE_MODEL:-distilbert/distilbert-base-uncased}"
export CUTE_WORK="$PWD/artifacts/distilbert-cutedsl"
export CUTE_BINDING_ID=distilbert.layer0.attention_residual_add.cutedsl@1
mkdir -p "$CUTE_WORK"
CUTE_BUILD_ARGS=(
  "$CUTE_MODEL"
  --model-revision "$CUTE_REVISION"
  --precision fp16
)
"$TRTMC" graph inspect \
  --engine-role decode \
  --snapshot "$CUTE_WORK/decode.graph.json" \
  "${CUTE_BUILD_ARGS[@]}"
"$TRTMC" graph list "$CUTE_WORK/decode.graph.json" \
  --match '*ElementWiseOperation.SUM*' \
  | tee "$CUTE_WORK/elementwise-sum.nodes.txt"
CUTE_NODE="$(grep -m1 'attention_residual' "$CUTE_WORK/elementwise-sum.nodes.txt" | awk '{print $1}')"
"$TRTMC" graph select "$CUTE_WORK/decode.graph.json" \
  --nodes "$CUTE_NODE" \
  --binding-id "$CUTE_BINDING_ID" \
  --workspace-bytes 0 \
  -o "$CUTE_WORK/residual-add.selection.json"
test ! -e "$CUTE_WORK/residual-add-cutedsl.so" || {
  echo "Choose a fresh CUTE_WORK; the exporter will not overwrite a DSO"
  exit 1
}
if python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  python examples/byok/export_cutedsl_residual_add.py \
    --snapshot "$CUTE_WORK/decode.graph.json" \
    --selection "$CUTE_WORK/residual-add.selection.json" \
    --output "$CUTE_WORK/residual-add-cutedsl.so"
else  # no GPU: the C++ residual add, same contract
  "$TRTMC" kernel build examples/byok/residual_add.cu -o "$CUTE_WORK/residual-add-cutedsl.so"
fi
"$TRTMC" build "${CUTE_BUILD_ARGS[@]}" \
  --graph-patch "$CUTE_WORK/residual-add.selection.json" \
  -o "$CUTE_WORK/distilbert-slot-ready.bundle"
"$TRTMC" build "${CUTE_BUILD_ARGS[@]}" \
  -o "$CUTE_WORK/distilbert-native.bundle"
CUTE_ABI_SHA256="$(
  python -c 'import json,sys; print(json.load(open(sys.argv[1]))["abi_sha256"])' \
    "$CUTE_WORK/residual-add.selection.json"
)"
cat > "$CUTE_WORK/kernel-bindings.json" <<JSON
{
  "schema_version": 1,
  "bindings": [
    {
      "id": "$CUTE_BINDING_ID",
      "abi_sha256": "$CUTE_ABI_SHA256",
      "library": "./residual-add-cutedsl.so",
      "function": "run"
    }
  ]
}
JSON
CUTE_PROMPT='The quick brown fox jumps over the lazy dog.'
"$TRTMC" embed "$CUTE_WORK/distilbert-native.bundle" \
  --prompt "$CUTE_PROMPT" \
  > "$CUTE_WORK/native.json" 2> "$CUTE_WORK/native.stderr"
"$TRTMC" embed "$CUTE_WORK/distilbert-slot-ready.bundle" \
  --kernel-bindings "$CUTE_WORK/kernel-bindings.json" \
  --prompt "$CUTE_PROMPT" \
  > "$CUTE_WORK/byok.json" 2> "$CUTE_WORK/byok.stderr"
python - "$CUTE_WORK/native.json" "$CUTE_WORK/byok.json" <<'PY'
import json
import math
import sys

with open(sys.argv[1], encoding="utf-8") as file:
    native = json.load(file)["embedding"]
with open(sys.argv[2], encoding="utf-8") as file:
    byok = json.load(file)["embedding"]
if not native or len(native) != len(byok):
    raise SystemExit("FAIL: embedding lengths differ")
max_abs = max(abs(a - b) for a, b in zip(native, byok))
denominator = math.sqrt(
    sum(value * value for value in native) * sum(value * value for value in byok)
)
cosine = sum(a * b for a, b in zip(native, byok)) / denominator
print(f"values={len(native)} max_abs={max_abs:.6g} cosine={cosine:.9f}")
if max_abs > 0.02 or cosine < 0.999:
    raise SystemExit("FAIL: numerical gate")
print("PASS: numerical gate")
PY
echo "TUTORIAL COMPLETE"
