# stages: sharded
# sharded        the sharded executor ([Parts] in base_executor/parts.h): gpu_executor_test's Sharded* (one part on
#                cuda:0; with 2 GPUs two parts, clients on both), then with 2 GPUs symbiosis-bench-shard-split over
#                NCCL: Llama-2-13B's layers in bf16, tensor-parallel against FSDP-style calls at SHARD_TOKENS tokens
run_gtest gpu_executor_test 'Sharded*'
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  "$B/bench/symbiosis-bench-shard-split" --device cuda --parts 2 --dtype bf16 --shapes 5120x5120,13824x5120 \
    --tokens "${SHARD_TOKENS:-1,16,128,512,2048,4096}" --iterations 20 --out "$out/shard-split.json" 2>&1 \
    | grep -v '^\[W' | tee "$out/shard-split.txt"
fi
