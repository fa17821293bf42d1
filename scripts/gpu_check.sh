#!/usr/bin/env bash
# On the GPU machine (see ../shared/gpu/README.md): runs the GPU tests and benchmarks of the
# stages named as arguments, leaving every log and result under $OUT. Start it as
#   source .gpu/env.sh && bash scripts/gpu_check.sh tests roundtrip ...
# with carry: [".gpu", ".gpu-build"]. It uses the binaries that scripts/gpu_bundle.sh carried in
# .gpu-build when they load here, and builds from source into build-gpu otherwise.
# Stages:
#   tests          `ctest -L gpu`: every GPU suite a test a process ([GPU suites in ctest] in gpu_bundle.sh; those that
#                  need 2 GPUs skip themselves on one; CTEST_JOBS at once, default 1), under MPS, and
#                  runtime_binding_test ([libstdc++ first]) built with this machine's toolchain
#   gtest          one test binary, GPU_TEST, with GPU_FILTER (default *); its log printed
#   shell          GPU_SHELL, a command line run with this script's environment ($B the binaries, $out, the
#                  loader's paths): a diagnosis that no stage makes
#   generator      gpu_generator_test alone, under MPS
#   restart        gpu_restart_test alone (generation and training across an executor killed and restarted)
#   trainer        gpu_trainer_test alone (the tenant trainer's captured steps, symbiosis-finetune on a GPU), under MPS
#   finetune-1b    symbiosis-finetune on Llama-3.2-1B (bf16, LoRA r 16 on q/k/v/o, 4 x up to 512 tokens a step, 40 steps):
#                  split captured, split eager (--no-capture) and monolithic captured; tokens/s over the run, under MPS
#   privacy        noise masking: its kernels' tests and gpu_privacy_test (masked captured steps and decode,
#                  the bf16 error), under MPS
#   privacy-bench  masking on against off (Llama-3.2-1B, bf16, N = 8: fine-tuning at 2 x 512 and 1 x 128 and
#                  decode, effects at the executor and here; decode over tcp at N = 1 and 8), under MPS
#   kernels        gpu_executor_test and kernels_test (the executor's GEMMs, the packing kernel, the fused loss, ...)
#   loss           the client's loss, fused against the fp32 copy and ATen's (symbiosis-bench-loss),
#                  at 2 x 512 and 1 x 128 tokens of Llama 3's vocabulary, bf16
#   mixed          cuda_ipc_test's clients of every transport on one executor, three times (1 GPU, MPS)
#   roundtrip      per-layer round trip of each transport, with and without MPS
#   roundtrip-ipc  the CUDA IPC round trip alone under MPS (direct operands, then through the buffer),
#                  three runs, with the host time of its parts
#   generate       gpu_generator_test, then decode with N = 1, 2, 4, 8 (or COUNTS) inference tenants of 8
#                  sequences (512 + 128 tokens, Llama-3.2-1B, bf16) against N monolithic processes, one
#                  monolithic process of all 8 x N_MAX sequences, and HF PEFT generate with N_MAX adapters
#                  in one mixed batch (N_MAX: the largest count), under MPS
#   launch-ahead   [Steps launched ahead]: N = 1, 2, 4, 8 (or COUNTS) decode tenants as in generate, their steps
#                  launched ahead or taken up call by call, against N monolithic processes
#   launch-together [Runs launched together]: N = 2, 4, 8 (or COUNTS) decode tenants as in generate, their steps launched
#                  together (waiting 1 ms, then 4 ms) or each alone, against N monolithic processes
#   mixed-generate 6 inference tenants (8 x (512 + 128) tokens each) and 2 fine-tuning tenants (2 x 512) on one
#                  executor, against each group alone (Llama-3.2-1B, bf16, MPS; the paper's 4.4)
#   table5         8 inference tenants of batches 2 to 256, two LoRA shapes, under none, lockstep and
#                  opportunistic (Llama-2-7B shape, bf16, MPS; the paper's Table 5)
#   bench-512      Llama-3.2-1B, batch 2 x 512, N = 1, 2, 4, 8 (or COUNTS), against both baselines, under MPS
#   bench-128      the same at batch 1 x 128
#   bench-128-ends the same at N = 1 and 8 only
#   patched        the scenario in SCENARIO with the JSON in PATCH merged over its top level
#                  (e.g. PATCH='{"executor": {...}, "baselines": []}'), at COUNTS, under MPS
#   op-profile     where one 1B client's host time goes ([Op profile] in bench/op_profile.h): split
#                  (CUDA IPC) and monolithic, batch 2 x 512 and 1 x 128, under MPS
#   targets        issue 4's target points under MPS: batch 2 x 512 at N = 1 and 8, batch 1 x 128 at N = 8
#                  (targets-512 and targets-128: one shape each); our clients with captured steps and eager
#   trace          where one 1B client's GPU time goes (Kineto trace of 3 captured iterations, summed by kernel
#                  with bench/trace_summary.py): split and monolithic, batch 2 x 512 and 1 x 128, under MPS
#   trace-generate where one 1B inference tenant's GPU time goes (Kineto trace of 3 generations of 8 x (512 + 128)
#                  tokens, decode captured), split (CUDA IPC) and monolithic, under MPS
#   trace-sharing  issue 45's workloads traced, the executor and every tenant on one timeline ([Traced runs] in
#                  bench/bench_main.cpp, docs/tracing.md): decode at N = 1 and 8 (or TRACE_COUNTS) with the
#                  monolithic baseline, and the mixed workload with each group alone; each run's trace_summary
#                  and the merged traces that fit go back in traces.tgz (open them in ui.perfetto.dev)
#   python-generate  a Python tenant's generation, symbiosis.Generator (split and monolithic) against transformers +
#                  PEFT generate (bench/python_generate.py: Llama-3.2-1B, bf16, 8 prompts of 512 + 128 tokens), under MPS
#   multi-lora     [Multi-adapter batches] (bench/multi_lora.cpp): 64 requests of 512 + 128 tokens over ADAPTERS (1,8,32)
#                  adapters in one generator, against the one-process bound, separate tenants, a monolithic generator,
#                  transformers + PEFT, and beside two fine-tuning tenants (Llama-3.2-1B, bf16, LoRA r16), under MPS
#                  (MULTI_LORA_FLAGS: the bench's flags after those, default '--python python3 --finetune-tenants 2')
#   tinker-rl      symbiosis-tinker: TINKER_RUNS (1,4,8) concurrent RL runs of the tinker SDK against one after another
#                  (bench/tinker_rl.py, Llama-3.2-1B, bf16); needs the wheels in .whl (tinker, pyqwest, ...)
#   serve-bench    symbiosis-serve over HTTP (bench/serve_bench.py, the openai client): 64 streams over 8 adapters, split
#                  against --monolithic, on multi-lora's model and adapters; needs the wheels in .whl (fastapi, openai, ...);
#                  SERVE_BENCH_FLAGS: more of symbiosis-serve's flags (e.g. --overlap-adapters)
#   gemm-shapes    the executor's GEMMs of the 1B shapes, one request alone against several packed (bench/gemm_shapes.py)
#   bench-nomps    both shapes at N = 1 and 8, every process without MPS
#   nomps-512      batch 2 x 512 at N = 8 without MPS
#   capacity-13b   how many Llama-2-13B fine-tuning clients fit, against Hugging Face PEFT jobs, with
#                  PyTorch's default allocator settings and then with expandable segments (every process)
#   capacity-13b-expandable  the second of those alone
#   remote         clients on GPU 1, executor on GPU 0 (NCCL), against local placement (2 GPUs)
#   remote-1b      the same, Llama-3.2-1B only;  remote-13b: Llama-2-13B only (counts: REMOTE_1B_COUNTS,
#                  REMOTE_13B_COUNTS)
#   privacy-nccl   a masked tenant on GPU 1 over NCCL (then with effects here), fp32 and captured-free, against its
#                  monolithic run (demo client --verify, 5e-4), executor on GPU 0 (2 GPUs)
#   roundtrip-nccl the NCCL round trip alone (2 GPUs), with and without MPS
#   soak           the soak with churn: 64 tenant processes over cuda-ipc, shm and tcp join, leave, are killed and
#                  come back on one executor for SOAK_SECONDS (450), each exact at every step (bench/soak.cpp), under MPS
#   long-context   issue 28 (symbiosis-bench-long-context; docs/benchmarks.md, "Long context"): Llama-2-7B shape, bf16
#                  random weights, batch 1, inter-token latency of the all-GPU client, host decode (GPU prefill, host
#                  cache, CPU decode) and the offloaded cache at LONG_CONTEXTS (4K..128K) with LONG_NEW_TOKENS (16) new
#                  tokens; CPU decode attention against the host's memory bandwidth; the multi-request point (1K-token
#                  requests on the CPU until LONG_HOST_CAP bytes, on the GPU until its memory is full), under MPS
#   python         Python tenants (docs/python.md): tests/python/test_gpu.py (symbiosis-serve's engine and symbiosis-tinker
#                  need the wheels of .whl installed first; a tenant on cuda:0 over cuda-ipc and, with
#                  2 GPUs, one on cuda:1 over nccl, each equal to the same transformers + PEFT model in one process: fp32
#                  within 1e-5, bf16 within 5e-2), under MPS, then the CPU suite (tests/python, executors on the CPU;
#                  PYTHON_CPU_SUITE=0 skips it), on pytest-xdist's workers where it is installed
#   python-13b     issue 29's benchmark (bench/python_tenants.py): Llama-2-13B shape (random, bf16), LoRA r8 on q,k,v,o,
#                  2 x 512: how many Python tenants (transformers + PEFT over Symbiosis) fit against plain transformers +
#                  PEFT jobs (the same script with its own base), and their tokens/s against as many C++ tenants; under
#                  MPS. PY13B_GC=1: gradient checkpointing in every Python job; PY13B_LIMIT (24), PY13B_WAVE (4), PY13B_PLAIN_LIMIT
#                  (8; 0 skips the plain jobs), PY13B_WINDOW_S (6), PY13B_CPP_GRAPH=1 (captured C++ tenants),
#                  PY13B_TIMEOUT_S (420: the run is stopped, its clients killed, what it measured written)
#   sharded        the sharded executor ([Parts] in base_executor/parts.h): gpu_executor_test's Sharded* (one part on
#                  cuda:0; with 2 GPUs two parts, clients on both), then with 2 GPUs symbiosis-bench-shard-split over
#                  NCCL: Llama-2-13B's layers in bf16, tensor-parallel against FSDP-style calls at SHARD_TOKENS tokens
#   sharded-13b    issue 31's run 2 (bench/sharded_local.py; 2 GPUs): Llama-2-13B shape (random, bf16), LoRA r8 on q,k,v,o,
#                  2 x 512 a step. Symbiosis sharded-local (one executor part a GPU, tenants on both GPUs, each over cuda-ipc
#                  to its GPU's part) at SHARDED_COUNTS (2,4,8,16) tenants, against FSDP + PEFT jobs (bench/fsdp_peft.py, each
#                  over both GPUs) started in waves until one runs out of memory: adapters at once and aggregate tokens/s,
#                  under MPS (SHARDED_MPS=0: without). SHARDED_WINDOW_S (10), SHARDED_FSDP_BATCH (2: sequences an FSDP step,
#                  both ranks together), SHARDED_FSDP_LIMIT (8; 0 skips FSDP), SHARDED_SKIP_SYMBIOSIS=1, SHARDED_CUDA_GRAPH=1,
#                  SHARDED_FSDP_DEADLINE_S (170), SHARDED_TIMEOUT_S (360); PYTORCH_CUDA_ALLOC_CONF reaches every process;
#                  SHARDED_PARTS_BY_HAND=1: each part its own process on a GPU seen alone (CUDA_VISIBLE_DEVICES), not --gpus;
#                  SHARDED_BATCHING (opportunistic) and SHARDED_MAX_WAIT_US (150): the executor's batching
#   checkpoint-27b the Gemma-2-27B shape's checkpoint (random, bf16, ~54 GB, ~4 min) for a later call's sharded-remote
#   sharded-remote issue 31's run 3 (bench/sharded_local.py --client-gpus; 4 GPUs or more): Gemma-2-27B shape, 2 x 64 a
#                  step, the executor's parts on the first half of the GPUs (at most 4) and their tenants on the second
#                  half over NCCL, against FSDP + PEFT jobs over all of them; the SHARDED_* settings as sharded-13b,
#                  SHARDED_MAX_WAIT_US 2000 by default, and SHARDED_27B_LAYERS: a model of that many layers only
#                  (quicker, to compare settings)
#   nccl-tune      NCCL's round trip and remote 1B at N = 8 under the NCCL settings in NCCL_TUNE
#                  (';'-separated, each a space-separated list of VAR=value; "-" is NCCL's defaults),
#                  with a [8192, 8192] layer beside the [2048, 2048] one (2 GPUs, MPS)
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
root=$(pwd)
start=$(date +%s)
log() { echo "[gpu_check $(( $(date +%s) - start ))s] $*"; }
log "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tr '\n' ';')"

# The loader finds this machine's torch, CUDA libraries and NCCL (the wheel's), then ours.
site=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
nv=""
for d in "$site"/nvidia/*/lib; do nv="$nv:$d"; done
export LD_LIBRARY_PATH="$site/torch/lib$nv:${LD_LIBRARY_PATH:-}"
B=$root/.gpu-build
if [ -x "$B/base_executor/symbiosis-executor" ] && \
   LD_LIBRARY_PATH="$B/client_runtime:$B/virt_layer:$LD_LIBRARY_PATH" "$B/base_executor/symbiosis-executor" --help > /dev/null 2>&1; then
  export LD_LIBRARY_PATH="$B/client_runtime:$B/virt_layer:$LD_LIBRARY_PATH"
  log "using the carried build ($(cat "$B/COMMIT" 2>/dev/null))"
  # [GPU suites in ctest] (scripts/gpu_bundle.sh): the carried ctest entries, pointed at this tree.
  # A suite trimmed from the bundle after it was made (its binary gone) is left out.
  for f in $(cd "$B" && find . -name '*_tests.cmake.in'); do
    [ -f "$B/${f%\[1\]_tests.cmake.in}" ] && sed "s|@BUILD@|$B|g" "$B/$f" > "$B/${f%.in}"
  done
  while read -r line; do
    f=$(sed -n 's|include("@BUILD@/\(.*\)")|\1|p' <<< "$line")
    [ -f "$B/$f" ] && echo "include(\"$B/$f\")"
  done < "$B/CTestTestfile.cmake.in" > "$B/CTestTestfile.cmake"
else
  log "carried build does not load here; building from source"
  LD_LIBRARY_PATH="$B/client_runtime:$B/virt_layer:$LD_LIBRARY_PATH" ldd "$B/base_executor/symbiosis-executor" 2>&1 | grep "not found" | head
  B=$root/build-gpu
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSYMBIOSIS_PYTHON=python3 > "$out/configure.log" 2>&1 \
    || { tail -30 "$out/configure.log"; exit 1; }
  cmake --build "$B" --target symbiosis-executor symbiosis-demo-client symbiosis-make-checkpoint symbiosis-bench \
    symbiosis-bench-client symbiosis-bench-roundtrip symbiosis-bench-loss symbiosis-soak symbiosis-soak-client gpu_executor_test kernels_test cuda_ipc_test nccl_test hostile_gpu_tenant runtime_binding_test \
    gpu_generator_test gpu_trainer_test gpu_privacy_test symbiosis-finetune symbiosis-generate symbiosis-bench-long-context \
    > "$out/build.log" 2>&1 \
    || { grep -B2 -A8 -m3 "error" "$out/build.log"; exit 1; }
  export LD_LIBRARY_PATH="$B/client_runtime:$B/virt_layer:$LD_LIBRARY_PATH"
  log "built"
fi
gpus=$(nvidia-smi -L | wc -l)
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

for stage in "$@"; do
  log "stage $stage"
  case $stage in
    tests)
      run_gtest runtime_binding_test  # [libstdc++ first] with this machine's toolchain
      mps_on
      # Every suite labelled gpu, a test a process (those needing more GPUs than here skip themselves).
      ctest --test-dir "$B" -L gpu --output-on-failure --timeout "${GTEST_TIMEOUT:-300}" -j "${CTEST_JOBS:-1}" > $logs/ctest-gpu.log 2>&1
      log "ctest -L gpu: $(grep -E 'tests passed' $logs/ctest-gpu.log)"
      grep -E '\*\*\*|Failed|Not Run' $logs/ctest-gpu.log | grep -v 'tests passed' | head -20
      grep -q '100% tests passed' $logs/ctest-gpu.log || cp $logs/ctest-gpu.log "$out/"
      mps_off
      ;;
    gtest)
      # One GPU test binary, GPU_TEST (e.g. gpu_executor_test), filtered by GPU_FILTER; its log is printed.
      # GPU_MPS=1: under MPS (same-GPU tenants' [Device flags] need it).
      [ -n "${GPU_MPS:-}" ] && mps_on
      run_gtest "$GPU_TEST" "${GPU_FILTER:-*}"
      [ -n "${GPU_MPS:-}" ] && mps_off
      cp "$logs/$GPU_TEST.log" "$out/"
      grep -vE "^\[ +(RUN|OK) +\]" "$logs/$GPU_TEST.log" | tail -30
      ;;
    shell)
      B=$B out=$out bash -c "$GPU_SHELL" 2>&1 | tail -80
      ;;
    generator)
      mps_on
      run_gtest gpu_generator_test
      mps_off
      ;;
    restart)
      run_gtest gpu_restart_test
      ;;
    trainer)
      mps_on
      run_gtest gpu_trainer_test
      mps_off
      ;;
    privacy)
      mps_on
      run_gtest kernels_test 'NoiseMask*'
      run_gtest gpu_privacy_test
      grep "bf16 error" $logs/gpu_privacy_test.log
      mps_off
      ;;
    finetune-1b)
      make_1b
      mps_on
      python3 -c "
import json, random
r = random.Random(7)
for _ in range(256):
    print(json.dumps({'input_ids': [r.randrange(128256) for _ in range(r.randrange(256, 513))]}))" > /tmp/finetune-1b.jsonl
      start_executor $logs/finetune-1b-executor.log --model $model_1b --device cuda:0 --dtype bf16 \
        --listen tcp://127.0.0.1:5792 --log-level warn || { mps_off; continue; }
      for run in "split --executor tcp://127.0.0.1:5792" "split-eager --executor tcp://127.0.0.1:5792 --no-capture" \
                 "monolithic --monolithic"; do
        set -- $run
        name=$1
        shift
        "$B/examples/symbiosis-finetune" --model $model_1b "$@" --device cuda:0 --dtype bf16 --train /tmp/finetune-1b.jsonl \
          --lora-r 16 --lora-targets q_proj,k_proj,v_proj,o_proj --steps 40 --micro-batch 4 --max-length 512 --lr 1e-4 \
          > $logs/finetune-1b-$name.out 2> $logs/finetune-1b-$name.err
        log "finetune-1b $name: exit $?; $(tail -1 $logs/finetune-1b-$name.err | grep -o 'loss [0-9.]*.*tok/s'); $(tail -1 $logs/finetune-1b-$name.out)"
      done
      kill $executor_pid
      mps_off
      ;;
    privacy-nccl)
      mps_on
      "$B/tools/symbiosis-make-checkpoint" --preset tiny-llama --out /tmp/tiny-llama > /dev/null
      start_executor $logs/privacy-nccl-executor.log --model /tmp/tiny-llama --device cuda:0 \
        --listen tcp://127.0.0.1:5791 --log-level warn || { mps_off; continue; }
      for mode in --mask --mask-effects-here; do
        "$B/examples/symbiosis-demo-client" --executor tcp://127.0.0.1:5791 --model /tmp/tiny-llama --device cuda:1 \
          --transport nccl $mode --verify --tolerance 5e-4 --steps 3 --tenant "nccl$mode" 2>&1 | tail -2
        log "masked over nccl ($mode): exit status ${PIPESTATUS[0]}"
      done
      kill $executor_pid
      mps_off
      ;;
    privacy-bench)
      mps_on
      make_1b
      bench privacy-512 bench/scenarios/gpu_privacy_llama1b.json --checkpoint $model_1b
      bench privacy-128 bench/scenarios/gpu_privacy_llama1b_128.json --checkpoint $model_1b
      bench privacy-generate bench/scenarios/gpu_privacy_generate_llama1b.json --checkpoint $model_1b
      bench privacy-tcp bench/scenarios/gpu_privacy_tcp_llama1b.json --checkpoint $model_1b
      mps_off
      ;;
    kernels)
      mps_on
      run_gtest gpu_executor_test
      run_gtest kernels_test
      mps_off
      ;;
    loss)
      for tokens in 1024 128; do "$B/bench/symbiosis-bench-loss" --tokens $tokens; done
      ;;
    mixed)
      mps_on
      for run in 1 2 3; do run_gtest cuda_ipc_test '*MixedTransports*'; done
      mps_off
      ;;
    roundtrip-ipc)
      mps_on
      for run in 1 2 3; do
        "$B/bench/symbiosis-bench-roundtrip" --executor-device cuda:0 --client-device cuda:0 --dtype bf16 \
          --transports cuda-ipc,cuda-ipc-buffer --primitives > "$logs/roundtrip-ipc-$run.txt" 2>&1
        rc=$?
        cat "$logs/roundtrip-ipc-$run.txt"
        [ $rc = 0 ] || log "roundtrip-ipc run $run FAILED: exit status $rc"
      done
      mps_off
      ;;
    roundtrip)
      for mps in on off; do
        mps_$mps
        "$B/bench/symbiosis-bench-roundtrip" --executor-device cuda:0 --client-device cuda:0 --dtype bf16 \
          --transports cuda-ipc,tcp --primitives > "$logs/roundtrip-gpu-mps-$mps.txt" 2>&1
        cat "$logs/roundtrip-gpu-mps-$mps.txt"
      done
      "$B/bench/symbiosis-bench-roundtrip" --executor-device cuda:0 --client-device cpu --dtype fp32 \
        --transports shm,tcp --iterations 100 > "$logs/roundtrip-cpu-client.txt" 2>&1
      cat "$logs/roundtrip-cpu-client.txt"
      if [ "$gpus" -ge 2 ]; then
        "$B/bench/symbiosis-bench-roundtrip" --executor-device cuda:0 --client-device cuda:1 --dtype bf16 \
          --transports nccl,tcp > "$logs/roundtrip-nccl.txt" 2>&1
        cat "$logs/roundtrip-nccl.txt"
      fi
      ;;
    generate)
      mps_on
      run_gtest gpu_generator_test
      make_1b
      counts=${COUNTS:-1,2,4,8}
      bench generate bench/scenarios/gpu_generate_llama1b.json --checkpoint $model_1b --counts "$counts"
      n=${counts##*,}
      shape="--mode generate --model $model_1b --batch $((8 * n)) --seq 512 --new-tokens 128 --rank 8 \
        --targets q_proj,k_proj,v_proj,o_proj --device cuda:0 --dtype bf16 --warmup 1 --iterations 2"
      "$B/bench/symbiosis-bench-client" --monolithic --cuda-graph $shape --out $out/generate-one-process.json \
        > $logs/generate-one-process.log 2>&1 || tail -5 $logs/generate-one-process.log
      python3 bench/hf_peft_client.py $shape --adapters $n --out $out/generate-hf-peft.json \
        > $logs/generate-hf-peft.log 2>&1 || tail -5 $logs/generate-hf-peft.log
      python3 - $out/generate-one-process.json $out/generate-hf-peft.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        r = json.load(open(path))
    except OSError:
        continue
    extra = {k: round(v * 1e3, 2) for k, v in r.items() if k.endswith("_s") and "token" in k}
    print(f"{path.split('/')[-1]}: {r['tokens_per_s']:.0f} output tokens/s, batch {r['batch']}, ms: {extra}")
PY
      mps_off
      ;;
    launch-together)
      # [Runs launched together]: decode tenants' steps launched ahead together or each alone, against monolithic processes.
      make_1b
      mps_on
      bench launch-together bench/scenarios/gpu_launch_together_llama1b.json --checkpoint $model_1b --counts "${COUNTS:-2,4,8}"
      mps_off
      ;;
    launch-ahead)
      # [Steps launched ahead]: decode tenants' steps launched ahead or call by call, against monolithic processes.
      make_1b
      mps_on
      bench launch-ahead bench/scenarios/gpu_launch_ahead_llama1b.json --checkpoint $model_1b --counts "${COUNTS:-1,2,4,8}"
      mps_off
      ;;
    multi-lora)
      # [Multi-adapter batches] (issue 47): 64 requests over 1, 8 and 32 adapters in one generator, against the
      # one-process bound, as many single-adapter tenants, the base alone, a monolithic generator of as many
      # adapters and transformers + PEFT; then 8 adapters beside two fine-tuning tenants (bench/multi_lora.cpp), under MPS.
      mps_on
      "$B/bench/symbiosis-bench-multi-lora" --preset llama-3.2-1b --dtype bf16 --adapters "${ADAPTERS:-1,8,32}" \
        --requests 64 --prompt 512 --new-tokens 128 --rank 16 ${MULTI_LORA_FLAGS:---python python3 --finetune-tenants 2} \
        --out /tmp/multi-lora > $logs/multi-lora.txt 2>&1 \
        || tail -5 $logs/multi-lora.txt
      cp /tmp/multi-lora/multi_lora.csv "$out/" 2> /dev/null && cat /tmp/multi-lora/multi_lora.csv
      mps_off
      ;;
    mixed-generate)
      make_1b
      mps_on
      bench mixed-generate bench/scenarios/gpu_mixed_llama1b.json --checkpoint $model_1b
      mps_off
      ;;
    table5)
      wait_checkpoint $model_7b
      mps_on
      bench table5 bench/scenarios/gpu_table5_llama7b.json --checkpoint $model_7b
      mps_off
      ;;
    bench-512|bench-128)
      make_1b
      mps_on
      bench "${stage#bench-}" "bench/scenarios/gpu_llama1b_${stage#bench-}.json" --checkpoint $model_1b \
        --counts "${COUNTS:-1,2,4,8}"
      mps_off
      ;;
    bench-128-ends)
      make_1b
      mps_on
      bench 128 bench/scenarios/gpu_llama1b_128.json --checkpoint $model_1b --counts 1,8
      mps_off
      ;;
    patched)
      make_1b
      mps_on
      python3 - "$SCENARIO" "$PATCH" > /tmp/patched.json <<'PY'
import json, sys
scenario = json.load(open(sys.argv[1]))
scenario.update(json.loads(sys.argv[2]))
print(json.dumps(scenario))
PY
      bench patched /tmp/patched.json --checkpoint $model_1b --counts "${COUNTS:-8}"
      mps_off
      ;;
    trace-generate)
      each_single_client trace_generate_client "8 512"
      ;;
    trace-sharing)
      make_1b
      mps_on
      python3 -c 'import json, sys; s = json.load(open(sys.argv[1])); s["executor"]["policies"] = ["opportunistic"]; print(json.dumps(s))' \
        bench/scenarios/gpu_generate_llama1b.json > /tmp/trace-decode.json
      bench trace-decode /tmp/trace-decode.json --checkpoint $model_1b --counts "${TRACE_COUNTS:-1,8}" --trace 1
      bench trace-mixed bench/scenarios/gpu_mixed_llama1b.json --checkpoint $model_1b --trace 1
      mps_off
      (cd /tmp && for f in bench-trace-*/*/*/trace_summary.txt; do echo "== $f"; cat "$f"; done) | tee "$out/trace-summaries.txt"
      # The merged traces, smallest first, while the bundle stays under the 16 MiB a file may be.
      mkdir -p /tmp/traces && rm -f /tmp/traces/*
      for f in $(cd /tmp && ls -S -r bench-trace-*/*/*/trace.json); do
        gzip -c "/tmp/$f" > "/tmp/traces/$(echo "$f" | tr / -).gz"
        [ "$(du -cb /tmp/traces | tail -1 | cut -f1)" -lt 15000000 ] || rm "/tmp/traces/$(echo "$f" | tr / -).gz"
      done
      tar cf "$out/traces.tar" -C /tmp/traces . && ls -la /tmp/traces
      ;;
    op-profile)
      each_single_client op_profile_client
      ;;
    trace)
      each_single_client trace_client
      ;;
    targets|targets-512|targets-128)
      make_1b
      mps_on
      [ $stage != targets-128 ] && bench 512 bench/scenarios/gpu_llama1b_512.json --checkpoint $model_1b --counts 1,8
      [ $stage != targets-512 ] && bench 128 bench/scenarios/gpu_llama1b_128.json --checkpoint $model_1b --counts 8
      mps_off
      ;;
    gemm-shapes)
      python3 bench/gemm_shapes.py
      ;;
    nomps-512)
      make_1b
      mps_off
      bench nomps-512 bench/scenarios/gpu_llama1b_512.json --checkpoint $model_1b --counts 8
      ;;
    bench-nomps)
      make_1b
      mps_off
      bench nomps-512 bench/scenarios/gpu_llama1b_512.json --checkpoint $model_1b --counts 1,8
      bench nomps-128 bench/scenarios/gpu_llama1b_128.json --checkpoint $model_1b --counts 1,8
      ;;
    capacity-13b)
      wait_checkpoint $model_13b
      mps_on
      bench capacity-13b bench/scenarios/gpu_llama13b_capacity.json --checkpoint $model_13b
      # The same with PyTorch's expandable segments for every process (HF PEFT's too): less of
      # each job's memory is left in partly used blocks.
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        bench capacity-13b-expandable bench/scenarios/gpu_llama13b_capacity.json --checkpoint $model_13b
      mps_off
      ;;
    capacity-13b-expandable)
      wait_checkpoint $model_13b
      mps_on
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        bench capacity-13b-expandable bench/scenarios/gpu_llama13b_capacity.json --checkpoint $model_13b
      mps_off
      ;;
    remote|remote-1b|remote-13b)
      mps_on
      if [ $stage != remote-13b ]; then
        make_1b
        bench remote-1b bench/scenarios/gpu_remote_llama1b.json --checkpoint $model_1b --counts "${REMOTE_1B_COUNTS:-1,2,4,8}"
      fi
      if [ $stage != remote-1b ]; then
        wait_checkpoint $model_13b
        bench remote-13b bench/scenarios/gpu_remote_llama13b.json --checkpoint $model_13b --counts "${REMOTE_13B_COUNTS:-1,2,4,8}"
      fi
      mps_off
      ;;
    roundtrip-nccl)
      for mps in on off; do
        mps_$mps
        "$B/bench/symbiosis-bench-roundtrip" --executor-device cuda:0 --client-device cuda:1 --dtype bf16 \
          --transports nccl,tcp > "$logs/roundtrip-nccl-mps-$mps.txt" 2>&1
        echo "== MPS $mps"; cat "$logs/roundtrip-nccl-mps-$mps.txt"
      done
      ;;
    nccl-tune)
      make_1b
      mps_on
      IFS=';' read -ra settings <<< "${NCCL_TUNE:--}"
      for setting in "${settings[@]}"; do
        [ "$setting" = "-" ] && setting=""
        tag=$(echo "${setting:-default}" | tr ' =' '_-')
        echo "== NCCL settings: ${setting:-the defaults}"
        for hidden in 2048 8192; do
          env $setting NCCL_DEBUG=INFO NCCL_DEBUG_FILE=$logs/nccl-info-$tag.%p "$B/bench/symbiosis-bench-roundtrip" \
            --executor-device cuda:0 --client-device cuda:1 --dtype bf16 --transports nccl --hidden $hidden \
            --iterations 200 > "$logs/roundtrip-$tag-$hidden.txt" 2>&1
          grep -E "nccl|tokens" "$logs/roundtrip-$tag-$hidden.txt" | sed "s/^/[$hidden] /"
        done
        grep -h "p2p channels" $logs/nccl-info-$tag.* 2>/dev/null | head -2
        ( [ -n "$setting" ] && export $setting
          bench remote-$tag bench/scenarios/gpu_remote_llama1b.json --checkpoint $model_1b --counts "${TUNE_COUNTS:-8}" )
      done
      "$B/bench/symbiosis-bench-roundtrip" --executor-device cuda:0 --client-device cuda:0 --dtype bf16 \
        --transports cuda-ipc --hidden 8192 --iterations 200 > "$logs/roundtrip-ipc-8192.txt" 2>&1
      grep -E "cuda-ipc|tokens" "$logs/roundtrip-ipc-8192.txt" | sed "s/^/[8192 same GPU] /"
      mps_off
      ;;
    sharded)
      run_gtest gpu_executor_test 'Sharded*'
      if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
        "$B/bench/symbiosis-bench-shard-split" --device cuda --parts 2 --dtype bf16 --shapes 5120x5120,13824x5120 \
          --tokens "${SHARD_TOKENS:-1,16,128,512,2048,4096}" --iterations 20 --out "$out/shard-split.json" 2>&1 \
          | grep -v '^\[W' | tee "$out/shard-split.txt"
      fi
      ;;
    sharded-13b)
      # Issue 31's run 2 in one run of bench/sharded_local.py (see its docstring), ~8 minutes: the 13B checkpoint (~1.5-2
      # min; written here unless an earlier stage wrote it or is writing it), then under SHARDED_TIMEOUT_S the sharded
      # executor (each part reads its rows) and one window a count with fresh tenants (~2.5 min), then the FSDP jobs: one
      # alone, then a wave of as many as the memory left fits, a window after each, one more until one fails; no wave
      # starts after SHARDED_FSDP_DEADLINE_S of the FSDP part. A cut-short run still prints what it measured.
      if [ "$gpus" -lt 2 ]; then log "sharded-13b needs 2 GPUs, this machine has $gpus"; continue; fi
      write_checkpoint llama-2-13b $model_13b || continue
      sharded_bench sharded-13b $model_13b --gpus 0,1 --seq 512 --counts "${SHARDED_COUNTS:-2,4,8,16}" \
        --fsdp-batch "${SHARDED_FSDP_BATCH:-2}"
      ;;
    checkpoint-27b)
      # The Gemma-2-27B checkpoint alone (~4 min; started with the script), for a later call's sharded-remote.
      wait_checkpoint $model_27b
      ;;
    sharded-remote)
      # Issue 31's run 3 as sharded-13b runs run 2: Gemma-2-27B shape (random, bf16), LoRA r8 on q,k,v,o, 2 x 64 a step
      # (the paper's Figure 17). The executor's parts on the first half of the GPUs (at most 4), each part's tenants on a
      # GPU of the second half over NCCL, at SHARDED_COUNTS (4,8,16,32) tenants, against FSDP jobs over all of them
      # (SHARDED_FSDP_BATCH: 2 sequences a rank). The paper's run is 4 + 4 GPUs against FSDP over 8.
      if [ "$gpus" -lt 4 ]; then log "sharded-remote needs 4 GPUs, this machine has $gpus"; continue; fi
      half=$(( gpus / 2 > 4 ? 4 : gpus / 2 ))
      # SHARDED_27B_LAYERS: a model of that many of its layers (a quicker run, for comparing settings).
      model=$model_27b${SHARDED_27B_LAYERS:+-$SHARDED_27B_LAYERS-layers}
      write_checkpoint gemma-2-27b $model "${SHARDED_27B_LAYERS:-}" || continue
      # The executor's own batching wait (2 ms): 2 x 64 calls gain from packing more (SH14, SH15).
      SHARDED_MAX_WAIT_US=${SHARDED_MAX_WAIT_US:-2000} sharded_bench sharded-remote $model --gpus "$(seq -s, 0 $((half - 1)))" \
        --client-gpus "$(seq -s, $half $((2 * half - 1)))" --seq 64 --counts "${SHARDED_COUNTS:-4,8,16,32}" \
        --fsdp-batch "${SHARDED_FSDP_BATCH:-$((4 * half))}"
      ;;
    long-context)
      # Issue 28 in one run of symbiosis-bench-long-context against one executor on cuda:0 (its two clients, cuda-ipc
      # and shm, under MPS). The stage must end within about 8 minutes: the checkpoint (~1.5 min, started with the
      # script), the executor's load and the warm-ups (~1 min), the single-request runs under LONG_BUDGET_S (200 s: a
      # run whose estimate, twice its mode's previous context, would pass the budget is reported "skipped"; modes in
      # the order gpu, host, offload, so the offloaded cache's long contexts go first), then the bandwidth probe and the
      # multi-request point (~1.5 min). 16 new tokens by default (15 inter-token intervals; each step at long contexts is
      # long and steady); LONG_NEW_TOKENS=64 for the issue's figure, with a longer budget.
      # Where 128K stops fitting: its cache is 64 GiB in bf16 (0.5 MiB a position), so the all-GPU client fails on an
      # H100 (80 GB: 12.3 GiB of weights in the executor, 64 GiB of cache and the prefill's activations) and fits on an
      # H200; the offloaded cache and host decode hold it in 64 GiB of page-locked host memory of the 128 GiB (under
      # LONG_HOST_CAP, 80 GiB by default, which leaves the rest to the processes and the page cache; 256K would need
      # 128 GiB and does not fit). The offloaded cache moves the whole 64 GiB over PCIe at each token (~2 s), so its
      # 128K run is the one the budget skips first.
      # The host's CPUs (online, affinity, CFS quota, NUMA nodes), its memory bandwidth and the CPU decode attention's
      # (every thread and one) come first, in a few seconds; each host row then gives where its decode step's time
      # goes (the top LONG_PROFILE_OPS operations). The multi-request point decodes LONG_MULTI_NEW_TOKENS (16) steps
      # with every request (LONG_MULTI_MAX requests at most a placement; 0: as many as fit).
      wait_checkpoint $model_7b
      mps_on
      # [Passive OpenMP] (client_runtime/inference/generator.cpp): what a host-decode tenant is started with.
      timeout "${LONG_TIMEOUT_S:-420}" env OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" "$B/bench/symbiosis-bench-long-context" --model $model_7b --dtype bf16 --device cuda:0 \
        --executor-device cuda:0 --contexts "${LONG_CONTEXTS:-4K,8K,16K,32K,64K,128K}" --new-tokens "${LONG_NEW_TOKENS:-16}" \
        --modes "${LONG_MODES:-gpu,host,offload}" --host-cache-capacity-bytes "${LONG_HOST_CAP:-85899345920}" \
        --budget-s "${LONG_BUDGET_S:-200}" --multi-request "${LONG_MULTI:-true}" \
        --multi-new-tokens "${LONG_MULTI_NEW_TOKENS:-16}" --multi-max-requests "${LONG_MULTI_MAX:-0}" \
        --profile-ops "${LONG_PROFILE_OPS:-12}" --out /tmp/long-context \
        > $logs/long-context.txt 2> $logs/long-context.err
      log "long-context exited $?"
      # Cut short by the timeout, it leaves its executor running: stop it.
      kill "$(cat /tmp/long-context/executor.pid 2> /dev/null)" 2> /dev/null
      cat /tmp/long-context/long_context.md 2> /dev/null || cat /tmp/long-context/long_context.csv
      grep -E "^(CPUs|host memory|CPU decode attention)" $logs/long-context.err
      grep -vE "^(\[W|CPUs|host memory|CPU decode attention)" $logs/long-context.err | tail -40
      cp /tmp/long-context/long_context.csv /tmp/long-context/long_context.md $logs/long-context.err "$out/" 2> /dev/null
      mps_off
      ;;
    soak)
      # The soak with churn on the GPU (docs/benchmarks.md, "Soak with churn"): 64 tenant processes, a third each
      # over cuda-ipc (their models on cuda:0), shm and tcp (on the CPU), join, leave, are killed and come back for
      # SOAK_SECONDS (450: a device command runs at most 600 s) on one executor on cuda:0, under MPS (SOAK_TRANSPORTS, SOAK_CLIENTS and SOAK_BATCHING
      # choose others; MPS takes at most 48 clients of a GPU). Exactness is held to SOAK_TOLERANCE (1e-3: logits and
      # loss) and SOAK_GRADIENT_TOLERANCE (1e-2: adapter gradients, of the step's largest), not the CPU soak's 1e-5:
      # the executor's GEMM for a packed batch (or the GPU's against a CPU client's reference) reduces in another
      # order, and this model amplifies that up to 6.4e-3 in gradients as it trains ([Soak exactness] in
      # bench/soak_client.cpp). A wrong result (another call's rows, a stale buffer) is off by the values themselves.
      # The GPU's memory is nvidia-smi's for the whole GPU (the MPS server's included): 128 MiB of slack.
      mps_on
      "$B/bench/symbiosis-soak" --device cuda:0 --transports "${SOAK_TRANSPORTS:-cuda-ipc,shm,tcp}" --clients "${SOAK_CLIENTS:-64}" \
        --batching "${SOAK_BATCHING:-opportunistic}" \
        --seconds "${SOAK_SECONDS:-450}" --max-call-ms 10000 --tolerance "${SOAK_TOLERANCE:-1e-3}" --gradient-tolerance "${SOAK_GRADIENT_TOLERANCE:-1e-2}" \
        --gpu-tolerance-mib 128 --out /tmp/soak-gpu > $logs/soak.txt 2>&1
      rc=$?
      log "soak exited $rc"
      tail -12 $logs/soak.txt
      cp $logs/soak.txt "$out/soak.txt"
      cp /tmp/soak-gpu/executor_memory.csv "$out/soak-executor-memory.csv" 2> /dev/null
      if [ $rc != 0 ]; then  # a failed client's logs are kept
        for f in $(ls /tmp/soak-gpu/clients/*.err 2> /dev/null | head -6) /tmp/soak-gpu/executor.err; do
          [ -s "$f" ] && { echo "== $f"; tail -6 "$f"; }
        done
      fi
      mps_off
      ;;
    python-generate)
      python_package || continue
      mps_on
      python3 bench/python_generate.py --build "$B" --preset llama-3.2-1b --dtype bf16 --device cuda:0 \
        --prompts "${PYGEN_PROMPTS:-8}" --prompt-tokens 512 --new-tokens 128 --out "$out/python-generate.json" \
        > $logs/python-generate.txt 2>&1
      log "python-generate exited $?"
      grep -E "tokens/s|Error|error" $logs/python-generate.txt | tail -8
      mps_off
      ;;
    python)
      python_package || continue
      mps_on
      # PYTEST_K: only the GPU tests whose names match (pytest -k).
      ( cd tests/python && timeout 300 python3 -m pytest -q -p no:cacheprovider -rs ${PYTEST_K:+-k "$PYTEST_K"} test_gpu.py ) \
        > $logs/python-gpu.txt 2>&1
      rc=$?
      log "python GPU tests exited $rc: $(tail -1 $logs/python-gpu.txt)"
      grep -E "^(FAILED|ERROR|SKIPPED)|Error:|assert " $logs/python-gpu.txt | head -20
      [ $rc = 0 ] || cp $logs/python-gpu.txt "$out/"
      mps_off
      if [ "${PYTHON_CPU_SUITE:-1}" != 0 ]; then
        # One test at a time per worker; each starts its own executors on free ports.
        workers=""
        python3 -c 'import xdist' 2> /dev/null && workers="-n 8"
        ( cd tests/python && timeout 420 python3 -m pytest -q -p no:cacheprovider $workers --ignore=test_gpu.py . ) \
          > $logs/python-cpu.txt 2>&1
        rc=$?
        log "python CPU suite exited $rc: $(tail -1 $logs/python-cpu.txt)"
        grep -E "^(FAILED|ERROR)" $logs/python-cpu.txt | head -20
        [ $rc = 0 ] || cp $logs/python-cpu.txt "$out/"
      fi
      ;;
    serve-bench)
      # symbiosis-serve through its HTTP API (bench/serve_bench.py): 64 streamed completions over 8 adapters, split
      # against monolithic, on multi-lora's model and adapters (run that stage first).
      python_package || continue
      mps_on
      timeout 400 python3 bench/serve_bench.py --build "$B" --model /tmp/multi-lora/model-llama-3.2-1b-bf16 \
        --adapters $(for i in 0 1 2 3 4 5 6 7; do echo /tmp/multi-lora/adapters/$i; done) --device cuda:0 --dtype bf16 \
        ${SERVE_BENCH_FLAGS:+--server-flags="$SERVE_BENCH_FLAGS"} --out "$out/serve-bench.json" > $logs/serve-bench.txt 2>&1
      log "serve-bench exited $?: $(grep -E '^(split|monolithic) ' $logs/serve-bench.txt | cut -c1-200)"
      mps_off
      ;;
    tinker-rl)
      # symbiosis-tinker (issue 48, bench/tinker_rl.py): TINKER_RUNS (1,4,8) concurrent RL runs of the tinker SDK on
      # Llama-3.2-1B (bf16, LoRA r16) against as many one after another; needs the wheels in .whl (tinker, ...).
      make_1b
      python_package || continue
      mps_on
      timeout "${TINKER_TIMEOUT_S:-420}" python3 bench/tinker_rl.py --build "$B" --model $model_1b --runs "${TINKER_RUNS:-1,4,8}" ${TINKER_FLAGS:-} \
        --device cuda:0 --dtype bf16 --out "$out/tinker-rl.json" > $logs/tinker-rl.txt 2>&1
      log "tinker-rl exited $?: $(grep -E '^\{"runs"' $logs/tinker-rl.txt | cut -c1-220)"
      [ -f "$out/tinker-rl.json" ] || tail -30 $logs/tinker-rl.txt
      mps_off
      ;;
    python-13b)
      python_package || continue
      wait_checkpoint $model_13b
      mps_on
      gc=""
      [ "${PY13B_GC:-0}" = 1 ] && gc="--gradient-checkpointing"
      graph=""
      [ "${PY13B_CPP_GRAPH:-0}" = 1 ] && graph="--cpp-cuda-graph"
      timeout "${PY13B_TIMEOUT_S:-420}" python3 bench/python_tenants.py --model $model_13b --build "$B" --out /tmp/python-13b \
        --device cuda:0 --dtype bf16 --batch 2 --seq 512 --rank 8 --targets q_proj,k_proj,v_proj,o_proj --warmup 2 \
        --limit "${PY13B_LIMIT:-24}" --wave "${PY13B_WAVE:-4}" --plain-limit "${PY13B_PLAIN_LIMIT:-8}" --window-s "${PY13B_WINDOW_S:-6}" $gc $graph \
        > $logs/python-13b.txt 2> $logs/python-13b.err
      log "python-13b exited $?"
      cat $logs/python-13b.txt
      grep "python_tenants" $logs/python-13b.err | tail -12
      cp /tmp/python-13b/python_tenants.json "$out/python-13b${gc:+-gc}.json" 2> /dev/null
      cp $logs/python-13b.err "$out/python-13b${gc:+-gc}.err"
      mps_off
      ;;
    *) log "unknown stage $stage" ;;
  esac
done
log "done"
