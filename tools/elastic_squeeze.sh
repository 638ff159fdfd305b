#!/usr/bin/env bash
# The elastic pool following a squeeze (BENCHMARKS.md, "Elastic pool"): `slotstream
# generate` runs in a memory cgroup of LIMIT_GIB with a pool planned from the machine
# (--memory-limit caps the plan); once it decodes, a second process in the same cgroup
# takes memory in 64 MiB steps up to SQUEEZE_GIB, holds it HOLD_S seconds and frees it.
# Every 0.5 s a sample goes to OUT/samples.csv: seconds, the engine's RSS and peak RSS,
# the cgroup's charge, the squeezer's size (MiB) and the pool's slots (its last resize in
# the log). Needs root and a writable cgroup (v2 at /sys/fs/cgroup, or v1's memory
# controller at /sys/fs/cgroup/memory).
#
# Usage: tools/elastic_squeeze.sh BIN MODEL OUT [LIMIT_GIB] [MEMORY_LIMIT] [SQUEEZE_GIB] [HOLD_S]
set -euo pipefail
bin=$(realpath "$1"); model=$2; out=$3
limit_gib=${4:-5}; memory_limit=${5:-3.5GiB}; squeeze_gib=${6:-2.5}; hold_s=${7:-25}
mkdir -p "$out"
name=slotstream-squeeze-$$
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  cg=/sys/fs/cgroup/$name; mkdir "$cg"
  echo $((limit_gib << 30)) > "$cg/memory.max"; charge=$cg/memory.current
else
  cg=/sys/fs/cgroup/memory/$name; mkdir "$cg"
  echo $((limit_gib << 30)) > "$cg/memory.limit_in_bytes"; charge=$cg/memory.usage_in_bytes
fi
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  # The squeezer's python is a child of a subshell: whatever is left in the cgroup goes
  # too, or the cgroup cannot be removed.
  if [ -f "$cg/cgroup.procs" ]; then
    while read -r p; do kill "$p" 2>/dev/null || true; done < "$cg/cgroup.procs"
  fi
  sleep 1; rmdir "$cg" 2>/dev/null || true
}
trap cleanup EXIT

# The engine, in the cgroup.
sh -c "echo \$\$ > $cg/cgroup.procs; exec \"$bin\" generate -m \"$model\" -p 'Tell me a long story.' \
  --max-tokens 100000 --memory-limit $memory_limit --device cpu --stats" \
  > "$out/generate.out" 2> "$out/generate.log" &
engine=$!; pids+=("$engine")

# The squeezer, started once the engine decodes (its first resize-free seconds are the
# baseline), in the same cgroup.
squeezer() {
  python3 - "$cg/cgroup.procs" "$squeeze_gib" "$hold_s" "$out/squeezer.mib" <<'EOF'
import sys, time
procs, gib, hold, status = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
import os
open(procs, "w").write(str(os.getpid()))
bufs = []
def say(): open(status, "w").write(str(64 * len(bufs)))
while 64 * len(bufs) < gib * 1024:
    b = bytearray(64 << 20)
    for i in range(0, len(b), 4096): b[i] = 1
    bufs.append(b); say(); time.sleep(0.25)
time.sleep(hold)
bufs.clear(); say()
time.sleep(3600)
EOF
}
echo 0 > "$out/squeezer.mib"
start=$(date +%s.%N)
echo "seconds,rss_mib,peak_rss_mib,cgroup_mib,squeezer_mib,slots" > "$out/samples.csv"
squeezing=0
while kill -0 "$engine" 2>/dev/null; do
  now=$(date +%s.%N); t=$(echo "$now - $start" | bc)
  rss=$(awk '/^VmRSS/ {print int($2/1024)}' /proc/$engine/status 2>/dev/null || echo)
  hwm=$(awk '/^VmHWM/ {print int($2/1024)}' /proc/$engine/status 2>/dev/null || echo)
  slots=$(grep -oE 'elastic pool: [0-9]+ to [0-9]+ slots|elastic pool (shrank|grew) to [0-9]+ slots' "$out/generate.log" \
    | tail -1 | grep -oE '[0-9]+ slots' | grep -oE '[0-9]+' || true)
  echo "$t,$rss,$hwm,$(( $(cat $charge) >> 20 )),$(cat $out/squeezer.mib),$slots" >> "$out/samples.csv"
  if [ $squeezing = 0 ] && grep -q "elastic pool:" "$out/generate.log" && [ "$(echo "$t > 20" | bc)" = 1 ]; then
    squeezer & pids+=($!); squeezing=1
  fi
  # Done once the squeeze has come and gone and the pool has had time to grow back.
  if [ $squeezing = 1 ] && [ "$(echo "$t > 20 + $hold_s + 60" | bc)" = 1 ]; then
    kill -INT "$engine"; wait "$engine" || true; break
  fi
  sleep 0.5
done
grep -E "elastic pool|memory plan" "$out/generate.log" > "$out/resizes.log" || true
echo "samples: $out/samples.csv; resizes: $out/resizes.log"
