# stages: capacity-13b-expandable
# capacity-13b-expandable  the second of those alone
wait_checkpoint $model_13b
mps_on
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  bench capacity-13b-expandable bench/scenarios/gpu_llama13b_capacity.json --checkpoint $model_13b
mps_off
