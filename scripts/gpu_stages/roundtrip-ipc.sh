# stages: roundtrip-ipc
# roundtrip-ipc  the CUDA IPC round trip alone under MPS (direct operands, then through the buffer),
#                three runs, with the host time of its parts
mps_on
for run in 1 2 3; do
  "$B/bench/symbiosis-bench-roundtrip" --executor-device cuda:0 --client-device cuda:0 --dtype bf16 \
    --transports cuda-ipc,cuda-ipc-buffer --primitives > "$logs/roundtrip-ipc-$run.txt" 2>&1
  rc=$?
  cat "$logs/roundtrip-ipc-$run.txt"
  [ $rc = 0 ] || log "roundtrip-ipc run $run FAILED: exit status $rc"
done
mps_off
