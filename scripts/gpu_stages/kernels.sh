# stages: kernels
# kernels        gpu_executor_test and kernels_test (the executor's GEMMs, the packing kernel, the fused loss, ...)
mps_on
run_gtest gpu_executor_test
run_gtest kernels_test
mps_off
