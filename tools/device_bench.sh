#!/usr/bin/env bash
# `slotstream bench` at real scale on the device machine (no Rust toolchain there), from
# a prebuilt release binary. Here:
#   cargo build --release && mkdir -p .devbin && cp target/release/slotstream .devbin/ && strip .devbin/slotstream
# There (with the Vulkan loader packages in .gl/, see the device README):
#   tools/device_bench.sh synth PRESET LAYERS [FLAGS]  # writes /tmp/bench-PRESET-LAYERS (FLAGS go to synth)
#   tools/device_bench.sh run PRESET LAYERS BUDGETS [TOKENS] [WARMUP] [LOOKAHEAD] [PROMPT_LEN]
# Results (table, JSON, machine) go to $OUT (or ./bench-out).
set -euo pipefail
what=$1 preset=$2 layers=$3
dir=/tmp/bench-$preset-$layers
out=${OUT:-bench-out}
mkdir -p "$out"
case $what in
  synth)
    df -h /tmp | tail -1
    rm -rf /tmp/bench-*  # one checkpoint at a time: the disk holds about 64 GB
    /usr/bin/time -v .devbin/slotstream synth --preset "$preset" --layers "$layers" --out "$dir" "${@:4}" 2>&1 \
      | grep -E "wrote|Elapsed|Maximum resident" | tee "$out/synth-$preset-$layers.txt"
    df -h /tmp | tail -1
    ;;
  run)
    budgets=$4 tokens=${5:-80} warmup=${6:-32} lookahead=${7:-on,off} prompt=${8:-64}
    for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json WGPU_BACKEND=vulkan
    export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$(mktemp -d)} RUST_LOG=${RUST_LOG:-slotstream=info}
    {
      echo "machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB RAM"
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      df -h /tmp | tail -1
    } | tee "$out/machine.txt"
    tag=$preset-$layers-$(echo "$budgets-$lookahead" | tr ',%' '_p')
    .devbin/slotstream bench --model "$dir" --device gpu --budgets "$budgets" --lookahead "$lookahead" \
      --tokens "$tokens" --warmup "$warmup" --prompt-len "$prompt" --json > "$out/bench-$tag.json" 2> "$out/log-$tag.txt"
    tail -5 "$out/log-$tag.txt"
    command -v python3 >/dev/null || exit 0
    python3 - "$out/bench-$tag.json" <<'EOF' | tee "$out/bench-$tag.md"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['model']} on {r['backend']}: {r['moe_layers']} MoE layers x {r['experts']} experts, records {r['record_bytes']} B, "
      f"active {r['active_bytes_per_token']/1e6:.1f} MB/token, memory reads {r['memory_read_bytes_per_second']/1e9:.1f} GB/s, copy {r['copy_bytes_per_second']/1e9:.1f} GB/s, "
      f"raw {r['raw_read_bytes_per_second']/1e9:.2f} GB/s ({r['raw_read_source']})")
print("| budget | slots | lookahead | prefill tok/s | decode tok/s | limit tok/s | of limit | hit rate | MB/token | wait | used/wasted | preload s | peak RSS GiB |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for x in r["rows"]:
    lim = x["limit_tps"]
    print(f"| {x['budget']} | {x['slots']} | {'on' if x['lookahead'] else 'off'} | {x['prefill_tps']:.1f} | {x['decode_tps']:.2f} | "
          f"{'-' if lim is None else f'{lim:.1f}'} ({x['limit_kind']}) | {'-' if lim is None else f'{x['decode_tps']/lim:.2f}'} | "
          f"{x['hit_rate']:.3f} | {x['mb_read_per_token']:.1f} | {100*x['wait_share']:.1f}% | {x['prefetches_used']}/{x['prefetches_wasted']} | "
          f"{x['preload_seconds']:.1f} | {(x['peak_rss'] or 0)/2**30:.1f} |")
for x in r["rows"]:
    n = x.get("ngram")
    if n:
        looks = n["row_hits"] + n["row_misses"]
        print(f"n-gram, {x['budget']} lookahead {'on' if x['lookahead'] else 'off'}: {looks} row lookups, "
              f"hit rate {n['row_hits']/max(looks,1):.3f}, {n['row_misses']} rows read, {n['bytes_read']/1e3/max(x['decode_tokens'],1):.1f} KB/token")
EOF
    ;;
  *)
    echo "usage: $0 synth|run PRESET LAYERS [BUDGETS [TOKENS [WARMUP]]]" >&2
    exit 2
    ;;
esac
