#!/usr/bin/env bash
# The GPU kit, in one call on the device (see bench/gpu/README.md):
#   [CALL_S=560] bench/gpu/run.sh OUT_DIR [--bundle DIR] [--cpu] [--installed] [--bin DIR] [-- kit.py flags]
# 1. builds llama.cpp from the bundle (CUDA unless --cpu) as shared libraries plus llama-server,
#    llama-batched-bench and llama-quantize, in the background, polling its progress: if the build is not
#    done by DEADLINE_S (default 480 s) the script says so and exits 75; the same command then resumes;
# 2. installs the bundle's wheels into a target dir, and points the bindings at the build's libllama.so
#    (LLAMA_CPP_LIB_PATH): nothing is compiled twice;
# 3. runs bench/gpu/kit.py: synth model, Table 2 and variants, batched-bench, serving comparisons, host overhead;
#    with CALL_S set, kit.py stops by CALL_S seconds after this script started (exit 75) and, sent again,
#    resumes at the step it stopped in.
# --installed: no build, no install; use this checkout's .venv and its llama-cpp-python (the CPU dry run),
# and llama.cpp tools from --bin if given.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bench/gpu/run.sh OUT_DIR [--bundle DIR] [--cpu] [--installed] [--bin DIR] [-- kit.py flags]}
shift
BUNDLE=gpu_bundle CPU=0 INSTALLED=0 BIN=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) BUNDLE=$2; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --installed) INSTALLED=1; shift ;;
    --bin) BIN=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "run.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
WORK=${COBALI_GPU_WORK:-/tmp/cobali-gpu}
DEADLINE_S=${DEADLINE_S:-480}
mkdir -p "$WORK" "$OUT"
KIT=()

build_llama() {  # background build, polled; returns 0 when the four targets exist
  local build="$WORK/build" log="$WORK/build.log"
  if [ -f "$build/.done" ]; then return 0; fi
  if [ ! -d "$WORK/llama.cpp" ]; then tar xzf "$BUNDLE/llama.cpp.tar.gz" -C "$WORK"; fi
  if ! { [ -f "$WORK/build.pid" ] && kill -0 "$(cat "$WORK/build.pid")" 2>/dev/null; }; then
    local flags="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-native}"
    [ "$CPU" = 1 ] && flags="-DGGML_NATIVE=on"
    echo "building llama.cpp ($flags) in the background; log: $log"
    # setsid: the build outlives this command if the deadline cuts it, and the next call picks it up.
    setsid bash -c "cmake -S '$WORK/llama.cpp' -B '$build' -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF $flags \
      && cmake --build '$build' -j$(nproc) --target llama llama-server llama-batched-bench llama-quantize \
      && touch '$build/.done'" >"$log" 2>&1 </dev/null &
    echo $! >"$WORK/build.pid"
  fi
  while [ ! -f "$build/.done" ]; do
    if ! kill -0 "$(cat "$WORK/build.pid")" 2>/dev/null; then
      [ -f "$build/.done" ] && break
      tail -30 "$log" >&2; echo "llama.cpp build failed (log: $log)" >&2; return 1
    fi
    if [ "$SECONDS" -ge "$DEADLINE_S" ]; then
      echo "llama.cpp build still running after ${SECONDS}s: run the same command again to continue" >&2
      return 75
    fi
    sleep 10
    echo "[${SECONDS}s] $(grep -o '^\[[0-9]*/[0-9]*\]' "$log" | tail -1)"
  done
}

if [ "$INSTALLED" = 1 ]; then
  PY=${PY:-.venv/bin/python}
  [ -n "$BIN" ] && KIT+=(--bin "$BIN")
else
  build_llama || exit $?
  BIN="$WORK/build/bin"
  if [ ! -f "$WORK/site/.done" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$BUNDLE"/wheels/*.whl
    cp -r "$BUNDLE/python/llama_cpp" "$WORK/site/"
    touch "$WORK/site/.done"
  fi
  export PYTHONPATH="$WORK/site" LLAMA_CPP_LIB_PATH="$BIN" LD_LIBRARY_PATH="$BIN:${LD_LIBRARY_PATH:-}"
  # The CUDA 13 build's libggml-cuda.so exports its own copies of libstdc++'s locale facets; once numpy has
  # loaded libstdc++ first, libllama's std::regex (the BPE pre-tokenizer) mixes the two and segfaults while
  # loading the vocab (seen on the H100, 2026-11-24). Preloading the system libstdc++ makes one copy win.
  LD_PRELOAD="$(python3 -c 'import ctypes.util; print(ctypes.util.find_library("stdc++") or "")')${LD_PRELOAD:+:$LD_PRELOAD}"
  export LD_PRELOAD
  PY=python3
  KIT+=(--bin "$BIN" --tokenizer "$BUNDLE/tokenizer.gguf")
fi
[ "$CPU" = 1 ] && KIT+=(--n-gpu-layers 0)
if [ "${CALL_S:-0}" -gt 0 ]; then  # the device's limit per call: stop in time, and resume when sent again
  left=$((CALL_S - SECONDS))
  if [ "$left" -lt 30 ]; then echo "${SECONDS}s used of CALL_S=$CALL_S: run the same command again" >&2; exit 75; fi
  KIT+=(--deadline-s "$left")
fi
"$PY" bench/gpu/kit.py --out "$OUT" --work "$WORK" "${KIT[@]}" "$@"
