# stages: serve-bench
# serve-bench    symbiosis-serve over HTTP (bench/serve_bench.py, the openai client in SERVE_BENCH_CLIENTS processes, 8): 64 streams over 8 adapters, split
#                against --monolithic, on multi-lora's model and adapters; needs the wheels in .whl (fastapi, openai, ...);
#                SERVE_BENCH_FLAGS: more of symbiosis-serve's flags (e.g. --no-capture-decode)
python_package || return
mps_on
timeout 400 python3 bench/serve_bench.py --build "$B" --model /tmp/multi-lora/model-llama-3.2-1b-bf16 \
  --adapters $(for i in 0 1 2 3 4 5 6 7; do echo /tmp/multi-lora/adapters/$i; done) --device cuda:0 --dtype bf16 \
  --client-processes "${SERVE_BENCH_CLIENTS:-8}" ${SERVE_BENCH_FLAGS:+--server-flags="$SERVE_BENCH_FLAGS"} \
  --out "$out/serve-bench.json" > $logs/serve-bench.txt 2>&1
log "serve-bench exited $?: $(grep -E '^(split|monolithic) ' $logs/serve-bench.txt | cut -c1-200)"
mps_off
