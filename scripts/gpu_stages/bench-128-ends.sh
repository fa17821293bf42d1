# stages: bench-128-ends
# bench-128-ends the same at N = 1 and 8 only
make_1b
mps_on
bench 128 bench/scenarios/gpu_llama1b_128.json --checkpoint $model_1b --counts 1,8
mps_off
