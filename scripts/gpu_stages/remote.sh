# stages: remote remote-1b remote-13b
# remote         clients on GPU 1, executor on GPU 0 (NCCL), against local placement (2 GPUs)
# remote-1b      the same, Llama-3.2-1B only;  remote-13b: Llama-2-13B only (counts: REMOTE_1B_COUNTS,
#                REMOTE_13B_COUNTS)
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
