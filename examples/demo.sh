#!/usr/bin/env bash
# The demo: a tiny random Llama checkpoint, one executor, three tenants fine-tuning three
# different LoRA adapters against it at the same time, each printing its loss as it falls; then
# one of them generates from its adapter through the executor, held to the monolithic run.
# Usage: examples/demo.sh [BUILD_DIR]
set -euo pipefail
build=${1:-build}
work=$(mktemp -d /tmp/symbiosis-demo-XXXXXX)
executor_pid=""
cleanup() {
  [ -n "$executor_pid" ] && kill -TERM "$executor_pid" 2>/dev/null && wait "$executor_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

echo "== making a tiny random Llama checkpoint in $work/model"
"$build/tools/symbiosis-make-checkpoint" --preset tiny-llama --out "$work/model" --seed 7

echo "== starting the executor"
"$build/base_executor/symbiosis-executor" --model "$work/model" --listen 'tcp://127.0.0.1:*' --device cpu \
  > "$work/executor.out" 2> "$work/executor.log" &
executor_pid=$!
for _ in $(seq 100); do grep -q '^ready ' "$work/executor.out" 2>/dev/null && break; sleep 0.1; done
endpoint=$(sed -n 's/^ready //p' "$work/executor.out")
[ -n "$endpoint" ] || { echo "executor did not start:"; cat "$work/executor.log"; exit 1; }
echo "   executor serving on $endpoint"

echo "== three tenants fine-tune their own LoRA adapters concurrently"
client="$build/examples/symbiosis-demo-client"
common=(--executor "$endpoint" --model "$work/model" --steps 30 --seq 64 --lr 3e-2)
"$client" "${common[@]}" --tenant alice --rank 4 --targets q_proj,v_proj --seed 1 --save "$work/alice" &
a=$!
"$client" "${common[@]}" --tenant bob --rank 8 --targets q_proj,k_proj,v_proj,o_proj --seed 2 --save "$work/bob" &
b=$!
"$client" "${common[@]}" --tenant carol --rank 16 --alpha 32 --targets gate_proj,up_proj,down_proj --seed 3 \
  --save "$work/carol" &
c=$!
status=0
for pid in $a $b $c; do wait "$pid" || status=1; done

echo "== adapters saved in Hugging Face PEFT format:"
for t in alice bob carol; do echo "   $t: $(ls "$work/$t" | tr '\n' ' ')"; done

echo "== alice generates from her adapter through the same executor (and again with the base in-process)"
printf '{"prompt_ids": [1, 2, 3, 4]}\n{"prompt_ids": [42, 7], "temperature": 0.8, "seed": 5}\n' > "$work/prompts.jsonl"
generate=("$build/examples/symbiosis-generate" --model "$work/model" --adapter "$work/alice" --input "$work/prompts.jsonl"
          --max-new-tokens 8 --tenant alice)
"${generate[@]}" --executor "$endpoint" > "$work/split.jsonl" || status=1
"${generate[@]}" --monolithic > "$work/monolithic.jsonl" || status=1
sed 's/^/   /' "$work/split.jsonl"
if cmp -s "$work/split.jsonl" "$work/monolithic.jsonl"; then
  echo "   the same tokens as the monolithic run"
else
  echo "   MISMATCH against the monolithic run:"; sed 's/^/   /' "$work/monolithic.jsonl"; status=1
fi
echo "== stopping the executor"
kill -TERM "$executor_pid"
wait "$executor_pid" || true
executor_pid=""
tail -n 3 "$work/executor.log" | sed 's/^/   /'
exit $status
