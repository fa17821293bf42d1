# stages: multi-lora
# multi-lora     [Multi-adapter batches] (bench/multi_lora.cpp): 64 requests of 512 + 128 tokens over ADAPTERS (1,8,32)
#                adapters in one generator, against the one-process bound, separate tenants, a monolithic generator,
#                transformers + PEFT, and beside two fine-tuning tenants (Llama-3.2-1B, bf16, LoRA r16), under MPS
#                (MULTI_LORA_FLAGS: the bench's flags after those, default '--python python3 --finetune-tenants 2';
#                MULTI_LORA_EXECUTOR_FLAGS: the executor's, e.g. '--finetune-sm-percent 25'),
#                stopped after MULTI_LORA_TIMEOUT seconds (500) so that what it printed comes back
mps_on
timeout "${MULTI_LORA_TIMEOUT:-500}" "$B/bench/symbiosis-bench-multi-lora" --preset llama-3.2-1b --dtype bf16 --adapters "${ADAPTERS:-1,8,32}" \
  --requests 64 --prompt 512 --new-tokens 128 --rank 16 ${MULTI_LORA_FLAGS:---python python3 --finetune-tenants 2} \
  ${MULTI_LORA_EXECUTOR_FLAGS:+--executor-flags "$MULTI_LORA_EXECUTOR_FLAGS"} \
  --out /tmp/multi-lora > $logs/multi-lora.txt 2>&1 \
  || { tail -5 $logs/multi-lora.txt; grep -v " info\]" /tmp/multi-lora/executor/executor.err | tail -5; }
cp /tmp/multi-lora/multi_lora.csv "$out/" 2> /dev/null && cat /tmp/multi-lora/multi_lora.csv
mps_off
