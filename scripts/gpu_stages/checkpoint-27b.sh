# stages: checkpoint-27b
# checkpoint-27b the Gemma-2-27B shape's checkpoint (random, bf16, ~54 GB, ~4 min) for a later call's sharded-remote
wait_checkpoint $model_27b
