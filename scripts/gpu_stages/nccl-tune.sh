# stages: nccl-tune
# nccl-tune      NCCL's round trip and remote 1B at N = 8 under the NCCL settings in NCCL_TUNE
#                (';'-separated, each a space-separated list of VAR=value; "-" is NCCL's defaults),
#                with a [8192, 8192] layer beside the [2048, 2048] one (2 GPUs, MPS)
make_1b
mps_on
IFS=';' read -ra settings <<< "${NCCL_TUNE:--}"
for setting in "${settings[@]}"; do
  [ "$setting" = "-" ] && setting=""
  tag=$(echo "${setting:-default}" | tr ' =' '_-')
  echo "== NCCL settings: ${setting:-the defaults}"
  for hidden in 2048 8192; do
    env $setting NCCL_DEBUG=INFO NCCL_DEBUG_FILE=$logs/nccl-info-$tag.%p "$B/bench/symbiosis-bench-roundtrip" \
      --executor-device cuda:0 --client-device cuda:1 --dtype bf16 --transports nccl --hidden $hidden \
      --iterations 200 > "$logs/roundtrip-$tag-$hidden.txt" 2>&1
    grep -E "nccl|tokens" "$logs/roundtrip-$tag-$hidden.txt" | sed "s/^/[$hidden] /"
  done
  grep -h "p2p channels" $logs/nccl-info-$tag.* 2>/dev/null | head -2
  ( [ -n "$setting" ] && export $setting
    bench remote-$tag bench/scenarios/gpu_remote_llama1b.json --checkpoint $model_1b --counts "${TUNE_COUNTS:-8}" )
done
"$B/bench/symbiosis-bench-roundtrip" --executor-device cuda:0 --client-device cuda:0 --dtype bf16 \
  --transports cuda-ipc --hidden 8192 --iterations 200 > "$logs/roundtrip-ipc-8192.txt" 2>&1
grep -E "cuda-ipc|tokens" "$logs/roundtrip-ipc-8192.txt" | sed "s/^/[8192 same GPU] /"
mps_off
