# stages: capacity-13b
# capacity-13b   how many Llama-2-13B fine-tuning clients fit, against Hugging Face PEFT jobs, with
#                PyTorch's default allocator settings and then with expandable segments (every process)
wait_checkpoint $model_13b
mps_on
bench capacity-13b bench/scenarios/gpu_llama13b_capacity.json --checkpoint $model_13b
# The same with PyTorch's expandable segments for every process (HF PEFT's too): less of
# each job's memory is left in partly used blocks.
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  bench capacity-13b-expandable bench/scenarios/gpu_llama13b_capacity.json --checkpoint $model_13b
mps_off
