# stages: mixed-generate
# mixed-generate 6 inference tenants (8 x (512 + 128) tokens each) and 2 fine-tuning tenants (2 x 512) on one
#                executor, against each group alone (Llama-3.2-1B, bf16, MPS; the paper's 4.4); MIXED_PATCH:
#                JSON merged over the scenario's top level, as `patched` does (its executor settings apply
#                to each group alone too)
make_1b
mps_on
patch_scenario bench/scenarios/gpu_mixed_llama1b.json "${MIXED_PATCH:-{\}}" > /tmp/mixed.json
bench mixed-generate /tmp/mixed.json --checkpoint $model_1b
mps_off
