# stages: gtest
# gtest          one test binary, GPU_TEST, with GPU_FILTER (default *); its log printed
# GPU_MPS=1: under MPS (same-GPU tenants need it).
[ -n "${GPU_MPS:-}" ] && mps_on
run_gtest "$GPU_TEST" "${GPU_FILTER:-*}"
[ -n "${GPU_MPS:-}" ] && mps_off
cp "$logs/$GPU_TEST.log" "$out/"
grep -vE "^\[ +(RUN|OK) +\]" "$logs/$GPU_TEST.log" | tail -30
