# stages: roundtrip-nccl
# roundtrip-nccl the NCCL round trip alone (2 GPUs), with and without MPS
for mps in on off; do
  mps_$mps
  "$B/bench/symbiosis-bench-roundtrip" --executor-device cuda:0 --client-device cuda:1 --dtype bf16 \
    --transports nccl,tcp > "$logs/roundtrip-nccl-mps-$mps.txt" 2>&1
  echo "== MPS $mps"; cat "$logs/roundtrip-nccl-mps-$mps.txt"
done
