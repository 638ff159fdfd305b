#!/usr/bin/env bash
# GPU checks and kernel benchmarks on the device machine, from prebuilt binaries (the
# device has no Rust toolchain). Build and stage them here first:
#   tools/device_gpu.sh --stage      # cargo build of test and bench binaries into .devbin/
# then on the device (with the Vulkan loader packages in .gl/, see the device README):
#   tools/device_gpu.sh              # runs the GPU test binary, then the kernel bench
set -uo pipefail
if [ "${1:-}" = "--stage" ]; then
  set -e
  mkdir -p .devbin
  exe=$(cargo test --release --test gpu --no-run --message-format=json 2>/dev/null \
    | jq -r 'select(.executable != null and .target.name == "gpu") | .executable' | tail -1)
  cp "$exe" .devbin/gpu && strip .devbin/gpu
  exe=$(cargo bench --bench gpu_kernels --no-run --message-format=json 2>/dev/null \
    | jq -r 'select(.executable != null and .target.name == "gpu_kernels") | .executable' | tail -1)
  cp "$exe" .devbin/gpu_kernels && strip .devbin/gpu_kernels
  ls -la .devbin
  exit 0
fi
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export WGPU_BACKEND=vulkan CARGO_MANIFEST_DIR=$PWD
out=${OUT:-gpu-out}
mkdir -p "$out" target
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
status=0
echo "== GPU tests"
.devbin/gpu --test-threads=1 2>&1 | grep -v XDG_RUNTIME | tee "$out/test-gpu.txt" | grep -E "^test |test result" || status=1
echo "== gpu_kernels bench"
.devbin/gpu_kernels --bench 2>&1 | grep -v -E "^Benchmarking|^$|XDG" | tee "$out/bench.txt" | tail -12
cp target/gpu_kernels.md "$out/" 2>/dev/null
exit $status
