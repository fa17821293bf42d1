# stages: roundtrip
# roundtrip      per-layer round trip of each transport, with and without MPS
for mps in on off; do
  mps_$mps
  "$B/bench/symbiosis-bench-roundtrip" --executor-device cuda:0 --client-device cuda:0 --dtype bf16 \
    --transports cuda-ipc,tcp --primitives > "$logs/roundtrip-gpu-mps-$mps.txt" 2>&1
  cat "$logs/roundtrip-gpu-mps-$mps.txt"
done
"$B/bench/symbiosis-bench-roundtrip" --executor-device cuda:0 --client-device cpu --dtype fp32 \
  --transports shm,tcp --iterations 100 > "$logs/roundtrip-cpu-client.txt" 2>&1
cat "$logs/roundtrip-cpu-client.txt"
if [ "$gpus" -ge 2 ]; then
  "$B/bench/symbiosis-bench-roundtrip" --executor-device cuda:0 --client-device cuda:1 --dtype bf16 \
    --transports nccl,tcp > "$logs/roundtrip-nccl.txt" 2>&1
  cat "$logs/roundtrip-nccl.txt"
fi
