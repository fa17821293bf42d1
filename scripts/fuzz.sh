#!/usr/bin/env bash
# [Fuzzing] (docs/fuzzing.md): builds the libFuzzer harnesses with clang in build-fuzz/ (LibTorch
# and the project's code instrumented with AddressSanitizer and UBSan, without CUDA) and runs each
# for a bounded time or number of executions, one after another.
#   scripts/fuzz.sh [SECONDS | --runs N] [TARGET ...]   (default: 60 seconds each, every target)
# Targets: wire_request call_records checkpoint peft_files. Needs clang and libclang-rt-dev
# (scripts/setup.sh installs them) and setup.sh's venv (SYMBIOSIS_VENV).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

limit=(-max_total_time=60)
if [ "${1:-}" = "--runs" ]; then
  limit=(-runs="$2")
  shift 2
elif [[ "${1:-}" =~ ^[0-9]+$ ]]; then
  limit=(-max_total_time="$1")
  shift
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(wire_request call_records checkpoint peft_files)

# clang with libFuzzer and the sanitizers' runtimes, from Debian; only this script needs them (make
# test replays the harnesses in the gcc build).
missing=()
for p in clang libclang-rt-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
  echo "[fuzz] apt-get install ${missing[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
fi

VENV=${SYMBIOSIS_VENV:-${HOME:-/root}/.cache/symbiosis/venv}
FUZZ_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
if [ ! -f "$FUZZ_DIR/build.ninja" ]; then
  torch_prefix=$("$VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  CC=clang CXX=clang++ cmake -S . -B "$FUZZ_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DSYMBIOSIS_PYTHON="$VENV/bin/python" \
    -DSYMBIOSIS_FUZZ=ON -DSYMBIOSIS_BUILD_TESTS=OFF -DCCACHE_PROGRAM=CCACHE_PROGRAM-NOTFOUND
fi
programs=()
for t in "${targets[@]}"; do programs+=("fuzz_$t"); done
# The build lock keeps this build and others in the same checkout from fighting over the cores.
flock /tmp/symbiosis-build.lock cmake --build "$FUZZ_DIR" --target "${programs[@]}"

failed=()
for t in "${targets[@]}"; do
  fuzz/run.sh "$FUZZ_DIR/fuzz/fuzz_$t" "$t" "$FUZZ_DIR/fuzz/work" "${limit[@]}" > "$FUZZ_DIR/fuzz/$t.log" 2>&1 \
    || failed+=("$t")
  grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::average_exec_per_sec)' "$FUZZ_DIR/fuzz/$t.log" \
    | sed "s/^/[fuzz] $t: /" || true
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "[fuzz] findings in: ${failed[*]} (see $FUZZ_DIR/fuzz/<target>.log and $FUZZ_DIR/fuzz/work/<target>-findings/)"
  exit 1
fi
