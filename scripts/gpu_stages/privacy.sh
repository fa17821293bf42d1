# stages: privacy
# privacy        noise masking: its kernels' tests and gpu_privacy_test (masked captured steps and decode,
#                the bf16 error), under MPS
mps_on
run_gtest kernels_test 'NoiseMask*'
run_gtest gpu_privacy_test
grep "bf16 error" $logs/gpu_privacy_test.log
mps_off
