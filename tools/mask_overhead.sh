#!/usr/bin/env bash
# The grammar mask's overhead at the Qwen3 vocabulary (151,936 ids): `generate` with and
# without `--json-schema`, alternating ROUNDS times in one run on the same cores, on a
# synthetic checkpoint of Qwen3-Next-80B shapes (LAYERS layers, every weight resident)
# that carries the real Qwen3 tokenizer (tests/fixtures/qwen3-chat), since llguidance's
# token trie, and so the mask's cost, comes from the vocabulary.
#
#   tools/mask_overhead.sh [DIR]     # DIR defaults to target/mask-overhead
#
# Environment: LAYERS (4), ROUNDS (3), TOKENS (128), THREADS (2), SLOTSTREAM
# (target/release/slotstream). The schema (DIR/schema.json) asks for 50 or more records of
# bounded strings, an enum, bounded integers and short arrays, so that 128 tokens of the
# random model's sampling stay inside it and cross every kind of JSON state. Results go to
# DIR/results-<commit>/: each run's JSON, and summary.md with decode tok/s of both, their
# ratio, and the masks' milliseconds a token (computed, and not hidden behind the forward
# pass) from `--stats`.
set -euo pipefail
dir=$(realpath -m "${1:-target/mask-overhead}")
repo=$(cd "$(dirname "$0")/.." && pwd)
layers=${LAYERS:-4} rounds=${ROUNDS:-3} tokens=${TOKENS:-128} threads=${THREADS:-2}
slot=${SLOTSTREAM:-$repo/target/release/slotstream}
model=$dir/qwen3-next-$layers-qwen3-tokenizer
[ -x "$slot" ] || { echo "no $slot: cargo build --release first" >&2; exit 1; }
mkdir -p "$dir"
if [ ! -f "$model/config.json" ]; then
  "$slot" synth --preset qwen3-next-80b-a3b --layers "$layers" --out "$model"
  gzip -dc "$repo/tests/fixtures/qwen3-chat/tokenizer.json.gz" > "$model/tokenizer.json"
  cp "$repo/tests/fixtures/qwen3-chat/tokenizer_config.json" "$model/"
fi
cat > "$dir/schema.json" <<'JSON'
{"type": "object", "additionalProperties": false, "required": ["records"],
 "properties": {"records": {"type": "array", "minItems": 50, "items": {
   "type": "object", "additionalProperties": false, "required": ["name", "kind", "count", "tags"],
   "properties": {
     "name": {"type": "string", "maxLength": 24},
     "kind": {"enum": ["expert", "router", "slot", "pool"]},
     "count": {"type": "integer", "minimum": 0, "maximum": 100000},
     "score": {"type": "number"},
     "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}}}}}
JSON
commit=$(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD || echo -dirty)
out=$dir/results-$commit
mkdir -p "$out"
{
  echo "machine: $(nproc) cores ($(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)), $(free -g | awk '/Mem/{print $2}') GiB"
  echo "slotstream: $commit; layers: $layers; tokens: $tokens; threads: $threads; rounds: $rounds"
} > "$out/machine.txt"
run() { # NAME [FLAGS...]: one generate, its JSON (stats included) to NAME.json
  local name=$1
  shift
  RAYON_NUM_THREADS=$threads "$slot" generate --model "$model" --device cpu --temp 1 --seed 7 \
    --think off -n "$tokens" --json "$@" --prompt "List the records as JSON." > "$out/$name.json" 2> "$out/$name.log"
}
for i in $(seq "$rounds"); do
  echo "round $i: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/machine.txt"
  run "plain-$i"
  run "schema-$i" --json-schema "$dir/schema.json"
done
python3 - "$out" "$rounds" <<'PY' | tee "$out/summary.md"
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print(open(f"{out}/machine.txt").read())
print("| round | plain decode tok/s | with schema tok/s | ratio | masks ms/token | not hidden ms/token | share of the step |")
print("|---:|---:|---:|---:|---:|---:|---:|")
shares = []
for i in range(1, rounds + 1):
    plain = json.load(open(f"{out}/plain-{i}.json"))["stats"]
    schema = json.load(open(f"{out}/schema-{i}.json"))["stats"]
    n = max(schema["generated_tokens"], 1)
    masks, hidden_not = 1e3 * schema["mask_seconds"] / n, 1e3 * schema["mask_wait_seconds"] / n
    step = 1e3 / plain["decode_tps"]
    shares.append(hidden_not / step)
    print(f"| {i} | {plain['decode_tps']:.1f} | {schema['decode_tps']:.1f} | {schema['decode_tps'] / plain['decode_tps']:.3f} "
          f"| {masks:.2f} | {hidden_not:.2f} | {100 * hidden_not / step:.1f}% |")
print(f"\nnot hidden, share of the plain step: median {100 * statistics.median(shares):.1f}%")
PY
