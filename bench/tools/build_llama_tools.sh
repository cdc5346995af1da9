#!/usr/bin/env bash
# Build llama.cpp's own llama-batched-bench and llama-server from the llama.cpp vendored in the
# llama-cpp-python sdist we build against, into a cache outside the repo. Prints the bin directory.
set -euo pipefail
LLAMA_VERSION=0.3.36
CACHE=${COBALI_LLAMA_TOOLS:-$HOME/.cache/cobali/llama.cpp}
if [ ! -x "$CACHE/build/bin/llama-server" ] || [ ! -x "$CACHE/build/bin/llama-batched-bench" ]; then
  mkdir -p "$CACHE"
  if [ ! -d "$CACHE/src" ]; then
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_VERSION" -d "$tmp" >&2
    tar xzf "$tmp"/llama_cpp_python-$LLAMA_VERSION.tar.gz -C "$tmp"
    mv "$tmp/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp" "$CACHE/src"
    rm -rf "$tmp"
  fi
  cmake -S "$CACHE/src" -B "$CACHE/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF ${CMAKE_ARGS:-} >&2
  cmake --build "$CACHE/build" -j"$(nproc)" --target llama-batched-bench llama-server >&2
fi
echo "$CACHE/build/bin"
