#!/usr/bin/env bash
# Binaries of slotstream timed against each other on the device machine, in one call:
# the GPU test binary, the kernel bench of each variant, then `slotstream bench` of each
# binary in turn (decode and prefill, 24 layers of Qwen3-Next-80B-A3B shapes, every weight
# resident, routing with the checkpoint's router), ROUNDS times; optionally llama.cpp
# beside them (tools/peer_gpu.sh). Here, stage xz-compressed binaries in .devbin/ (the
# carry limit is 64 MiB):
#   cargo build --release && cp target/release/slotstream .devbin/slotstream-NAME && strip ...
#   tools/device_gpu.sh --stage && mv .devbin/gpu_kernels .devbin/gpu_kernels-NAME
#   xz -T2 -6 .devbin/slotstream-NAME .devbin/gpu_kernels-NAME .devbin/gpu
# There (carry .gl, .devbin, .peer):
#   DEST=$OUT MAIN=NAME KB="NAME ..." BINS="base NAME NAME:ENV=VALUE ..." tools/device_ab.sh
# MAIN: the binary that writes the checkpoint (and runs beside llama.cpp with PEER=1, the
# baseline being slotstream-base); KB: kernel benches to run; BINS: binaries to alternate,
# each optionally with environment settings after a colon; ROUNDS (2), PROMPT (512),
# TOKENS (64); SYNTH_ONLY=1 writes the checkpoint without starting the llama.cpp build.
# Results go to $DEST/ab.tgz (ab.txt: one line per run, binary, round, prefill and decode
# tok/s).
set -u
dest=${DEST:?DEST: where the results go}
out=$(mktemp -d)
(cd .devbin && for f in *.xz; do xz -d -k -f "$f"; done && chmod +x ./*)
cp ".devbin/slotstream-${MAIN:?MAIN: the binary that writes the checkpoint}" .devbin/slotstream
if [ -n "${SYNTH_ONLY:-}" ]; then
  (.devbin/slotstream synth --preset qwen3-next-80b-a3b --layers 24 --out /tmp/peer/synth-24 \
    > "$out/prepare.txt" 2>&1; echo prepared >> "$out/prepare.txt") &
else
  (LAYERS=24 tools/peer_gpu.sh prepare > "$out/prepare.txt" 2>&1; echo prepared >> "$out/prepare.txt") &
fi
prep=$!
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json WGPU_BACKEND=vulkan
export XDG_RUNTIME_DIR=/tmp CARGO_MANIFEST_DIR=$PWD RUST_LOG=warn
mkdir -p target
if [ -x .devbin/gpu ]; then
  .devbin/gpu --test-threads=1 2>&1 | grep -E "^test |result|panicked|assert" > "$out/test.txt"
  tail -2 "$out/test.txt"
fi
for kb in ${KB:-}; do
  ".devbin/gpu_kernels-$kb" --bench 2>&1 | grep -E "^\|" > "$out/kbench-$kb.txt"
done
wait $prep; tail -2 "$out/prepare.txt"
model=/tmp/peer/synth-24 routing=/tmp/peer/synth-24/synthetic_routing.json
[ -f $routing ] && mv $routing $routing.aside
for r in $(seq "${ROUNDS:-2}"); do
  for spec in ${BINS:-base $MAIN}; do
    bin=${spec%%:*} envs=""
    [ "$spec" = "$bin" ] || envs=${spec#*:}
    tag=$(echo "$spec" | tr ':=' '__')
    # shellcheck disable=SC2086 # envs is a list of settings
    env $envs ".devbin/slotstream-$bin" bench --model $model --device gpu --budgets all --lookahead off \
      --prompt-len "${PROMPT:-512}" --tokens "${TOKENS:-64}" --warmup 8 --json \
      > "$out/$tag-$r.json" 2> "$out/$tag-$r.err"
    python3 -c "import json; r = json.load(open('$out/$tag-$r.json'))['rows'][0]; \
print('$spec', $r, round(r['prefill_tps'], 1), round(r['decode_tps'], 1))" | tee -a "$out/ab.txt"
  done
done
[ -f $routing.aside ] && mv $routing.aside $routing
if [ -n "${PEER:-}" ]; then
  LAYERS=24 ROUNDS=1 PROMPTS=512 TOKENS=96 WARMUP=16 BASELINE=.devbin/slotstream-base OUT=$out/peer \
    tools/peer_gpu.sh run 2>&1 | tail -8
fi
mkdir -p "$dest" && tar czf "$dest/ab.tgz" -C "$out" .
