# stages: python-13b
# python-13b     issue 29's benchmark (bench/python_tenants.py): Llama-2-13B shape (random, bf16), LoRA r8 on q,k,v,o,
#                2 x 512: how many Python tenants (transformers + PEFT over Symbiosis) fit against plain transformers +
#                PEFT jobs (the same script with its own base), and their tokens/s against as many C++ tenants; under
#                MPS. PY13B_GC=1: gradient checkpointing in every Python job; PY13B_LIMIT (24), PY13B_WAVE (4), PY13B_PLAIN_LIMIT
#                (8; 0 skips the plain jobs), PY13B_WINDOW_S (6), PY13B_CPP_GRAPH=1 (captured C++ tenants),
#                PY13B_TIMEOUT_S (420: the run is stopped, its clients killed, what it measured written)
python_package || return
wait_checkpoint $model_13b
mps_on
gc=""
[ "${PY13B_GC:-0}" = 1 ] && gc="--gradient-checkpointing"
graph=""
[ "${PY13B_CPP_GRAPH:-0}" = 1 ] && graph="--cpp-cuda-graph"
timeout "${PY13B_TIMEOUT_S:-420}" python3 bench/python_tenants.py --model $model_13b --build "$B" --out /tmp/python-13b \
  --device cuda:0 --dtype bf16 --batch 2 --seq 512 --rank 8 --targets q_proj,k_proj,v_proj,o_proj --warmup 2 \
  --limit "${PY13B_LIMIT:-24}" --wave "${PY13B_WAVE:-4}" --plain-limit "${PY13B_PLAIN_LIMIT:-8}" --window-s "${PY13B_WINDOW_S:-6}" $gc $graph \
  > $logs/python-13b.txt 2> $logs/python-13b.err
log "python-13b exited $?"
cat $logs/python-13b.txt
grep "python_tenants" $logs/python-13b.err | tail -12
cp /tmp/python-13b/python_tenants.json "$out/python-13b${gc:+-gc}.json" 2> /dev/null
cp $logs/python-13b.err "$out/python-13b${gc:+-gc}.err"
mps_off
