# stages: table5
# table5         8 inference tenants of batches 2 to 256, two LoRA shapes, under none, lockstep and
#                opportunistic (Llama-2-7B shape, bf16, MPS; the paper's Table 5); TABLE5_PATCH: JSON merged
#                over the scenario's top level, as `patched` does
wait_checkpoint $model_7b
mps_on
patch_scenario bench/scenarios/gpu_table5_llama7b.json "${TABLE5_PATCH:-{\}}" > /tmp/table5.json
bench table5 /tmp/table5.json --checkpoint $model_7b
mps_off
