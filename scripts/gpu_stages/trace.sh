# stages: trace
# trace          where one 1B client's GPU time goes (Kineto trace of 3 captured iterations, summed by kernel
#                with bench/trace_summary.py): split and monolithic, batch 2 x 512 and 1 x 128, under MPS
each_single_client trace_client
