#!/usr/bin/env bash
# [Fuzzing] Runs one libFuzzer harness: first its regression inputs, each once (a fixed finding
# must stay fixed), then fuzzing over its seed corpus and the working corpus in WORK_DIR/NAME (new
# inputs go there, not into the committed corpus). Findings are written to WORK_DIR/NAME-findings/.
#   fuzz/run.sh PROGRAM NAME WORK_DIR [libFuzzer options: -max_total_time=S, -runs=N, ...]
set -euo pipefail
program=$1 name=$2 work=$3
shift 3
source_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
corpus=$work/$name findings=$work/$name-findings
mkdir -p "$corpus" "$findings"
options=(-artifact_prefix="$findings/" -print_final_stats=1 -timeout=20)
[ -f "$source_dir/dicts/$name.dict" ] && options+=(-dict="$source_dir/dicts/$name.dict")
# LibTorch and libstdc++ are not instrumented: their containers' annotations would mislead ASan.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:detect_container_overflow=0:detect_odr_violation=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
regressions=("$source_dir/regressions/$name"/*)
if [ -e "${regressions[0]}" ]; then
  echo "[fuzz] $name: ${#regressions[@]} regression inputs"
  "$program" "${options[@]}" "${regressions[@]}"
fi
echo "[fuzz] $name: $program ${options[*]} $* $corpus $source_dir/corpus/$name"
exec "$program" "${options[@]}" "$@" "$corpus" "$source_dir/corpus/$name"
