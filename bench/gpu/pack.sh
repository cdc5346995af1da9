#!/usr/bin/env bash
# Make the GPU kit's bundle: everything `bench/gpu/run.sh` needs on a machine that reaches no registry.
#   bench/gpu/pack.sh [BUNDLE_DIR]        (default: gpu_bundle/, ignored by git; well under 60 MiB)
# - llama.cpp.tar.gz: the llama.cpp vendored in the llama-cpp-python sdist cobali is built against,
#   trimmed (no docs, models, tests, UI sources, or backends other than CPU and CUDA);
# - python/llama_cpp: the sdist's bindings, pure-Python ctypes: they load the CUDA build's libllama.so
#   through LLAMA_CPP_LIB_PATH, so nothing is compiled twice;
# - wheels/: cobali and its dependencies for CPython 3.12 manylinux x86_64, less those the GPU image
#   already has (SKIP_WHEELS);
# - tokenizer.gguf: the embedded model's tokenizer alone, for `cobali synth-model --tokenizer`.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUNDLE=${1:-gpu_bundle}
LLAMA_VERSION=0.3.36
SDIST_CACHE=${COBALI_SDIST_CACHE:-$HOME/.cache/cobali/sdist}
PY=${PY:-.venv/bin/python}
# In the GPU image already (bench/gpu/README.md): carrying them would only spend the 64 MiB.
SKIP_WHEELS=${SKIP_WHEELS:-"numpy matplotlib pillow fonttools contourpy kiwisolver pyparsing cycler python_dateutil six
  packaging jinja2 markupsafe pyyaml requests urllib3 idna certifi charset_normalizer tqdm httpx httpcore anyio h11
  sniffio click typing_extensions prometheus_client attrs"}

sdist="$SDIST_CACHE/llama_cpp_python-$LLAMA_VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
  mkdir -p "$SDIST_CACHE"
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_VERSION" -d "$SDIST_CACHE"
fi

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/python" "$BUNDLE/wheels"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar xzf "$sdist" -C "$tmp"
src="$tmp/llama_cpp_python-$LLAMA_VERSION"
cp -r "$src/llama_cpp" "$BUNDLE/python/"
rm -rf "$BUNDLE/python/llama_cpp/lib" "$BUNDLE/python/llama_cpp/server"

llama="$src/vendor/llama.cpp"
rm -rf "$llama"/{docs,models,media,tests,benches,examples,gguf-py,conversion,.github,pocs,app,ci} \
  "$llama"/tools/ui/{src,tests,static} "$llama"/tools/*/tests "$llama"/tools/server/bench
for backend in vulkan sycl opencl hexagon metal et openvino webgpu cann virtgpu zdnn musa blas kompute rpc zendnn; do
  rm -rf "$llama/ggml/src/ggml-$backend"
done
# The root CMakeLists adds examples/ and tests/ only when asked; keep them as empty projects anyway.
mkdir -p "$llama/examples" "$llama/tests"
touch "$llama/examples/CMakeLists.txt" "$llama/tests/CMakeLists.txt"
tar czf "$BUNDLE/llama.cpp.tar.gz" -C "$src/vendor" llama.cpp

"$PY" -m pip wheel -q --no-deps -w "$BUNDLE/wheels" . 2>&1 | grep -v "is ignored" >&2 || true
# The versions this checkout's venv runs its tests with.
"$PY" -m pip freeze --exclude-editable | grep -v "^llama.cpp.python" >"$tmp/constraints.txt"
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
  --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -c "$tmp/constraints.txt" -d "$BUNDLE/wheels" fastapi uvicorn pydantic gguf diskcache jsonschema 2>&1 \
  | grep -v "is ignored" >&2 || true
for name in $SKIP_WHEELS; do
  rm -f "$BUNDLE"/wheels/"$name"-[0-9]*.whl
done

"$PY" - "$BUNDLE/tokenizer.gguf" <<'PY'
import sys
from cobali.backends.embedded_model import embedded_model_path
from cobali.faces.synth_model import write_tokenizer
write_tokenizer(embedded_model_path(), sys.argv[1])
PY
ls "$BUNDLE/wheels" >&2
du -sh "$BUNDLE" >&2
echo "$BUNDLE"
