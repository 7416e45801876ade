#!/usr/bin/env bash
# Build the llama.cpp peer of `archserve bench --peer llama.cpp` from source: llama.cpp's
# shared library and llama-server with GGML_NATIVE=ON (this CPU's ISA), and
# llama-cpp-python over that library. CI does not run this; it takes several minutes.
#
#   bash benchmarks/build_llama_cpp_peer.sh [DIR]      # default DIR: ~/.cache/archserve/llama_cpp
#   export PYTHONPATH=DIR/site:$PYTHONPATH LLAMA_CPP_LIB_PATH=DIR/build/bin
#   archserve bench --peer llama.cpp ...
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DIR=${1:-${ARCHSERVE_CACHE_DIR:-$HOME/.cache/archserve}/llama_cpp}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$DIR"
cd "$DIR"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  python3 -m pip download --no-deps --no-binary :all: -d . "llama-cpp-python==$VERSION"
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$DIR/llama_cpp_python-$VERSION"
cmake -S "$SRC/vendor/llama.cpp" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
cmake --build build -j "$JOBS" --target llama llama-server
# The Python bindings are ctypes over the library (LLAMA_CPP_LIB_PATH names ours): their
# package is copied as it is, so no build backend has to be fetched; diskcache is the one
# dependency they import that archserve's install does not bring.
rm -rf "$DIR/site/llama_cpp"
mkdir -p "$DIR/site"
cp -r "$SRC/llama_cpp" "$DIR/site/"
python3 -m pip install --no-deps --target "$DIR/site" diskcache
echo "export PYTHONPATH=$DIR/site:\${PYTHONPATH:-} LLAMA_CPP_LIB_PATH=$DIR/build/bin"
