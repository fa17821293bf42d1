# stages: table5
# table5         8 inference tenants of batches 2 to 256, two LoRA shapes, under none, lockstep and
#                opportunistic (Llama-2-7B shape, bf16, MPS; the paper's Table 5)
wait_checkpoint $model_7b
mps_on
bench table5 bench/scenarios/gpu_table5_llama7b.json --checkpoint $model_7b
mps_off
