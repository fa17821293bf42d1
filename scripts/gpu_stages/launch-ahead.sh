# stages: launch-ahead
# launch-ahead   [Steps launched ahead]: N = 1, 2, 4, 8 (or COUNTS) decode tenants as in generate, their steps
#                launched ahead or taken up call by call, against N monolithic processes
make_1b
mps_on
bench launch-ahead bench/scenarios/gpu_launch_ahead_llama1b.json --checkpoint $model_1b --counts "${COUNTS:-1,2,4,8}"
mps_off
