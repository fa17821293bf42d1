# stages: trace-generate
# trace-generate where one 1B inference tenant's GPU time goes (Kineto trace of 3 generations of 8 x (512 + 128)
#                tokens, decode captured), split (CUDA IPC) and monolithic, under MPS
each_single_client trace_generate_client "8 512"
