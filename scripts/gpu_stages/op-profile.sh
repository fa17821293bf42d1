# stages: op-profile
# op-profile     where one 1B client's host time goes ([Op profile] in bench/op_profile.h): split
#                (CUDA IPC) and monolithic, batch 2 x 512 and 1 x 128, under MPS
each_single_client op_profile_client
