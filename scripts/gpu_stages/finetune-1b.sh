# stages: finetune-1b
# finetune-1b    symbiosis-finetune on Llama-3.2-1B (bf16, LoRA r 16 on q/k/v/o, 4 x up to 512 tokens a step, 40 steps):
#                split captured, split eager (--no-capture) and monolithic captured; tokens/s over the run, under MPS
make_1b
mps_on
python3 -c "
import json, random
r = random.Random(7)
for _ in range(256):
    print(json.dumps({'input_ids': [r.randrange(128256) for _ in range(r.randrange(256, 513))]}))" > /tmp/finetune-1b.jsonl
start_executor $logs/finetune-1b-executor.log --model $model_1b --device cuda:0 --dtype bf16 \
  --listen tcp://127.0.0.1:5792 --log-level warn || { mps_off; return; }
for run in "split --executor tcp://127.0.0.1:5792" "split-eager --executor tcp://127.0.0.1:5792 --no-capture" \
           "monolithic --monolithic"; do
  set -- $run
  name=$1
  shift
  "$B/examples/symbiosis-finetune" --model $model_1b "$@" --device cuda:0 --dtype bf16 --train /tmp/finetune-1b.jsonl \
    --lora-r 16 --lora-targets q_proj,k_proj,v_proj,o_proj --steps 40 --micro-batch 4 --max-length 512 --lr 1e-4 \
    > $logs/finetune-1b-$name.out 2> $logs/finetune-1b-$name.err
  log "finetune-1b $name: exit $?; $(tail -1 $logs/finetune-1b-$name.err | grep -o 'loss [0-9.]*.*tok/s'); $(tail -1 $logs/finetune-1b-$name.out)"
done
kill $executor_pid
mps_off
