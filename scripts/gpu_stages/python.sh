# stages: python
# python         Python tenants (docs/python.md): tests/python/test_gpu.py (symbiosis-serve's engine and symbiosis-tinker
#                need the wheels of .whl installed first; a tenant on cuda:0 over cuda-ipc and, with
#                2 GPUs, one on cuda:1 over nccl, each equal to the same transformers + PEFT model in one process: fp32
#                within 1e-5, bf16 within 5e-2), under MPS, then the CPU suite (tests/python, executors on the CPU;
#                PYTHON_CPU_SUITE=0 skips it), on pytest-xdist's workers where it is installed
python_package || return
mps_on
# PYTEST_K: only the GPU tests whose names match (pytest -k).
( cd tests/python && timeout 300 python3 -m pytest -q -p no:cacheprovider -rs ${PYTEST_K:+-k "$PYTEST_K"} test_gpu.py ) \
  > $logs/python-gpu.txt 2>&1
rc=$?
log "python GPU tests exited $rc: $(tail -1 $logs/python-gpu.txt)"
grep -E "^(FAILED|ERROR|SKIPPED)|Error:|assert " $logs/python-gpu.txt | head -20
[ $rc = 0 ] || cp $logs/python-gpu.txt "$out/"
mps_off
if [ "${PYTHON_CPU_SUITE:-1}" != 0 ]; then
  # One test at a time per worker; each starts its own executors on free ports.
  workers=""
  python3 -c 'import xdist' 2> /dev/null && workers="-n 8"
  ( cd tests/python && timeout 420 python3 -m pytest -q -p no:cacheprovider $workers --ignore=test_gpu.py . ) \
    > $logs/python-cpu.txt 2>&1
  rc=$?
  log "python CPU suite exited $rc: $(tail -1 $logs/python-cpu.txt)"
  grep -E "^(FAILED|ERROR)" $logs/python-cpu.txt | head -20
  [ $rc = 0 ] || cp $logs/python-cpu.txt "$out/"
fi
