BUILD_DIR     ?= build
CTEST_JOBS    ?= 2
CTEST_TIMEOUT ?= 900
export BUILD_DIR
# Torch's CMake package (used again by the installed-package test) needs nvcc to be found.
ifeq ($(shell command -v nvcc),)
  ifneq ($(wildcard /usr/local/cuda/bin/nvcc),)
    export CUDACXX ?= /usr/local/cuda/bin/nvcc
  endif
endif

.PHONY: build demo test check clean

# Install what is missing (apt, the venv), configure if needed, build.
build:
	bash scripts/setup.sh

demo: build
	bash examples/demo.sh $(BUILD_DIR)

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j$(CTEST_JOBS) --timeout $(CTEST_TIMEOUT) --no-tests=error

# The fast set: the unit-labelled tests ([Test labels] in tests/CMakeLists.txt), no end-to-end
# runs, benchmarks, Python or fuzz replays.
check: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j$(CTEST_JOBS) --timeout $(CTEST_TIMEOUT) -L unit --no-tests=error

# The build folder only; the venv (~/.cache/symbiosis/venv) stays.
clean:
	rm -rf $(BUILD_DIR)
