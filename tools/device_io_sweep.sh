#!/usr/bin/env bash
# Runs the I/O concurrency sweep on the device machine (or anywhere) from a prebuilt
# bench binary, so the remote side needs no Rust toolchain.
#
# Here:   cargo bench --bench io_sweep --no-run --message-format=json \
#           | jq -r 'select(.executable != null and .target.name == "io_sweep") | .executable' \
#           | xargs -I{} cp {} .devbin/io_sweep
# There:  tools/device_io_sweep.sh PRESET LAYERS   (writes results under $OUT or ./io-sweep-out)
set -euo pipefail
preset=${1:-qwen3-next-80b-a3b}
layers=${2:-8}
out=${OUT:-io-sweep-out}
mkdir -p "$out"
export SLOTSTREAM_BENCH_DIR=${SLOTSTREAM_BENCH_DIR:-/tmp/io-sweep}
export SLOTSTREAM_BENCH_PRESETS=$preset SLOTSTREAM_BENCH_LAYERS=$layers
mkdir -p "$SLOTSTREAM_BENCH_DIR"
{
  echo "machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB RAM"
  df -h "$SLOTSTREAM_BENCH_DIR" | tail -1
  mount | grep -E " / " || true
} | tee "$out/machine-$preset.txt"
.devbin/io_sweep --bench 2>&1 | grep -v -E "^Benchmarking|^$" | tee "$out/log-$preset.txt" | tail -60
cp "$SLOTSTREAM_BENCH_DIR/io_sweep.md" "$out/io_sweep-$preset.md"
cp "$SLOTSTREAM_BENCH_DIR/io_sweep.json" "$out/io_sweep-$preset.json"
rm -rf "$SLOTSTREAM_BENCH_DIR"/"$preset"-*
