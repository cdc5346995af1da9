#!/usr/bin/env bash
# cobali serve vs llama.cpp's own llama-server on the same model, threads, slots, context per slot, workload
# and client.
#   bench/serving/vs_llama_server.sh [WORKLOAD] [-- extra cobali serve flags]
# llama-server is built from the llama.cpp vendored in the llama-cpp-python sdist, into a cache outside
# the repo (bench/tools/build_llama_tools.sh). Both servers run on 127.0.0.1, driven by `cobali bench serve`
# (streaming /v1/completions, ignore_eos so output lengths match), then stopped.
#
# RATES set (the default): both servers stay up and one `cobali bench serve --sweep` runs them in turn (within
# every repeat) at every Poisson rate, then searches each one's capacity under SLO (TTFT p99 <= 5 s, TPOT p99 <= 150 ms):
# the table, capacities, sweep.json and one plot per metric against rate land in $OUT/sweep.
# RATES= (empty): the closed-loop comparison instead, CONCURRENCY requests in flight, one server at a time.
# A full sweep (3 rates, REPEAT=2, 2 bisections, both servers) takes about an hour of both CPU cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORKLOAD=${1:-workloads/mixed_length.json}
shift $(( $# > 0 ? 1 : 0 ))
[ "${1:-}" = "--" ] && shift
SLOTS=${SLOTS:-16}
THREADS=${THREADS:-2}
CONCURRENCY=${CONCURRENCY:-64}
CTX_PER_SLOT=${CTX_PER_SLOT:-2048}
CTX=$((SLOTS * CTX_PER_SLOT))
RATES=${RATES-0.2,0.35,0.5}
NUM_PROMPTS=${NUM_PROMPTS:-48}
GOODPUT=${GOODPUT:-ttft:5000,tpot:150}
CAPACITY_STEPS=${CAPACITY_STEPS:-2}
REPEAT=${REPEAT:-2}  # runs per rate, each on its own arrival pattern: medians, with the noise beside them
PORT_LLAMA=${PORT_LLAMA:-8091}
PORT_COBALI=${PORT_COBALI:-8092}
OUT=${OUT:-results/vs_llama_server}
MODEL=$(.venv/bin/python -c 'from cobali.backends.embedded_model import embedded_model_path; print(embedded_model_path())')
# Both servers repack the weights, or neither: cobali's choice for this model and CPU unless REPACK is set
# (--repack or --no-repack, passed to both).
REPACK=${REPACK:-$(.venv/bin/python -c 'import sys; from cobali.backends.llama_cpp.loading import repack_flag
print(repack_flag(sys.argv[1]))' "$MODEL")}
BIN=$(bench/tools/build_llama_tools.sh)
mkdir -p "$OUT"

wait_healthy() {
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server on port $1 did not become healthy" >&2
  return 1
}

run_client() {  # name port
  .venv/bin/cobali bench serve --url "http://127.0.0.1:$2" --prompts "$WORKLOAD" \
    --concurrency "$CONCURRENCY" --out "$OUT/$1" | tee "$OUT/$1.txt"
}

start_llama_server() {
  # --no-kv-unified: one KV stream of CTX_PER_SLOT cells per slot, as cobali's default layout.
  "$BIN/llama-server" -m "$MODEL" -np "$SLOTS" -c "$CTX" --no-kv-unified -t "$THREADS" -tb "$THREADS" \
    -b 512 -ub 512 "$REPACK" --host 127.0.0.1 --port "$PORT_LLAMA" >"$OUT/llama-server.log" 2>&1 &
  llama_pid=$!
  wait_healthy "$PORT_LLAMA"
  grep -o "n_ctx_slot = [0-9]*" "$OUT/llama-server.log" | head -1 >&2 || true
}

start_cobali() {
  .venv/bin/cobali serve --max-slots "$SLOTS" --ctx "$CTX" --threads "$THREADS" --port "$PORT_COBALI" "$REPACK" "$@" \
    >"$OUT/cobali.log" 2>&1 &
  cobali_pid=$!
  wait_healthy "$PORT_COBALI"
}

llama_pid= cobali_pid=
trap 'kill $llama_pid $cobali_pid 2>/dev/null || true' EXIT

if [ -n "$RATES" ]; then
  start_llama_server
  start_cobali "$@"
  .venv/bin/cobali bench serve --url "llama-server=http://127.0.0.1:$PORT_LLAMA" \
    --url "cobali=http://127.0.0.1:$PORT_COBALI" --prompts "$WORKLOAD" --num-prompts "$NUM_PROMPTS" \
    --sweep "$RATES" --goodput "$GOODPUT" --capacity-steps "$CAPACITY_STEPS" --repeat "$REPEAT" \
    --out "$OUT/sweep" \
    | tee "$OUT/sweep.txt"
  exit 0
fi

start_llama_server
run_client llama-server "$PORT_LLAMA"
kill "$llama_pid"; wait "$llama_pid" 2>/dev/null || true

start_cobali "$@"
run_client cobali "$PORT_COBALI"
kill "$cobali_pid"; wait "$cobali_pid" 2>/dev/null || true

.venv/bin/python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
load = lambda name: json.load(open(f"{out}/{name}/summary.json"))["runs"][0]
ours, theirs = load("cobali"), load("llama-server")
print(f"{'metric':<16}{'cobali':>12}{'llama-server':>14}{'ratio':>8}")
for key in ("wall_s", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2el_p50_ms"):
    a, b = ours.get(key), theirs.get(key)
    if a is not None and b:
        print(f"{key:<16}{a:>12.1f}{b:>14.1f}{a / b:>8.2f}")
PY
