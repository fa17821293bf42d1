# stages: tests
# tests          `ctest -L gpu`: every GPU suite a test a process ([GPU suites in ctest] in gpu_bundle.sh; those that
#                need 2 GPUs skip themselves on one; CTEST_JOBS at once, default 1; CTEST_REGEX: only those it
#                matches), under MPS, and
#                runtime_binding_test ([libstdc++ first]) built with this machine's toolchain
run_gtest runtime_binding_test  # [libstdc++ first] with this machine's toolchain
mps_on
# Every suite labelled gpu, a test a process (those needing more GPUs than here skip themselves).
ctest --test-dir "$B" -L gpu ${CTEST_REGEX:+-R "$CTEST_REGEX"} --output-on-failure --timeout "${GTEST_TIMEOUT:-300}" -j "${CTEST_JOBS:-1}" > $logs/ctest-gpu.log 2>&1
log "ctest -L gpu: $(grep -E 'tests passed' $logs/ctest-gpu.log)"
grep -E '\*\*\*|Failed|Not Run' $logs/ctest-gpu.log | grep -v 'tests passed' | head -20
grep -q '100% tests passed' $logs/ctest-gpu.log || cp $logs/ctest-gpu.log "$out/"
mps_off
