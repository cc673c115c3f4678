cd /work/main
S=examples/pipelines/minilm_residual_add.json
A=artifacts/pipelines/qwen3_decode_attention
P="Explain grouped-query attention in one sentence."
echo "# $(date -u +%F) $(nproc) cores; new = HEAD $(git rev-parse --short HEAD) (kernel host), old = 6049f4b (kernel in the gate's worker)"
for i in 1 2 3; do for t in new old; do d=.; [ $t = old ] && d=.old
  rm -f $d/artifacts/pipelines/minilm_residual_add/reports/*
  (cd $d && PYTHONPATH=$PWD timeout 600 python3 -m doit spec=$S correctness perf 2>&1 | grep -E "^(correctness|perf):|gate (pass|fail|inconclusive)" | cut -c1-160 | sed "s/^/$t $i doit /")
  (cd $d && PYTHONPATH=$PWD timeout 300 python3 -m pipeline.cli run $A/slot.bundle --kernel-bindings $A/kernel/bindings.json --device cpu --prompt "$P" --max-new-tokens 32 --greedy --warmup 2 --benchmark 10 2>/dev/null | sed "s/^/$t $i run /")
done; done
