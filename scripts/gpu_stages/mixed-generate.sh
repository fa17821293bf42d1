# stages: mixed-generate
# mixed-generate 6 inference tenants (8 x (512 + 128) tokens each) and 2 fine-tuning tenants (2 x 512) on one
#                executor, against each group alone (Llama-3.2-1B, bf16, MPS; the paper's 4.4)
make_1b
mps_on
bench mixed-generate bench/scenarios/gpu_mixed_llama1b.json --checkpoint $model_1b
mps_off
