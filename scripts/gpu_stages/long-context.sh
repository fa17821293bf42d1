# stages: long-context
# long-context   issue 28 (symbiosis-bench-long-context; docs/benchmarks.md, "Long context"): Llama-2-7B shape, bf16
#                random weights, batch 1, inter-token latency of the all-GPU client, host decode (GPU prefill, host
#                cache, CPU decode) and the offloaded cache at LONG_CONTEXTS (4K..128K) with LONG_NEW_TOKENS (16) new
#                tokens; CPU decode attention against the host's memory bandwidth; the multi-request point (1K-token
#                requests on the CPU until LONG_HOST_CAP bytes, on the GPU until its memory is full), under MPS
# Issue 28 in one run of symbiosis-bench-long-context against one executor on cuda:0 (its two clients, cuda-ipc
# and shm, under MPS). The stage must end within about 8 minutes: the checkpoint (~1.5 min, started with the
# script), the executor's load and the warm-ups (~1 min), the single-request runs under LONG_BUDGET_S (200 s: a
# run whose estimate, twice its mode's previous context, would pass the budget is reported "skipped"; modes in
# the order gpu, host, offload, so the offloaded cache's long contexts go first), then the bandwidth probe and the
# multi-request point (~1.5 min). 16 new tokens by default (15 inter-token intervals; each step at long contexts is
# long and steady); LONG_NEW_TOKENS=64 for the figure, with a longer budget.
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
