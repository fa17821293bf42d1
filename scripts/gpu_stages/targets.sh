# stages: targets targets-512 targets-128
# targets        issue 4's target points under MPS: batch 2 x 512 at N = 1 and 8, batch 1 x 128 at N = 8
#                (targets-512 and targets-128: one shape each); our clients with captured steps and eager
make_1b
mps_on
[ $stage != targets-128 ] && bench 512 bench/scenarios/gpu_llama1b_512.json --checkpoint $model_1b --counts 1,8
[ $stage != targets-512 ] && bench 128 bench/scenarios/gpu_llama1b_128.json --checkpoint $model_1b --counts 8
mps_off
