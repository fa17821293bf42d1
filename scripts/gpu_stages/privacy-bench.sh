# stages: privacy-bench
# privacy-bench  masking on against off (Llama-3.2-1B, bf16, N = 8: fine-tuning at 2 x 512 and 1 x 128 and
#                decode, effects at the executor and here; decode over tcp at N = 1 and 8), under MPS
mps_on
make_1b
bench privacy-512 bench/scenarios/gpu_privacy_llama1b.json --checkpoint $model_1b
bench privacy-128 bench/scenarios/gpu_privacy_llama1b_128.json --checkpoint $model_1b
bench privacy-generate bench/scenarios/gpu_privacy_generate_llama1b.json --checkpoint $model_1b
bench privacy-tcp bench/scenarios/gpu_privacy_tcp_llama1b.json --checkpoint $model_1b
mps_off
