# stages: decode-halves
# decode-halves  [Decode halves] and [Served tied head]: the halves' GPU test (gpu_generator_test's
#                *Halves*), then 8 (or COUNTS; 1 for TPOT) decode tenants as in generate, each
#                step launched alone or together, whole or in halves, the tied head local or served
#                (gpu_decode_halves_llama1b.json), against N monolithic processes
mps_on
run_gtest gpu_generator_test '*Halves*'
make_1b
bench decode-halves bench/scenarios/gpu_decode_halves_llama1b.json --checkpoint $model_1b --counts "${COUNTS:-8}"
mps_off
