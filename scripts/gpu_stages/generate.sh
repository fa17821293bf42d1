# stages: generate
# generate       gpu_generator_test, then decode with N = 1, 2, 4, 8 (or COUNTS) inference tenants of 8
#                sequences (512 + 128 tokens, Llama-3.2-1B, bf16) against N monolithic processes, one
#                monolithic process of all 8 x N_MAX sequences, and HF PEFT generate with N_MAX adapters
#                in one mixed batch (N_MAX: the largest count), under MPS
mps_on
run_gtest gpu_generator_test
make_1b
counts=${COUNTS:-1,2,4,8}
bench generate bench/scenarios/gpu_generate_llama1b.json --checkpoint $model_1b --counts "$counts"
n=${counts##*,}
shape="--mode generate --model $model_1b --batch $((8 * n)) --seq 512 --new-tokens 128 --rank 8 \
  --targets q_proj,k_proj,v_proj,o_proj --device cuda:0 --dtype bf16 --warmup 1 --iterations 2"
"$B/bench/symbiosis-bench-client" --monolithic --cuda-graph $shape --out $out/generate-one-process.json \
  > $logs/generate-one-process.log 2>&1 || tail -5 $logs/generate-one-process.log
python3 bench/hf_peft_client.py $shape --adapters $n --out $out/generate-hf-peft.json \
  > $logs/generate-hf-peft.log 2>&1 || tail -5 $logs/generate-hf-peft.log
python3 - $out/generate-one-process.json $out/generate-hf-peft.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
  r = json.load(open(path))
    except OSError:
  continue
    extra = {k: round(v * 1e3, 2) for k, v in r.items() if k.endswith("_s") and "token" in k}
    print(f"{path.split('/')[-1]}: {r['tokens_per_s']:.0f} output tokens/s, batch {r['batch']}, ms: {extra}")
PY
mps_off
