#!/usr/bin/env bash
# The CPU peer baseline: llama.cpp's llama-bench against `slotstream bench --device cpu` on
# the same cores, same shapes (Qwen3-Next-80B-A3B, LAYERS layers, every weight resident),
# the two engines alternating ROUNDS times in one run so that a busy machine hurts both.
#
#   tools/peer_cpu.sh setup [DIR]   # llama.cpp source (pip sdist), llama-bench build, GGUF
#   tools/peer_cpu.sh run [DIR]     # synth checkpoint if missing, then the alternating runs
#
# DIR defaults to target/peer-cpu. Environment: LAYERS (4), ROUNDS (3), THREADS (2),
# SLOTSTREAM (target/release/slotstream). Results go to DIR/results-<commit>/: each run's
# raw output, and summary.md with both engines' figures per round and their ratios.
# Needs python3 with venv and pip, a C++ compiler; cmake, ninja and numpy come from pip.
set -euo pipefail
what=${1:?usage: peer_cpu.sh setup|run [DIR]}
dir=$(realpath -m "${2:-target/peer-cpu}")
repo=$(cd "$(dirname "$0")/.." && pwd)
layers=${LAYERS:-4} rounds=${ROUNDS:-3} threads=${THREADS:-2}
gguf=$dir/qwen3next-$layers.gguf synth=$dir/synth-qwen3-next-$layers
bench=$dir/llama.cpp/build/bin/llama-bench
mkdir -p "$dir"

setup() {
  cd "$dir"
  [ -x venv/bin/python ] || python3 -m venv venv
  venv/bin/pip install -q cmake ninja numpy pyyaml scikit-build-core
  export PATH=$dir/venv/bin:$PATH
  if [ ! -d llama.cpp ]; then
    # llama-cpp-python 0.3.36 vendors a llama.cpp with the qwen3next architecture; its
    # source package is the pinned, checksummed way to get that exact tree through pip.
    pip download -q --no-deps --no-binary :all: --no-build-isolation llama-cpp-python==0.3.36 -d sdist
    tar xzf sdist/llama_cpp_python-0.3.36.tar.gz -C sdist
    mv sdist/llama_cpp_python-0.3.36/vendor/llama.cpp llama.cpp
    rm -rf sdist
  fi
  if [ ! -x "$bench" ]; then
    # GGML_NATIVE: the instruction sets of this CPU (AVX2, AVX-512 where present), as
    # slotstream picks at run time.
    cmake -S llama.cpp -B llama.cpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON
    cmake --build llama.cpp/build --target llama-bench -j "$(nproc)"
  fi
  [ -f "$gguf" ] || PYTHONPATH=$dir/llama.cpp/gguf-py venv/bin/python "$repo/tools/make_gguf.py" "$gguf" "$layers"
}

case $what in
  setup) setup ;;
  *) echo "usage: $0 setup|run [DIR]" >&2; exit 2 ;;
esac
