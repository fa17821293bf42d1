# The helpers and shared settings of scripts/gpu_check.sh and its stages (scripts/gpu_stages/*.sh),
# sourced by gpu_check.sh after it has set up $B, $out, log and the loader's paths.
# A checkpoint of `preset` (random, bf16; the preset's layers, or `layers`) written to `dir` through
# dir.tmp, so that dir/config.json means the whole checkpoint is there.
checkpoint_into() {
  "$B/tools/symbiosis-make-checkpoint" --preset $1 ${3:+--layers $3} --dtype bf16 --out $2.tmp > /dev/null && mv $2.tmp $2
}
wait_checkpoint() { while [ ! -f $1/config.json ]; do sleep 1; done; log "$1 ready"; }
# The large checkpoints take minutes to write: those the stages need start now, beside the other stages.
model_7b=/tmp/llama-7b model_13b=/tmp/llama-13b model_27b=/tmp/gemma-27b
case " $* " in *" capacity-13b"*|*" remote "*|*" remote-13b "*|*" python-13b "*) ( checkpoint_into llama-2-13b $model_13b ) & ;; esac
case " $* " in *" table5 "*|*" long-context "*) ( checkpoint_into llama-2-7b $model_7b ) & ;; esac
case " $* " in *" checkpoint-27b "*) ( checkpoint_into gemma-2-27b $model_27b ) & ;; esac

export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mps_on() {
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  pgrep -x nvidia-cuda-mps > /dev/null || nvidia-cuda-mps-control -d
  sleep 1
}
mps_off() {
  echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
  sleep 2
}

# Starts an executor in the background with its output in the log file named first (the other
# arguments are the executor's) and waits for its "ready ENDPOINT" line, however long its model takes
# to load; sets executor_pid. Fails, showing the log's end, where the executor exits first or no
# line comes within 10 minutes.
start_executor() {
  local log_file=$1 waited=0
  shift
  "$B/base_executor/symbiosis-executor" "$@" > "$log_file" 2>&1 &
  executor_pid=$!
  until grep -q "^ready " "$log_file"; do
    if ! kill -0 $executor_pid 2> /dev/null || [ $waited -ge 6000 ]; then
      log "the executor did not start: $(tail -3 "$log_file")"
      kill $executor_pid 2> /dev/null
      return 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
}

# At most 8 files come back from the GPU machine: logs stay in /tmp unless something failed.
logs=/tmp/gpu-check-logs
mkdir -p $logs
run_gtest() {  # name, then filter
  local name=$1 log_file=$logs/$1.log
  timeout "${GTEST_TIMEOUT:-300}" "$(find "$B/tests" -name "$name" -type f | head -1)" --gtest_filter="${2:-*}" \
    > "$log_file" 2>&1
  local failed=$(grep -cE '^\[ +FAILED +\] [A-Z]' "$log_file")
  log "$name: $(grep -cE '^\[ +OK' "$log_file") ok, $failed failed, $(grep -cE '^\[ +SKIPPED' "$log_file") skipped"
  if [ "$failed" != 0 ] || ! grep -q "PASSED" "$log_file"; then
    cp "$log_file" "$out/"
    grep -E "^\[ +FAILED +\] [A-Z]|Failure|Expected|actual|Which is|error|MISMATCH|NCCL WARN" "$log_file" | head -30
  fi
}

bench() {  # tag, scenario, extra args
  local tag=$1 scenario=$2
  shift 2
  "$B/bench/symbiosis-bench" --scenario "$scenario" --out "/tmp/bench-$tag" --python python3 --source-dir "$root" "$@" \
    > "$logs/bench-$tag.txt" 2> "$logs/bench-$tag.err"
  local rc=$?
  log "bench $tag exited $rc"
  cat "$logs/bench-$tag.txt"
  tail -3 "$logs/bench-$tag.err"
  if [ $rc != 0 ]; then
    # The run that failed names its directory; show the errors of its processes.
    local failed=$(grep -o "see the .err files in [^ ]*" "$logs/bench-$tag.err" | tail -1 | awk '{print $NF}')
    for f in $(ls ${failed:-/tmp/bench-$tag/*/*}/*.err 2>/dev/null | head -12); do
      [ -s "$f" ] && { echo "== $f"; tail -6 "$f"; }
    done
  fi
  cp "/tmp/bench-$tag/results.json" "$out/bench-$tag.json" 2>/dev/null
}

model_1b=/tmp/llama-1b
patch_scenario() {  # scenario file, JSON merged over its top level; prints the result
  python3 - "$1" "$2" <<'PY'
import json, sys
scenario = json.load(open(sys.argv[1]))
scenario.update(json.loads(sys.argv[2]))
print(json.dumps(scenario))
PY
}
make_1b() {
  [ -f $model_1b/config.json ] || "$B/tools/symbiosis-make-checkpoint" --preset llama-3.2-1b --dtype bf16 --out $model_1b > /dev/null
}

# One 1B client at a time, split (CUDA IPC, an executor beside it) and monolithic, at each shape
# "BATCH SEQ" named after the first argument (2 x 512 and 1 x 128 when none is), under MPS:
# `$1 SYSTEM BATCH SEQ CLIENT-FLAGS` runs and reports each.
each_single_client() {
  local run_one=$1 executor_pid shape system flags
  shift
  local shapes=("$@")
  [ ${#shapes[@]} = 0 ] && shapes=("2 512" "1 128")
  make_1b
  mps_on
  start_executor $logs/single-client-executor.log --model $model_1b --device cuda:0 --dtype bf16 \
    --listen tcp://127.0.0.1:5790 --log-level warn || { mps_off; return 1; }
  for shape in "${shapes[@]}"; do
    for system in split monolithic; do
      flags="--executor tcp://127.0.0.1:5790"
      [ $system = monolithic ] && flags="--monolithic"
      $run_one $system $shape "$flags --model $model_1b --device cuda:0 --dtype bf16 --warmup 3 --iterations 1"
    done
  done
  kill $executor_pid
  mps_off
}

# [Op profile] of one client (each_single_client).
op_profile_client() {
  local system=$1 batch=$2 seq=$3 flags=$4 json=$out/op-profile-$1-$2x$3.json
  "$B/bench/symbiosis-bench-client" $flags --batch $batch --seq $seq --op-profile 5 --out $json \
    > $logs/op-$system.log 2>&1 || tail -5 $logs/op-$system.log
  python3 - $json <<'PY'
import json, sys
path = sys.argv[1]
p = json.load(open(path))["op_profile"]
print(f"== {path.split('/')[-1]}: {p['iteration_ms']:.1f} ms an iteration, {p['top_level_ops_per_iteration']:.0f} top-level ops")
for op in p["ops"][:18]:
    print(f"  {op['ms_per_iteration']:8.2f} ms {op['per_iteration']:7.0f}x  {op['name']}")
PY
}

# Kineto trace of one inference tenant (each_single_client) generating BATCH x (SEQ + 128) tokens,
# decode captured, summed by kernel.
trace_generate_client() {
  local system=$1 batch=$2 seq=$3 flags=$4 trace=/tmp/trace-generate-$1.json
  "$B/bench/symbiosis-bench-client" $flags --mode generate --batch $batch --seq $seq --new-tokens 128 --rank 8 \
    --targets q_proj,k_proj,v_proj,o_proj --cuda-graph --trace $trace --out /tmp/trace-generate-$system-result.json \
    > $logs/trace-generate-$system.log 2>&1 || tail -5 $logs/trace-generate-$system.log
  echo "== $system, generate $batch x ($seq + 128), per generation (a prefill and 128 decode steps)"
  python3 bench/trace_summary.py $trace --top 30
}

# Kineto trace of one captured client (each_single_client), summed by kernel.
trace_client() {
  local system=$1 batch=$2 seq=$3 flags=$4 trace=/tmp/trace-$1-$2x$3.json
  "$B/bench/symbiosis-bench-client" $flags --batch $batch --seq $seq --targets q_proj,k_proj,v_proj,o_proj \
    --cuda-graph --trace $trace --out /tmp/trace-$system.json > $logs/trace-$system.log 2>&1 \
    || tail -5 $logs/trace-$system.log
  echo "== $system, $batch x $seq"
  python3 bench/trace_summary.py $trace --top 24
}

# The Python package symbiosis for this machine's python3 (3.12, the bundle's is built for it: [Extension for another
# Python] in python/CMakeLists.txt): its sources from the tree, its extension module from $B/python, or, where that
# is missing or does not import, built here from python/client_binding.cpp (~1 min) against this machine's torch and
# pybind11 and the client library in $B. Exports PYTHONPATH and the programs tests/python's conftest.py runs.
python_package() {
  # What was there before (wheels unpacked for this run: ../.library/device/README.md) stays after ours.
  local before=${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONPATH="$root/python:$B/python$before" PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONUNBUFFERED=1 SYMBIOSIS_BINARY_DIR="$B" \
    SYMBIOSIS_EXECUTOR="$B/base_executor/symbiosis-executor" SYMBIOSIS_DEMO_CLIENT="$B/examples/symbiosis-demo-client" \
    SYMBIOSIS_MAKE_CHECKPOINT="$B/tools/symbiosis-make-checkpoint"
  if python3 -c 'import symbiosis' > $logs/python-import.log 2>&1; then
    log "symbiosis imports: $(python3 -c 'import symbiosis._C as c; print(c.__file__)')"
    return 0
  fi
  log "the carried symbiosis._C does not import here ($(tail -1 $logs/python-import.log)); building it"
  local ext=/tmp/symbiosis-python torch_dir="$site/torch"
  mkdir -p $ext/symbiosis
  c++ -O2 -fPIC -shared -fvisibility=hidden -std=gnu++20 -I"$root" $(python3 -m pybind11 --includes) \
    -isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include" "$root/python/client_binding.cpp" "$root/python/generator_binding.cpp" \
    "$root/python/serving_binding.cpp" \
    -o "$ext/symbiosis/_C$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" \
    -Wl,--push-state,--no-as-needed "$(c++ -print-file-name=libstdc++.so.6)" -Wl,--pop-state \
    -L"$B/client_runtime" -L"$B/virt_layer" -L"$torch_dir/lib" -lsymbiosis_client -lsymbiosis_virt_layer \
    -ltorch_python -ltorch -ltorch_cpu -lc10 > $logs/python-build.log 2>&1 \
    || { log "building symbiosis._C failed"; grep -m5 -A3 error $logs/python-build.log; return 1; }
  export PYTHONPATH="$root/python:$ext$before"
  python3 -c 'import symbiosis' > $logs/python-import.log 2>&1 || { log "symbiosis does not import: $(tail -3 $logs/python-import.log)"; return 1; }
  log "symbiosis._C built here"
}

# checkpoint_into, unless an earlier stage wrote it or is writing it (dir.tmp); then waits for it.
write_checkpoint() {
  if [ ! -f $2/config.json ] && [ ! -d $2.tmp ]; then
    checkpoint_into "$@" || { log "writing the $1 checkpoint failed"; rm -rf $2.tmp; return 1; }
  fi
  wait_checkpoint $2
}

# One run of bench/sharded_local.py as `tag` on the checkpoint `model`, its placement and shape in the
# arguments after them, under SHARDED_TIMEOUT_S (MPS unless SHARDED_MPS=0); prints its table, and
# what failed where it failed; $out/TAG.json and $out/TAG.err.
sharded_bench() {
  local tag=$1 model=$2 run=/tmp/$1
  shift 2
  [ "${SHARDED_MPS:-1}" = 1 ] && mps_on
  local flags=""
  [ "${SHARDED_CUDA_GRAPH:-0}" = 1 ] && flags="$flags --cuda-graph"
  [ "${SHARDED_SKIP_SYMBIOSIS:-0}" = 1 ] && flags="$flags --skip-symbiosis"
  # By hand, each part computes on the cuda:0 of its own CUDA_VISIBLE_DEVICES (the launcher's --gpus is the default).
  [ "${SHARDED_PARTS_BY_HAND:-0}" = 1 ] && flags="$flags --parts-by-hand"
  rm -rf $run
  timeout "${SHARDED_TIMEOUT_S:-360}" python3 bench/sharded_local.py --model $model --build "$B" --out $run \
    --dtype bf16 --batch 2 --rank 8 --targets q_proj,k_proj,v_proj,o_proj --warmup 2 --window-s "${SHARDED_WINDOW_S:-10}" \
    --fsdp-limit "${SHARDED_FSDP_LIMIT:-8}" --fsdp-wave 4 --fsdp-deadline-s "${SHARDED_FSDP_DEADLINE_S:-170}" \
    --batching "${SHARDED_BATCHING:-opportunistic}" --max-wait-us "${SHARDED_MAX_WAIT_US:-150}" $flags "$@" \
    > $logs/$tag.txt 2> $logs/$tag.err
  log "$tag exited $?"
  # Killed past its own clean-up, it leaves the processes it started: stop them.
  kill $(cat $run/pids 2> /dev/null) 2> /dev/null
  cat $logs/$tag.txt
  grep "^\[sharded_local" $logs/$tag.err | tail -16
  if grep -q "FAILED" $logs/$tag.txt; then
    for f in $run/symbiosis/executor.err $run/symbiosis/part*.err; do
      [ -s "$f" ] && { echo "== $f"; grep -vE "^\[W|^frame #|^Exception raised" "$f" | tail -4; }
    done
    tail -4 $logs/$tag.err
  fi
  cp $run/sharded_local.json "$out/$tag.json" 2> /dev/null
  cp $logs/$tag.err "$out/$tag.err"
  [ "${SHARDED_MPS:-1}" = 1 ] && mps_off
}
