#!/usr/bin/env bash
# The installed Python package (cmake --install: PREFIX/lib/python/symbiosis) imports and computes a
# base layer on an installed executor, without LD_LIBRARY_PATH and without the source tree.
# Usage: installed_package_test.sh BINARY_DIR PYTHON
set -euo pipefail
bin=$1 python=$2
work=$(mktemp -d /tmp/symbiosis-python-install-XXXXXX)
executor_pid=""
trap '[ -n "$executor_pid" ] && kill $executor_pid 2>/dev/null; rm -rf "$work"' EXIT

cmake --install "$bin" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/python/symbiosis/__init__.py"
ls "$work/prefix/lib/python/symbiosis/"_C*.so > /dev/null
"$work/prefix/bin/symbiosis-make-checkpoint" --preset tiny-llama --out "$work/model" > /dev/null
"$work/prefix/bin/symbiosis-executor" --model "$work/model" --listen 'tcp://127.0.0.1:*' > "$work/executor.out" \
  2> "$work/executor.log" &
executor_pid=$!
# Its [Ready line] (base_executor/main.cpp), for up to a minute, or its log if it ends first.
for _ in $(seq 600); do
  grep -q '^ready ' "$work/executor.out" && break
  kill -0 "$executor_pid" 2>/dev/null || break
  sleep 0.1
done
endpoint=$(sed -n 's/^ready //p' "$work/executor.out")
[ -n "$endpoint" ] || { echo "the installed executor did not start; its log:"; cat "$work/executor.log"; exit 1; }
cd "$work"
env -u LD_LIBRARY_PATH PYTHONPATH="$work/prefix/lib/python" PYTHONDONTWRITEBYTECODE=1 "$python" -c "
import sys, torch, symbiosis
assert symbiosis.__file__.startswith('$work/prefix'), symbiosis.__file__
client = symbiosis.Client.connect('$endpoint', tenant='installed')
layer = client.layers()[0]
y = client.forward(layer, torch.ones(3, layer.in_features))
assert y.shape == (3, layer.out_features), y.shape
print('installed package: layer', layer.name, 'computed over', client.transport)
"
# symbiosis-serve, installed beside the other tools, runs on the installed package: a checkpoint
# without a tokenizer is refused, naming it.
if env -u LD_LIBRARY_PATH PYTHONDONTWRITEBYTECODE=1 "$work/prefix/bin/symbiosis-serve" --model "$work/model" \
    --executor "$endpoint" --port 0 > "$work/serve.out" 2>&1; then
  echo "installed symbiosis-serve served a checkpoint without a tokenizer"; exit 1
fi
grep -q -- "--model $work/model has no tokenizer (tokenizer.json or tokenizer.model" "$work/serve.out" || { cat "$work/serve.out"; exit 1; }
echo "installed symbiosis-serve: $(tail -1 "$work/serve.out" | cut -c1-100)"
# symbiosis-tinker too: a base model without a tokenizer is refused, naming it.
if env -u LD_LIBRARY_PATH PYTHONDONTWRITEBYTECODE=1 "$work/prefix/bin/symbiosis-tinker" --base-model "tiny=$work/model" \
    --executor "$endpoint" --port 0 --state-dir "$work/tinker" > "$work/tinker.out" 2>&1; then
  echo "installed symbiosis-tinker served a checkpoint without a tokenizer"; exit 1
fi
grep -q -- "$work/model has no tokenizer (tokenizer.json or tokenizer.model" "$work/tinker.out" || { cat "$work/tinker.out"; exit 1; }
echo "installed symbiosis-tinker: $(tail -1 "$work/tinker.out" | cut -c1-100)"
