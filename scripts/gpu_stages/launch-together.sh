# stages: launch-together
# launch-together [Runs launched together]: N = 2, 4, 8 (or COUNTS) decode tenants as in generate, their steps launched
#                together (waiting 1 ms, then 4 ms) or each alone, against N monolithic processes
make_1b
mps_on
bench launch-together bench/scenarios/gpu_launch_together_llama1b.json --checkpoint $model_1b --counts "${COUNTS:-2,4,8}"
mps_off
