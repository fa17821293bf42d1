# stages: bench-nomps
# bench-nomps    both shapes at N = 1 and 8, every process without MPS
make_1b
mps_off
bench nomps-512 bench/scenarios/gpu_llama1b_512.json --checkpoint $model_1b --counts 1,8
bench nomps-128 bench/scenarios/gpu_llama1b_128.json --checkpoint $model_1b --counts 1,8
