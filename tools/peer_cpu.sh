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

run() {
  local slot=${SLOTSTREAM:-$repo/target/release/slotstream}
  [ -x "$bench" ] && [ -f "$gguf" ] || { echo "no llama-bench or GGUF in $dir: run setup first" >&2; exit 1; }
  [ -x "$slot" ] || { echo "no $slot: cargo build --release first" >&2; exit 1; }
  [ -f "$synth/config.json" ] || "$slot" synth --preset qwen3-next-80b-a3b --layers "$layers" --out "$synth"
  local commit out
  commit=$(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD || echo -dirty)
  out=$dir/results-$commit
  mkdir -p "$out"
  {
    echo "machine: $(nproc) cores ($(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)), $(free -g | awk '/Mem/{print $2}') GiB"
    echo "slotstream: $commit; llama.cpp: llama-cpp-python 0.3.36's vendored tree, GGML_NATIVE"
    echo "threads: $threads each; layers: $layers; rounds: $rounds"
  } > "$out/machine.txt"
  for i in $(seq "$rounds"); do
    # The load average before each run shows whether others were using the machine.
    echo "round $i: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/machine.txt"
    "$bench" -m "$gguf" -t "$threads" -p 64 -n 16 -o json > "$out/llama-$i.json"
    RAYON_NUM_THREADS=$threads "$slot" bench --model "$synth" --device cpu --budgets all --json \
      > "$out/slotstream-$i.json" 2> "$out/slotstream-$i.log"
  done
  python3 - "$out" "$rounds" <<'PY' | tee "$out/summary.md"
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print(open(f"{out}/machine.txt").read())
print("| round | llama.cpp pp64 tok/s | slotstream prefill tok/s | ratio | llama.cpp tg16 tok/s | slotstream decode tok/s | ratio |")
print("|---:|---:|---:|---:|---:|---:|---:|")
ratios = {"prefill": [], "decode": []}
for i in range(1, rounds + 1):
    peer = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in json.load(open(f"{out}/llama-{i}.json"))}
    ours = json.load(open(f"{out}/slotstream-{i}.json"))["rows"][0]
    pre, dec = ours["prefill_tps"] / peer["pp"], ours["decode_tps"] / peer["tg"]
    ratios["prefill"].append(pre)
    ratios["decode"].append(dec)
    print(f"| {i} | {peer['pp']:.1f} | {ours['prefill_tps']:.1f} | {pre:.2f} | {peer['tg']:.1f} | {ours['decode_tps']:.1f} | {dec:.2f} |")
for k, v in ratios.items():
    print(f"\n{k} ratio: median {statistics.median(v):.2f}, range {min(v):.2f}-{max(v):.2f}", end="")
print()
PY
}

case $what in
  setup) setup ;;
  run) run ;;
  *) echo "usage: $0 setup|run [DIR]" >&2; exit 2 ;;
esac
