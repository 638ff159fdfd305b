#!/usr/bin/env bash
# The GPU peer baseline: llama.cpp's llama-bench (CUDA) against `slotstream bench --device
# gpu` (Vulkan) on the device machine, same shapes (Qwen3-Next-80B-A3B, LAYERS layers,
# random 4-bit weights, every weight resident), alternating ROUNDS times in one session.
# The device has no Rust toolchain and no network, so both engines travel from here:
#
#   here:  tools/peer_gpu.sh stage     # .peer/llama.cpp-src.tar.gz (pip sdist of
#                                      # llama-cpp-python 0.3.36, trimmed) and .devbin/slotstream
#   there: tools/peer_gpu.sh prepare   # unpacks llama.cpp, starts its CUDA build in the
#                                      # background, writes the synth checkpoint and the GGUF
#   there: tools/peer_gpu.sh run       # waits for the build, then the alternating rounds
#
# (`run` device calls carry .gl, .devbin and .peer; see the device README for .gl.) State
# lives in /tmp/peer on the device, so prepare and run may be separate calls on one warm
# machine. Environment: LAYERS (24), ROUNDS (2), PROMPTS (512,2048), TOKENS (160 decoded
# by slotstream, its first WARMUP=32 untimed; llama-bench decodes 128), ROUTING (`router`:
# slotstream routes with the checkpoint's random router, as llama.cpp does with the same
# router converted, its synthetic routing model set aside for the run; `synthetic`: with
# that model, whose routes are drawn on the host), BASELINE (a second slotstream binary,
# such as .devbin/slotstream-base with its commit in .devbin/commit-base, run after the
# first in each round: a change and its parent timed in one call). Results: $OUT (or
# /tmp/peer/out): each run's raw output and summary.md with both engines and their ratios.
set -euo pipefail
what=${1:?usage: peer_gpu.sh stage|prepare|run}
repo=$(cd "$(dirname "$0")/.." && pwd)
layers=${LAYERS:-24} rounds=${ROUNDS:-2} prompts=${PROMPTS:-512,2048}
tokens=${TOKENS:-160} warmup=${WARMUP:-32} routing=${ROUTING:-router} baseline=${BASELINE:-}
state=/tmp/peer
gguf=$state/qwen3next-$layers.gguf synth=$state/synth-$layers
model_file=$synth/synthetic_routing.json
bench=$state/llama.cpp/build/bin/llama-bench

stage() {
  cd "$repo"
  mkdir -p .peer .devbin
  if [ ! -f .peer/llama.cpp-src.tar.gz ]; then
    local tmp
    tmp=$(mktemp -d)
    python3 -m venv "$tmp/venv"
    "$tmp/venv/bin/pip" install -q scikit-build-core cmake ninja
    # llama-cpp-python 0.3.36 vendors a llama.cpp with the qwen3next architecture; its
    # source package is the pinned way to get that exact tree through pip.
    PATH=$tmp/venv/bin:$PATH "$tmp/venv/bin/pip" download -q --no-deps --no-binary :all: \
      --no-build-isolation llama-cpp-python==0.3.36 -d "$tmp"
    tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
    # What the CUDA build needs (about 7 MB): no other backends, docs, models or tests.
    (cd "$tmp/llama_cpp_python-0.3.36/vendor" && tar czf "$repo/.peer/llama.cpp-src.tar.gz" \
      --exclude='llama.cpp/.git*' --exclude=llama.cpp/docs --exclude=llama.cpp/models \
      --exclude=llama.cpp/tools/ui --exclude=llama.cpp/benches --exclude=llama.cpp/media \
      --exclude=llama.cpp/examples --exclude=llama.cpp/tests \
      --exclude='llama.cpp/ggml/src/ggml-'{sycl,cann,hexagon,opencl,openvino,musa,zdnn,zendnn,et,virtgpu} \
      llama.cpp)
    rm -rf "$tmp"
  fi
  cargo build --release --locked
  cp target/release/slotstream .devbin/ && strip .devbin/slotstream
  # The device gets no git history: the commit travels beside the binary.
  echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src wgsl Cargo.lock || echo -dirty)" > .devbin/commit
  ls -la .peer .devbin
}

prepare() {
  mkdir -p "$state"
  if [ ! -d "$state/llama.cpp" ]; then
    tar xzf "$repo/.peer/llama.cpp-src.tar.gz" -C "$state"
  fi
  if [ ! -x "$bench" ] && [ ! -f "$state/build.pid" ]; then
    # In its own session, so it outlives this call (about 6 minutes on 16 cores).
    (cd "$state/llama.cpp" && setsid nohup bash -c "cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build build --target llama-bench -j 14" \
      > "$state/build.log" 2>&1 < /dev/null & echo $! > "$state/build.pid")
  fi
  [ -f "$synth/config.json" ] || "$repo/.devbin/slotstream" synth --preset qwen3-next-80b-a3b \
    --layers "$layers" --out "$synth"
  [ -f "$gguf" ] || PYTHONPATH=$state/llama.cpp/gguf-py python3 "$repo/tools/make_gguf.py" "$gguf" "$layers"
  df -h /tmp | tail -1
}

run() {
  local out=${OUT:-$state/out}
  mkdir -p "$out"
  while [ ! -x "$bench" ]; do
    if ! kill -0 "$(cat "$state/build.pid")" 2>/dev/null; then
      tail -20 "$state/build.log"; echo "the llama.cpp build failed" >&2; exit 1
    fi
    sleep 5
  done
  for f in "$repo"/.gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json WGPU_BACKEND=vulkan
  export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$(mktemp -d)} RUST_LOG=${RUST_LOG:-warn}
  {
    echo "machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
    echo "slotstream: $(cat "$repo/.devbin/commit" 2>/dev/null || echo unknown commit) (Vulkan); llama.cpp: llama-cpp-python 0.3.36's tree, CUDA sm_90"
    echo "layers: $layers; rounds: $rounds; prompts: $prompts"
    [ -z "$baseline" ] || echo "baseline: $baseline, $(cat "$repo/.devbin/commit-base" 2>/dev/null || echo unknown commit)"
    echo "slotstream routing: $routing"
  } | tee "$out/machine.txt"
  case $routing in
    router)
      [ -f "$model_file" ] && mv "$model_file" "$model_file.aside"
      trap '[ -f "$model_file.aside" ] && mv "$model_file.aside" "$model_file"' EXIT ;;
    synthetic) [ -f "$model_file" ] || mv "$model_file.aside" "$model_file" ;;
    *) echo "ROUTING is router or synthetic, not $routing" >&2; exit 2 ;;
  esac
  for i in $(seq "$rounds"); do
    "$bench" -m "$gguf" -ngl 99 -p "$prompts" -n 128 -r 3 -o json > "$out/llama-$i.json"
    for p in ${prompts//,/ }; do
      for which in slotstream ${baseline:+baseline}; do
        local bin=$repo/.devbin/slotstream
        [ "$which" = slotstream ] || bin=$baseline
        "$bin" bench --model "$synth" --device gpu --budgets all --lookahead off \
          --prompt-len "$p" --tokens "$tokens" --warmup "$warmup" --json > "$out/$which-$i-$p.json"
      done
    done
  done
  python3 - "$out" "$rounds" "$prompts" "$baseline" <<'PY' | tee "$out/summary.md"
import json, sys
out, rounds, prompts = sys.argv[1], int(sys.argv[2]), [int(p) for p in sys.argv[3].split(",")]
runs = ["slotstream"] + (["baseline"] if sys.argv[4] else [])
print(open(f"{out}/machine.txt").read())
print("| round | what | llama.cpp tok/s | slotstream tok/s | ratio |")
print("|---:|---|---:|---:|---:|")
for i in range(1, rounds + 1):
    peer = json.load(open(f"{out}/llama-{i}.json"))
    pp = {r["n_prompt"]: r["avg_ts"] for r in peer if r["n_prompt"]}
    tg = next(r["avg_ts"] for r in peer if r["n_gen"])
    for p in prompts:
        for which in runs:
            ours = json.load(open(f"{out}/{which}-{i}-{p}.json"))["rows"][0]
            tag = "" if which == "slotstream" else " (baseline)"
            print(f"| {i} | prefill, {p}-token prompt{tag} | {pp[p]:.1f} | {ours['prefill_tps']:.1f} | {ours['prefill_tps'] / pp[p]:.2f} |")
            print(f"| {i} | decode after {p}{tag} | {tg:.1f} | {ours['decode_tps']:.1f} | {ours['decode_tps'] / tg:.2f} |")
PY
}

case $what in
  stage) stage ;;
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 stage|prepare|run" >&2; exit 2 ;;
esac
