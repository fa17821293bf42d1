# stages: loss
# loss           the client's loss, fused against the fp32 copy and ATen's (symbiosis-bench-loss),
#                at 2 x 512 and 1 x 128 tokens of Llama 3's vocabulary, bf16
for tokens in 1024 128; do "$B/bench/symbiosis-bench-loss" --tokens $tokens; done
