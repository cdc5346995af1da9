#!/usr/bin/env bash
# The fidelity matrix of docs/results.md ("Output fidelity"): `cobali bench fidelity` for four candidate configurations on two workloads.
#   [THREADS=N] bench/engine/fidelity_matrix.sh [OUT_DIR]      (default results/fidelity; ~15-25 min on 2 quiet cores)
# THREADS=1 keeps llama.cpp fast on a busy machine (its spinning thread pool collapses when cores are shared).
# NUM_PROMPTS=N (default all) and MAX_NEW=N (default 32) shrink it: `THREADS=1 NUM_PROMPTS=2 MAX_NEW=2` is CI's run.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-results/fidelity}
COBALI=${COBALI:-.venv/bin/cobali}
declare -A CONFIGS=(
  [cont16-chunk256]="--max-slots 16 --prefill-chunk-tokens 256"
  [cont4-chunk32]="--max-slots 4 --prefill-chunk-tokens 32"
  [preempt]="--max-slots 16 --prefill-chunk-tokens 256 --kv-unified --kv-admission optimistic --ctx CTX"
  # 8 slots: later requests find the system prompt in the KV of earlier ones (16 would start all of prompts_16 at once).
  [prefix-cache]="--max-slots 8 --prefill-chunk-tokens 256 --system-prompt-file workloads/system_prompt.txt"
)
# The tiny context of the preemption run: room for the longest request alone, far less than all at once.
declare -A TINY_CTX=([prompts_16]=1024 [mixed_length]=2048)
declare -A PROMPTS=([prompts_16]=workloads/prompts_16.txt [mixed_length]=workloads/mixed_length.json)
status=0
for workload in prompts_16 mixed_length; do
  for name in cont16-chunk256 cont4-chunk32 preempt prefix-cache; do
    flags=${CONFIGS[$name]//CTX/${TINY_CTX[$workload]}}
    echo "== $workload / $name: $flags"
    # shellcheck disable=SC2086
    "$COBALI" bench fidelity --prompts "${PROMPTS[$workload]}" ${NUM_PROMPTS:+--num-prompts "$NUM_PROMPTS"} \
      --max-new "${MAX_NEW:-32}" --threads "${THREADS:-0}" $flags --out "$OUT/$workload-$name" || status=1
  done
done
exit $status
