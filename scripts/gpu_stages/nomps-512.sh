# stages: nomps-512
# nomps-512      batch 2 x 512 at N = 8 without MPS
make_1b
mps_off
bench nomps-512 bench/scenarios/gpu_llama1b_512.json --checkpoint $model_1b --counts 8
