# stages: generator
# generator      gpu_generator_test alone, under MPS
mps_on
run_gtest gpu_generator_test
mps_off
