# stages: launch-together
# launch-together [Runs launched together]: 8 and 16 (or COUNTS) decode tenants as in generate, each step launched
#                alone, all ready steps together (the default), and in launches of at most 4 and of 2 tenants
#                (--launch-together-max), against N monolithic processes
make_1b
mps_on
bench launch-together bench/scenarios/gpu_launch_together_llama1b.json --checkpoint $model_1b --counts "${COUNTS:-8,16}"
mps_off
