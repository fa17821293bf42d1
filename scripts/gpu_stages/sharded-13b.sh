# stages: sharded-13b
# sharded-13b    issue 31's run 2 (bench/sharded_local.py; 2 GPUs): Llama-2-13B shape (random, bf16), LoRA r8 on q,k,v,o,
#                2 x 512 a step. Symbiosis sharded-local (one executor part a GPU, tenants on both GPUs, each over cuda-ipc
#                to its GPU's part) at SHARDED_COUNTS (2,4,8,16) tenants, against FSDP + PEFT jobs (bench/fsdp_peft.py, each
#                over both GPUs) started in waves until one runs out of memory: adapters at once and aggregate tokens/s,
#                under MPS (SHARDED_MPS=0: without). SHARDED_WINDOW_S (10), SHARDED_FSDP_BATCH (2: sequences an FSDP step,
#                both ranks together), SHARDED_FSDP_LIMIT (8; 0 skips FSDP), SHARDED_SKIP_SYMBIOSIS=1, SHARDED_CUDA_GRAPH=1,
#                SHARDED_FSDP_DEADLINE_S (170), SHARDED_TIMEOUT_S (360); PYTORCH_CUDA_ALLOC_CONF reaches every process;
#                SHARDED_PARTS_BY_HAND=1: each part its own process on a GPU seen alone (CUDA_VISIBLE_DEVICES), not --gpus;
#                SHARDED_BATCHING (opportunistic) and SHARDED_MAX_WAIT_US (150): the executor's batching
# Issue 31's run 2 in one run of bench/sharded_local.py (see its docstring), ~8 minutes: the 13B checkpoint (~1.5-2
# min; written here unless an earlier stage wrote it or is writing it), then under SHARDED_TIMEOUT_S the sharded
# executor (each part reads its rows) and one window a count with fresh tenants (~2.5 min), then the FSDP jobs: one
# alone, then a wave of as many as the memory left fits, a window after each, one more until one fails; no wave
# starts after SHARDED_FSDP_DEADLINE_S of the FSDP part. A cut-short run still prints what it measured.
if [ "$gpus" -lt 2 ]; then log "sharded-13b needs 2 GPUs, this machine has $gpus"; return; fi
write_checkpoint llama-2-13b $model_13b || return
sharded_bench sharded-13b $model_13b --gpus 0,1 --seq 512 --counts "${SHARDED_COUNTS:-2,4,8,16}" \
  --fsdp-batch "${SHARDED_FSDP_BATCH:-2}"
