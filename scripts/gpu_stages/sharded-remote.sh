# stages: sharded-remote
# sharded-remote issue 31's run 3 (bench/sharded_local.py --client-gpus; 4 GPUs or more): Gemma-2-27B shape, 2 x 64 a
#                step, the executor's parts on the first half of the GPUs (at most 4) and their tenants on the second
#                half over NCCL, against FSDP + PEFT jobs over all of them; the SHARDED_* settings as sharded-13b,
#                SHARDED_MAX_WAIT_US 2000 by default, and SHARDED_27B_LAYERS: a model of that many layers only
#                (quicker, to compare settings)
# Issue 31's run 3 as sharded-13b runs run 2: Gemma-2-27B shape (random, bf16), LoRA r8 on q,k,v,o, 2 x 64 a step
# (the paper's Figure 17). The executor's parts on the first half of the GPUs (at most 4), each part's tenants on a
# GPU of the second half over NCCL, at SHARDED_COUNTS (4,8,16,32) tenants, against FSDP jobs over all of them
# (SHARDED_FSDP_BATCH: 2 sequences a rank). The paper's run is 4 + 4 GPUs against FSDP over 8.
if [ "$gpus" -lt 4 ]; then log "sharded-remote needs 4 GPUs, this machine has $gpus"; return; fi
half=$(( gpus / 2 > 4 ? 4 : gpus / 2 ))
# SHARDED_27B_LAYERS: a model of that many of its layers (a quicker run, for comparing settings).
model=$model_27b${SHARDED_27B_LAYERS:+-$SHARDED_27B_LAYERS-layers}
write_checkpoint gemma-2-27b $model "${SHARDED_27B_LAYERS:-}" || return
# The executor's own batching wait (2 ms): 2 x 64 calls gain from packing more (SH14, SH15).
SHARDED_MAX_WAIT_US=${SHARDED_MAX_WAIT_US:-2000} sharded_bench sharded-remote $model --gpus "$(seq -s, 0 $((half - 1)))" \
  --client-gpus "$(seq -s, $half $((2 * half - 1)))" --seq 64 --counts "${SHARDED_COUNTS:-4,8,16,32}" \
  --fsdp-batch "${SHARDED_FSDP_BATCH:-$((4 * half))}"
