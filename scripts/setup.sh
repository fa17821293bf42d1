#!/usr/bin/env bash
# Installs what Symbiosis builds with (Debian packages, a Python venv with torch), configures the
# build and builds it. Idempotent: a second run does no apt or pip work and only asks ninja to build.
#   SYMBIOSIS_VENV  the venv (default ~/.cache/symbiosis/venv, outside the checkout, shared by clones)
#   BUILD_DIR       the build folder (default build)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${SYMBIOSIS_VENV:-${HOME:-/root}/.cache/symbiosis/venv}
BUILD_DIR=${BUILD_DIR:-build}
TORCH_VERSION=2.11.0
APT_PACKAGES=(build-essential cmake ninja-build ccache pkg-config libzmq3-dev cppzmq-dev
  libprotobuf-dev protobuf-compiler libspdlog-dev libfmt-dev libgtest-dev libgmock-dev
  nlohmann-json3-dev libcli11-dev python3-venv python3-dev libpcre2-dev libutf8proc-dev libsodium-dev libcpp-httplib-dev libgloo-dev)
# pybind11 (the Python package's binding, python/CMakeLists.txt) at the version torch's own headers
# carry; pytest runs the Python package's tests (tests/python/). symbiosis-serve (python/symbiosis/
# serve/) runs on FastAPI, uvicorn (on uvloop and httptools, which uvicorn takes when they are there:
# the HTTP path's tokens/s 1.36x of asyncio's, docs/serving.md) and prometheus_client; its tests'
# client is the openai package.
# symbiosis-tinker (python/symbiosis/tinker/) reads and writes the tinker SDK's own protobuf schema
# ([Tinker wire]), and its tests' client is that SDK.
PYBIND11_VERSION=3.0.1
SERVE_PACKAGES=(fastapi==0.165.0 uvicorn==0.54.0 uvloop==0.23.0 httptools==0.9.0 prometheus_client==0.26.0
  openai==3.57.0 tinker==0.38.0)
PIP_PACKAGES=(torch==$TORCH_VERSION transformers peft safetensors numpy matplotlib sentencepiece protobuf
  pybind11==$PYBIND11_VERSION pytest "${SERVE_PACKAGES[@]}")

log() { echo "[setup] $*"; }
SUDO=
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi

# 1. Debian packages: install only the missing ones; apt-get update only then.
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
fi

# 2. The Python venv with torch (its LibTorch is what we link) and the tests' reference packages.
if ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
  log "creating venv $VENV"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
fi
# Fast check (~0.1 s): the distributions are installed and torch is $TORCH_VERSION; this is what
# decides whether pip has work to do. After a pip run, the packages must also import.
FAST_PROBE="import importlib.metadata as md, importlib.util as u, os
assert md.version('torch').startswith('$TORCH_VERSION'), md.version('torch')
for m in ('transformers', 'peft', 'safetensors', 'numpy', 'matplotlib', 'sentencepiece', 'tokenizers', 'protobuf', 'pytest'): md.version(m)
assert md.version('pybind11') == '$PYBIND11_VERSION', md.version('pybind11')
for pinned in '${SERVE_PACKAGES[*]}'.split(): name, version = pinned.split('=='); assert md.version(name) == version, pinned
print(os.path.join(u.find_spec('torch').submodule_search_locations[0], 'share', 'cmake'))"
IMPORT_PROBE="import torch, transformers, peft, safetensors, matplotlib, sentencepiece, tokenizers, google.protobuf, pybind11, pytest, fastapi, uvicorn, prometheus_client, openai, tinker
assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__
print(torch.utils.cmake_prefix_path)"
if ! TORCH_PREFIX=$("$VENV/bin/python" -c "$FAST_PROBE" 2>/dev/null); then
  log "pip install ${PIP_PACKAGES[*]} into $VENV"
  "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off "${PIP_PACKAGES[@]}"
  TORCH_PREFIX=$("$VENV/bin/python" -c "$IMPORT_PROBE")
fi

# The Python package symbiosis is this build's own ([This build's Python], python/CMakeLists.txt:
# BUILD_DIR/venv). A symbiosis.pth in the shared venv, which earlier versions wrote, named one
# checkout for all of them: it goes.
SITE_PACKAGES=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -f "$SITE_PACKAGES/symbiosis.pth" ]; then
  log "removing $SITE_PACKAGES/symbiosis.pth (each build has its own: $BUILD_DIR/venv)"
  rm -f "$SITE_PACKAGES/symbiosis.pth"
fi

# 2b. tinker-cookbook's recipes run against symbiosis-tinker as a user runs them (tests/python/
# test_tinker_cookbook.py), from an environment of their own: the cookbook pins a transformers of
# its own. It sees the shared venv's packages after its own (torch is not installed twice).
COOKBOOK_VENV=${SYMBIOSIS_COOKBOOK_VENV:-$(dirname "$VENV")/cookbook-venv}
COOKBOOK_PACKAGES=(tinker-cookbook==0.5.8 tinker==0.38.0 sympy pylatexenc math-verify)
if ! "$COOKBOOK_VENV/bin/python" -c 'import tinker_cookbook.recipes.rl_loop' 2>/dev/null; then
  log "making $COOKBOOK_VENV: ${COOKBOOK_PACKAGES[*]}"
  rm -rf "$COOKBOOK_VENV"
  python3 -m venv "$COOKBOOK_VENV"
  "$COOKBOOK_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    | xargs -I{} sh -c "echo '$SITE_PACKAGES' > '{}/shared-venv.pth'"
  "$COOKBOOK_VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off "${COOKBOOK_PACKAGES[@]}"
fi

# 3. Configure (only when not configured, or configured with other values), then build.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
CACHE=$BUILD_DIR/CMakeCache.txt
cache_is() { [ -f "$CACHE" ] && [ "$(sed -n "s/^$1:[A-Z]*=//p" "$CACHE")" = "$2" ]; }
if [ -f "$CACHE" ] && ! cache_is CMAKE_GENERATOR Ninja; then
  log "$BUILD_DIR was configured with another generator: starting it afresh"
  rm -rf "$CACHE" "$BUILD_DIR/CMakeFiles"
fi
if [ ! -f "$BUILD_DIR/build.ninja" ] || ! cache_is CMAKE_BUILD_TYPE RelWithDebInfo \
   || ! cache_is CMAKE_PREFIX_PATH "$TORCH_PREFIX" || ! cache_is SYMBIOSIS_PYTHON "$VENV/bin/python"; then
  log "configuring $BUILD_DIR"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DSYMBIOSIS_PYTHON="$VENV/bin/python"
fi
log "building $BUILD_DIR"
cmake --build "$BUILD_DIR" -j"$(nproc)"
