# stages: privacy-nccl
# privacy-nccl   a masked tenant on GPU 1 over NCCL (then with effects here), fp32 and captured-free, against its
#                monolithic run (demo client --verify, 5e-4), executor on GPU 0 (2 GPUs)
mps_on
"$B/tools/symbiosis-make-checkpoint" --preset tiny-llama --out /tmp/tiny-llama > /dev/null
start_executor $logs/privacy-nccl-executor.log --model /tmp/tiny-llama --device cuda:0 \
  --listen tcp://127.0.0.1:5791 --log-level warn || { mps_off; return; }
for mode in --mask --mask-effects-here; do
  "$B/examples/symbiosis-demo-client" --executor tcp://127.0.0.1:5791 --model /tmp/tiny-llama --device cuda:1 \
    --transport nccl $mode --verify --tolerance 5e-4 --steps 3 --tenant "nccl$mode" 2>&1 | tail -2
  log "masked over nccl ($mode): exit status ${PIPESTATUS[0]}"
done
kill $executor_pid
mps_off
