# stages: mixed
# mixed          cuda_ipc_test's clients of every transport on one executor, three times (1 GPU, MPS)
mps_on
for run in 1 2 3; do run_gtest cuda_ipc_test '*MixedTransports*'; done
mps_off
