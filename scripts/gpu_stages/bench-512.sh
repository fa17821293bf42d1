# stages: bench-512 bench-128
# bench-512      Llama-3.2-1B, batch 2 x 512, N = 1, 2, 4, 8 (or COUNTS), against both baselines, under MPS
# bench-128      the same at batch 1 x 128
make_1b
mps_on
bench "${stage#bench-}" "bench/scenarios/gpu_llama1b_${stage#bench-}.json" --checkpoint $model_1b \
  --counts "${COUNTS:-1,2,4,8}"
mps_off
