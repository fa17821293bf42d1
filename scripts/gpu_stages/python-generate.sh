# stages: python-generate
# python-generate  a Python tenant's generation, symbiosis.Generator (split and monolithic) against transformers +
#                PEFT generate (bench/python_generate.py: Llama-3.2-1B, bf16, 8 prompts of 512 + 128 tokens), under MPS
python_package || return
mps_on
python3 bench/python_generate.py --build "$B" --preset llama-3.2-1b --dtype bf16 --device cuda:0 \
  --prompts "${PYGEN_PROMPTS:-8}" --prompt-tokens 512 --new-tokens 128 --out "$out/python-generate.json" \
  > $logs/python-generate.txt 2>&1
log "python-generate exited $?"
grep -E "tokens/s|Error|error" $logs/python-generate.txt | tail -8
mps_off
